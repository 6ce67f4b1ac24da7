"""Fused decoder layers for decode-shaped engine forwards (`S3RConfig.fused_layers`).

At decode batch sizes a small model's forward costs its kernel launches, not its bytes: even compiled, a decoder
layer launches about eleven kernels besides the attention (docs/benchmarks.md, "Where the time goes"). With
`fused_layers` a Llama-family layer (Llama, Qwen2, Qwen3, Mistral, SmolLM) runs as

    norm_qkv_rope (+ K/V write) -> attention -> linear_residual (O) -> norm_gate_up_silu -> linear_residual (down)

four launches and the attention's own (`s3r_hf.kernels.layer_triton`; `layer_reference` on CPU); the last three are
`mlp_block`, which `layer_triton.PERSISTENT_MLP` runs as one persistent launch. Forwards of more than
`FUSED_MAX_TOKENS` packed tokens (prefill chunks) run the layer's own forward, compiled where `compile_layers`
says so: at those sizes a tuned GEMM library beats these kernels and launches do not matter. (A float32 LM head runs
on tensor cores in every engine forward, fused layers or not: `s3r_hf.lm_head`.)

Under autocast to another dtype than the weights' (`accelerate`'s mixed precision), the layers run their own forward:
the kernels compute in the weights' dtype.

The kernels read the weights of the model's own modules at every forward: nothing is copied, so an optimizer step
between calls is picked up without a refresh, and a CUDA graph captured in one call reads the same parameters in
the next. The fused forwards are installed only while an engine runs and only act in the thread holding the model
for S3R (`model_session.owns`); the model's own forward (the training step, a plain `generate`) is never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from transformers import PreTrainedModel

from s3r_hf.attention import s3r_attention_forward
from s3r_hf.compiled_layers import decoder_layers, replaced_forwards
from s3r_hf.fused_projections import FusedLinearSlice
from s3r_hf.kernels import get_layer_backend
from s3r_hf.lm_head import autocast_changes
from s3r_hf.model_session import owns
from s3r_hf.validation import UnsupportedModelError

# Packed tokens up to which a forward runs fused: every draft pass, dense step and verify block of up to 146 rows
# of seven queries; prefill chunks above it run the layer's own forward.
FUSED_MAX_TOKENS = 1024

# RMSNorm classes that compute `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)` (not Gemma's `1 + weight`).
_RMS_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
_SILU = {"SiLU", "SiLUActivation"}


@dataclass
class LayerParts:
    """The modules a fused layer reads (the model's own linears, unwrapped from compiled layers' fused slices)."""

    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    attention: torch.nn.Module
    q: torch.nn.Linear
    k: torch.nn.Linear
    v: torch.nn.Linear
    o: torch.nn.Linear
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    head_dim: int


def _linear(module: torch.nn.Module) -> torch.nn.Module:
    return module.original[0] if isinstance(module, FusedLinearSlice) else module


def layer_parts(layer: torch.nn.Module) -> LayerParts:
    """The parts of a Llama-family decoder layer, or `UnsupportedModelError` naming what does not fit."""
    name = type(layer).__name__
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None:
        raise UnsupportedModelError(f"S3RConfig.fused_layers: {name} has no self_attn / mlp modules")
    linears = {
        part: _linear(getattr(owner, f"{part}_proj", None))
        for owner, parts in ((attention, "qkvo"), (mlp, ("gate", "up", "down")))
        for part in parts
    }
    odd = [part for part, linear in linears.items() if type(linear) is not torch.nn.Linear]
    if odd:
        raise UnsupportedModelError(
            f"S3RConfig.fused_layers: {name}'s {', '.join(p + '_proj' for p in odd)} are not plain nn.Linear "
            "(LoRA or quantized layers run unfused: leave fused_layers off)"
        )
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    head_norms = [getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)]
    for norm in norms + [n for n in head_norms if n is not None]:
        if type(norm).__name__ not in _RMS_NORMS:
            raise UnsupportedModelError(
                f"S3RConfig.fused_layers: {name} uses {type(norm).__name__}; the fused layers implement "
                f"{', '.join(sorted(_RMS_NORMS))}"
            )
    if type(getattr(mlp, "act_fn", None)).__name__ not in _SILU:
        raise UnsupportedModelError(f"S3RConfig.fused_layers: {name}'s MLP activation is not SiLU")
    if any(linears[p].bias is not None for p in ("gate", "up", "down")):
        raise UnsupportedModelError(f"S3RConfig.fused_layers: {name}'s MLP has biases")
    if (linears["k"].bias is None) != (linears["q"].bias is None) or (linears["v"].bias is None) != (
        linears["q"].bias is None
    ):
        raise UnsupportedModelError(f"S3RConfig.fused_layers: {name} biases some of Q/K/V and not others")
    head_dim = getattr(attention, "head_dim", None)
    # Wider heads hold a program's two rotary halves of 128+ float32 columns each: never built or tested.
    if not head_dim or head_dim < 32 or head_dim > 128 or head_dim & (head_dim - 1):
        raise UnsupportedModelError(
            f"S3RConfig.fused_layers: head_dim {head_dim} of {name}; the fused kernels need 32, 64 or 128"
        )
    return LayerParts(*norms, attention, *linears.values(), *head_norms, head_dim)


def check_fusable(model: PreTrainedModel) -> None:
    """Raise `UnsupportedModelError` unless every decoder layer of `model` can run fused."""
    for layer in decoder_layers(model):
        layer_parts(layer)


def fused_forward(parts: LayerParts, ops: ModuleType, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """One decoder layer of an engine step: `[1, N, hidden]` in, `[1, N, hidden]` out, computed by `ops`
    (`layer_triton` or `layer_reference`)."""
    attention, q_norm, k_norm = parts.attention, parts.q_norm, parts.k_norm
    x = hidden_states[0]
    cos, sin = kwargs["position_embeddings"]
    # The kernel writes the step's K/V into the cache's pools itself, in place of `S3RCache.update`'s launch.
    qkv = ops.norm_qkv_rope(
        x, parts.input_norm.weight, parts.input_norm.variance_epsilon, parts.q.weight, parts.k.weight,
        parts.v.weight, parts.q.bias, parts.k.bias, parts.v.bias, cos[0], sin[0], parts.head_dim,
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
        1e-6 if q_norm is None else q_norm.variance_epsilon, 1e-6 if k_norm is None else k_norm.variance_epsilon,
        *kwargs["s3r_cache"].step_kv_target(attention.layer_idx),
    )
    num_heads = parts.q.out_features // parts.head_dim
    num_kv_heads = parts.k.out_features // parts.head_dim
    # `[1, H, N, D]` views, as the model's attention module hands them to the cache and the attention function.
    query, key, value = (
        part[None].transpose(1, 2)
        for part in qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    )
    attended, _ = s3r_attention_forward(
        attention, query, key, value, None, dropout=0.0, scaling=attention.scaling,
        **{k: v for k, v in kwargs.items() if k in ("s3r_step", "s3r_cache")},
    )
    return ops.mlp_block(
        attended.reshape(x.shape[0], -1), parts.o.weight, parts.o.bias, x, parts.post_norm.weight,
        parts.post_norm.variance_epsilon, parts.gate.weight, parts.up.weight, parts.down.weight,
    )[None]


@contextlib.contextmanager
def fused_decoder_layers(model: PreTrainedModel) -> Iterator[None]:
    """Run the block with every decoder layer's engine forwards of up to `FUSED_MAX_TOKENS` tokens fused; other
    forwards, and forwards in other threads, go to the layer's forward as it was on entry (compiled or not)."""
    layers = decoder_layers(model)
    parts = {layer: layer_parts(layer) for layer in layers}
    ops = get_layer_backend(model.device)  # chosen once per call, not per layer and forward
    with replaced_forwards(layers, lambda layer, own: _dispatch(model, parts[layer], ops, own)):
        yield


def _dispatch(model: PreTrainedModel, parts: LayerParts, ops: ModuleType, own: Callable) -> Callable:
    def forward(hidden_states, *args, **kwargs):
        if (
            args or "s3r_step" not in kwargs or hidden_states.shape[1] > FUSED_MAX_TOKENS or hidden_states.shape[0] != 1
            or not owns(model) or autocast_changes(parts.q.weight.dtype, hidden_states.device)
        ):
            return own(hidden_states, *args, **kwargs)
        return fused_forward(parts, ops, hidden_states, kwargs)

    return forward
