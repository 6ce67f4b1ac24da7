"""TRL swap-in: `S3RGRPOConfig` / `S3RGRPOTrainer` in place of `GRPOConfig` / `GRPOTrainer`."""

from trl_integration.config import S3RGRPOConfig
from trl_integration.trainer import S3RGRPOTrainer

__all__ = ["S3RGRPOConfig", "S3RGRPOTrainer"]
