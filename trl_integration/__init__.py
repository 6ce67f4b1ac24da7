"""TRL swap-in: `S3RGRPOConfig` / `S3RGRPOTrainer` in place of `GRPOConfig` / `GRPOTrainer`."""

from trl_integration.trl_version import check_trl

check_trl()  # before TRL's trainer is imported: a missing or untested TRL fails here, with what to install

from trl_integration.config import S3RGRPOConfig  # noqa: E402
from trl_integration.trainer import S3RGRPOTrainer  # noqa: E402

__all__ = ["S3RGRPOConfig", "S3RGRPOTrainer"]
