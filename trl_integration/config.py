"""`S3RGRPOConfig`: TRL's `GRPOConfig` plus the S3R rollout settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from s3r_hf.config import S3RConfig

ROLLOUT_MODES = ("s3r", "ar")
"""Values of `S3RGRPOConfig.s3r_rollout_mode`, passed to `generate` as `s3r_mode`."""


@dataclass
class S3RGRPOConfig(GRPOConfig):
    """`GRPOConfig` with S3R rollouts.

    Args:
        use_s3r (`bool`, defaults to `True`):
            Generate every rollout with S3R from the current policy; `False` falls back to TRL's own generation.
        s3r_config (`dict` or `str`, *optional*):
            `S3RConfig` fields, as a dict or a JSON string (command lines); `None` uses the paper's defaults.
        s3r_rollout_mode (`str`, defaults to `"s3r"`):
            `"s3r"` drafts and verifies; `"ar"` decodes densely in the same engine (same kernels, KV pool, CUDA graphs
            and compiled layers, no drafting), a baseline that separates what the engine gains over TRL's generation
            from what speculation adds. Both give exact samples.
    """

    use_s3r: bool = field(
        default=True,
        metadata={"help": "Generate rollouts with S3R (exact dense samples); False uses TRL's own generation."},
    )
    s3r_config: dict | str | None = field(
        default=None,
        metadata={"help": "S3RConfig fields as a dict or JSON string, e.g. '{\"draft_len\": 6}'."},
    )
    s3r_rollout_mode: str = field(
        default="s3r",
        metadata={"help": "'s3r' (speculative rollouts) or 'ar' (the S3R engine's dense decoding, a baseline).",
                  "choices": list(ROLLOUT_MODES)},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.s3r_rollout_mode not in ROLLOUT_MODES:
            raise ValueError(f"s3r_rollout_mode must be one of {list(ROLLOUT_MODES)}, got {self.s3r_rollout_mode!r}")
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
