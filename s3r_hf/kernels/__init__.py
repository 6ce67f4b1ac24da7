"""Attention kernels behind one interface: a torch reference and Triton kernels with the same signatures.

`get_backend(device)` returns the module whose functions the attention path calls. Every backend implements
`paged_dense_attention`, `paged_sparse_attention`, `write_kv`, `select_topk_candidates` and `select_index_views`
with the signatures of `s3r_hf.kernels.reference`, and is tested against it. CUDA tensors use Triton; CPU tensors
use the reference.
`S3R_HF_KERNELS=reference|triton` forces one (Triton on CPU needs `TRITON_INTERPRET=1`).

The fused decoder-layer kernels (`S3RConfig.fused_layers`) follow the same rule: `get_layer_backend(device)` returns
`layer_triton` or its reference, `layer_reference`.
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
    return reference if not _uses_triton(device) else importlib.import_module("s3r_hf.kernels.triton_backend")


def get_layer_backend(device: torch.device | str) -> ModuleType:
    """The fused decoder-layer kernels for tensors on `device` (`layer_triton` or `layer_reference`)."""
    name = "layer_triton" if _uses_triton(device) else "layer_reference"
    return importlib.import_module(f"s3r_hf.kernels.{name}")


def _uses_triton(device: torch.device | str) -> bool:
    choice = os.environ.get("S3R_HF_KERNELS", "auto")
    if choice not in ("auto", "reference", "triton"):
        raise ValueError(f"S3R_HF_KERNELS must be auto, reference or triton, got {choice!r}")
    # Triton modules are imported lazily: importing Triton is slow and must happen after TRITON_INTERPRET is set.
    return choice == "triton" or (choice == "auto" and torch.device(device).type == "cuda")


def triton_variants() -> set[tuple[str, str]]:
    """`(kernel name, specialization key)` of the variants of s3r-hf's Triton kernels built in this process so far
    (compiled, or read from Triton's disk cache), none before the Triton backend is first used; the engine reports
    and logs those a call adds."""
    attention = sys.modules.get("s3r_hf.kernels.triton_backend")
    layers = sys.modules.get("s3r_hf.kernels.layer_triton")
    return (attention.variant_keys() if attention is not None else set()) | (
        layers.layer_variant_keys() if layers is not None else set()
    )


__all__ = ["get_backend", "get_layer_backend", "reference", "triton_variants"]
