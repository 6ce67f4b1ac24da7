"""What S3R keeps for a model between `generate` calls, and `release(model)` to drop it.

An RL loop calls `generate` once per step with similar shapes. The adaptive draft-length rule learns, per batch and
context bucket, what a round costs and how often drafts are accepted; kept per model, a later call starts from what
earlier calls measured instead of probing every bucket again. It holds a few hundred numbers, no device memory.
The KV pool, the CUDA graphs and the fused projection weights are still built per call (see docs/architecture.md).
"""

from __future__ import annotations

import threading
import weakref

import torch

from s3r_hf.config import S3RConfig
from s3r_hf.draft_policy import AdaptiveDraftLength, adaptive_for

_lock = threading.Lock()
_policies: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, AdaptiveDraftLength]] = weakref.WeakKeyDictionary()


def adaptive_policy(model: torch.nn.Module, config: S3RConfig) -> AdaptiveDraftLength:
    """The model's adaptive draft-length rule for `config.draft_len`, created on first use and kept across calls."""
    with _lock:
        per_length = _policies.setdefault(model, {})
        policy = per_length.get(config.draft_len)
        if policy is None:
            policy = per_length[config.draft_len] = adaptive_for(config.draft_len)
        return policy


def release(model: torch.nn.Module) -> None:
    """Forget what S3R learned about `model` in earlier calls (the next call measures its costs afresh). Call it
    after changing the model's size, dtype or device, or the machine it runs on."""
    with _lock:
        _policies.pop(model, None)
