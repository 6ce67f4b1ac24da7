"""`S3RGRPOConfig`: TRL's `GRPOConfig` plus the S3R rollout settings."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
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
        s3r_config (`dict`, `str` or `S3RConfig`, *optional*):
            `S3RConfig` fields, as a dict, a JSON string (command lines) or an `S3RConfig` (kept as its dict);
            `None` uses the paper's defaults.
        s3r_rollout_mode (`str`, defaults to `"s3r"`):
            `"s3r"` drafts and verifies; `"ar"` decodes densely in the same engine (same kernels, KV pool, CUDA graphs
            and compiled layers, no drafting), a baseline that separates what the engine gains over TRL's generation
            from what speculation adds. Both give exact samples.
        keep_rollout_state (`bool`, defaults to `True`):
            Keep S3R's KV pool, CUDA graphs and fused weights from one rollout to the next, so that every step after
            the first captures no graph and allocates no pool (`S3RConfig.keep_state`). They stay in device memory
            during the optimizer step: the pool holds every rollout sequence at full length (capped by
            `kv_memory_fraction` of the free memory), plus the graphs' scratch and, with compiled layers, a copy of
            the Q/K/V and gate/up weights. `False` (or `keep_state: false` in `s3r_config`) frees them when each
            rollout returns. Either way they are freed when `train()` returns.
        freeze_gc_after_first_rollout (`bool`, defaults to `True`):
            After the first S3R rollout, collect garbage once and move every object then alive into Python's
            permanent GC generation (`gc.freeze`, as vLLM does after its warm-up) until `train()` returns. The first
            rollout compiles layers, kernels and graphs whose many long-lived objects every later full collection
            would traverse again, a pause of about half a second in some step. Objects frozen there that later
            become cyclic garbage are freed only when training ends. Nothing is frozen where the collector is off.
            Where objects were frozen before training (by the caller, or at the process's start), the trainer's are
            left frozen with them when it ends, since `gc.unfreeze` would thaw those too.
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

    keep_rollout_state: bool = field(
        default=True,
        metadata={"help": "Keep S3R's KV pool and CUDA graphs between rollouts (faster steps; the memory stays held "
                          "during the optimizer step). False frees them after each rollout."},
    )

    freeze_gc_after_first_rollout: bool = field(
        default=True,
        metadata={"help": "Freeze the objects alive after the first S3R rollout (compiled layers, kernels, graphs) "
                          "out of Python's garbage collector until training ends, so that later full collections "
                          "do not pause a step."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("use_s3r", "keep_rollout_state", "freeze_gc_after_first_rollout"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # "false" would be truthy, None falsy: neither says what was meant
                raise ValueError(f"S3RGRPOConfig.{name} must be True or False, got {value!r}")
        if isinstance(self.s3r_config, S3RConfig):  # kept as a dict, so the arguments stay JSON (`to_json_string`)
            self.s3r_config = asdict(self.s3r_config)
        if self.s3r_rollout_mode not in ROLLOUT_MODES:
            raise ValueError(f"s3r_rollout_mode must be one of {list(ROLLOUT_MODES)}, got {self.s3r_rollout_mode!r}")
        if self.use_s3r:
            resolved = self.resolved_s3r_config()  # invalid fields fail here, before any model is loaded
            if resolved.return_logprobs:
                raise ValueError(
                    "s3r_config.return_logprobs: S3RGRPOTrainer returns no sampling log-probs, as TRL's own "
                    "transformers generation returns none (TRL computes the policy's log-probs itself); leave it False"
                )
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
        config = S3RConfig.coerce(value)
        return replace(config, keep_state=config.keep_state and self.keep_rollout_state)
