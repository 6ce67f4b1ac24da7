"""Attention kernels behind one interface: a torch reference today, faster backends with the same signatures.

`get_backend(device)` returns the module whose functions the attention path calls. Every backend implements
`paged_dense_attention`, `paged_sparse_attention` and `select_topk_candidates` with the signatures of
`s3r_hf.kernels.reference`, and is tested against it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from s3r_hf.kernels import reference


def get_backend(device: torch.device | str) -> ModuleType:
    """The kernel backend for tensors on `device` (currently the torch reference everywhere)."""
    return reference


__all__ = ["get_backend", "reference"]
