"""`S3RGRPOConfig`: TRL's `GRPOConfig` plus the S3R rollout settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from s3r_hf.config import S3RConfig


@dataclass
class S3RGRPOConfig(GRPOConfig):
    """`GRPOConfig` with S3R rollouts.

    Args:
        use_s3r (`bool`, defaults to `True`):
            Generate every rollout with S3R from the current policy; `False` falls back to TRL's own generation.
        s3r_config (`dict` or `str`, *optional*):
            `S3RConfig` fields, as a dict or a JSON string (command lines); `None` uses the paper's defaults.
    """

    use_s3r: bool = field(
        default=True,
        metadata={"help": "Generate rollouts with S3R (exact dense samples); False uses TRL's own generation."},
    )
    s3r_config: dict | str | None = field(
        default=None,
        metadata={"help": "S3RConfig fields as a dict or JSON string, e.g. '{\"draft_len\": 6}'."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.use_s3r:
            self.resolved_s3r_config()  # invalid fields fail here, before any model is loaded
            if self.use_vllm:
                raise ValueError("use_s3r and use_vllm both pick the rollout engine; set one of them to False")
            if getattr(self, "use_transformers_continuous_batching", False):
                raise ValueError(
                    "use_s3r and use_transformers_continuous_batching both pick the rollout engine; set one to False"
                )

    def resolved_s3r_config(self) -> S3RConfig:
        """The `S3RConfig` these arguments describe (dicts and JSON strings accepted)."""
        value: Any = self.s3r_config
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"s3r_config must be a JSON object of S3RConfig fields: {error}") from error
        return S3RConfig.coerce(value)
