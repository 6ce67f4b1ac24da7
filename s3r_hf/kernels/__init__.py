"""Attention kernels behind one interface: a torch reference and Triton kernels with the same signatures.

`get_backend(device)` returns the module whose functions the attention path calls. Every backend implements
`paged_dense_attention`, `paged_sparse_attention`, `write_kv` and `select_topk_candidates` with the signatures of
`s3r_hf.kernels.reference`, and is tested against it. CUDA tensors use Triton; CPU tensors use the reference.
`S3R_HF_KERNELS=reference|triton` forces one (Triton on CPU needs `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

from s3r_hf.kernels import reference


def get_backend(device: torch.device | str) -> ModuleType:
    """The kernel backend for tensors on `device`."""
    choice = os.environ.get("S3R_HF_KERNELS", "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"S3R_HF_KERNELS must be auto, reference or triton, got {choice!r}")
    if choice == "reference":
        return reference
    if choice == "triton" or torch.device(device).type == "cuda":
        # Imported lazily: importing Triton is slow and must happen after TRITON_INTERPRET is set.
        return importlib.import_module("s3r_hf.kernels.triton_backend")
    return reference


def triton_variants() -> set[tuple[str, str]]:
    """`(kernel name, specialization key)` of the variants of s3r-hf's Triton kernels built in this process so far
    (compiled, or read from Triton's disk cache), none before the Triton backend is first used; the engine reports
    and logs those a call adds."""
    module = sys.modules.get("s3r_hf.kernels.triton_backend")
    return module.variant_keys() if module is not None else set()


__all__ = ["get_backend", "reference", "triton_variants"]
