"""A float32 LM head on tensor cores for S3R's engine forwards.

cuBLAS runs a float32 GEMM on the CUDA cores, and at a verify block's row counts it picks tiles of 128 rows, so the
LM head of 2 requests costs what one of 16 does (docs/benchmarks.md, "a float32 LM head on tensor cores"). In S3R's
forwards a bias-free float32 `nn.Linear` head runs `layer_triton.lm_head` instead: three TF32 tensor-core products
per product (float32's accuracy), one TF32 product in a draft pass that allows TF32 (`draft_matmul_precision`).
Every engine forward takes it, whichever way its layers run (eager, compiled, fused); other dtypes keep cuBLAS, which
is at its floor there, and so does a float32 head fed half-precision hidden states (TRL's `cast_lm_head_to_fp32`
gives it a forward that casts them up).

The head reads the model's own weight at every forward (tied embeddings included), and acts only in the thread
holding the model for S3R (`model_session.owns`): a dense `generate` or the training step runs the head's own
forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from s3r_hf.compiled_layers import replaced_forwards
from s3r_hf.kernels import get_layer_backend
from s3r_hf.model_session import owns

logger = logging.get_logger(__name__)

# Packed tokens up to which a forward's head runs the kernel (`fused_layers.FUSED_MAX_TOKENS`, the same bound): every
# draft pass, dense step and verify block, and the last rows of prefill chunks.
MAX_ROWS = 1024


@contextlib.contextmanager
def float32_lm_head(model: PreTrainedModel) -> Iterator[None]:
    """Run the block with `model`'s LM head computed by `layer_triton.lm_head` (`layer_reference` off CUDA) in S3R's
    forwards, if it is a bias-free float32 `nn.Linear`; otherwise the block runs unchanged."""
    head = model.get_output_embeddings()
    if not fusable_head(head):
        yield
        return
    ops = get_layer_backend(model.device)
    with replaced_forwards([head], lambda module, own: _dispatch(model, module, ops, own)):
        yield


def fusable_head(head: torch.nn.Module | None) -> bool:
    """Whether `head` runs as the kernel: a bias-free float32 `nn.Linear`."""
    return type(head) is torch.nn.Linear and head.bias is None and head.weight.dtype == torch.float32


def _dispatch(model: PreTrainedModel, head: torch.nn.Linear, ops: ModuleType, own: Callable) -> Callable:
    def forward(hidden_states):
        if (
            hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[1] > MAX_ROWS
            or not owns(model) or autocast_changes(head.weight.dtype, hidden_states.device)
            # A float32 head over a lower-precision model runs through a forward of its own that casts (TRL's
            # `cast_lm_head_to_fp32`): its float32 logits are what the model samples from.
            or hidden_states.dtype != head.weight.dtype
        ):
            return own(hidden_states)
        return ops.lm_head(hidden_states[0], head.weight)[None]

    return forward


def autocast_changes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether autocast would run products of `dtype` weights in another dtype. The Triton kernels compute in the
    weights' dtype whatever autocast says (a float32 model under `accelerate`'s bf16 mixed precision, whose forward
    runs under autocast), so such a module runs its own forward, as the model computes it."""
    if not torch.is_autocast_enabled(device.type) or torch.get_autocast_dtype(device.type) == dtype:
        return False
    logger.warning_once(
        "s3r_hf: autocast runs this model's %s products in %s, which the Triton layer kernels do not; the layers "
        "and the LM head run their own forward", dtype, torch.get_autocast_dtype(device.type),
    )
    return True
