"""Torch references of the fused decoder-layer kernels (`S3RConfig.fused_layers`).

A Llama-family decoder layer (Llama, Qwen2, Qwen3, Mistral, SmolLM) in a decode-shaped forward is three GEMMs with
elementwise work around them, and the attention:

    q, k, v = norm_qkv_rope(x, ...)           RMSNorm, Q/K/V projections (+ bias), Qwen3's per-head norm, rotary
    (K/V written to the pool; attention)
    h = linear_residual(attn, o_proj, x)      O projection + residual
    a = norm_gate_up_silu(h, ...)             RMSNorm, gate/up projections, SiLU(gate) * up
    y = linear_residual(a, down_proj, h)      down projection + residual

and after the last layer's norm, a float32 model's `lm_head(y, weight)` (`fused_layers` runs it where cuBLAS's float32
GEMMs at these row counts are slow).

Each function reads the weights of the model's own modules (no copies), takes rows `[M, hidden]` and returns rows
in the input's dtype. Products accumulate in float32 and are rounded once, where the model's modules round after
each operation; the normalized input is rounded as `LlamaRMSNorm` rounds it. These functions are the ground truth
the Triton kernels of `layer_triton.py` are tested against, and what runs on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from s3r_hf.kernels.reference import write_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm`: normalized in float32, rounded to the input dtype, times the weight (in the input dtype)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of float32 heads `[M, H, D]` with `cos`/`sin` `[M, D]` (transformers' `rotate_half` form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None].float() + rotated * sin[:, None].float()


def _head_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of float32 heads `[M, H, D]` (none when `weight` is None)."""
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def norm_qkv_rope(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    v_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_bias: torch.Tensor | None,
    v_bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    q_norm_eps: float = 1e-6,
    k_norm_eps: float = 1e-6,
    key_pool: torch.Tensor | None = None,
    value_pool: torch.Tensor | None = None,
    pool_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Q, K and V heads of rows `x` `[M, hidden]`: `[M, Hq + 2 Hkv, head_dim]`, queries first, then keys, then values.

    `cos`/`sin` are `[M, head_dim]` (the model's rotary embedding at each row's position); queries and keys are
    rotated after the per-head norm (`q_norm_weight`/`k_norm_weight` with their own `q_norm_eps`/`k_norm_eps`,
    Qwen3) where the model has one. With
    `key_pool`/`value_pool` (`[pages, page_size, Hkv, head_dim]`) the keys and values are also written to them at
    flat rows `pool_rows` `[M]`, as `kernels.write_kv` writes them (the cache's K/V write, fused).
    """
    normed = rms_norm(x, norm_weight, eps)
    rows = x.shape[0]

    def project(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = normed.float() @ weight.float().t()
        if bias is not None:
            out = out + bias.float()
        return out.view(rows, -1, head_dim)

    q = _rotate(_head_norm(project(q_weight, q_bias), q_norm_weight, q_norm_eps), cos, sin)
    k = _rotate(_head_norm(project(k_weight, k_bias), k_norm_weight, k_norm_eps), cos, sin)
    v = project(v_weight, v_bias)
    out = torch.cat([q, k, v], dim=1).to(x.dtype)
    if key_pool is not None:
        heads = k.shape[1]
        write_kv(key_pool, value_pool, pool_rows, out[:, -2 * heads : -heads], out[:, -heads:])
    return out


def norm_gate_up_silu(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, up_weight: torch.Tensor
) -> torch.Tensor:
    """`SiLU(gate(norm(x))) * up(norm(x))` of rows `x` `[M, hidden]`: `[M, intermediate]`."""
    normed = rms_norm(x, norm_weight, eps).float()
    return (F.silu(normed @ gate_weight.float().t()) * (normed @ up_weight.float().t())).to(x.dtype)


def linear_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """`residual + x @ weight.T (+ bias)` of rows `x` `[M, K]`: `[M, N]` in the residual's dtype."""
    out = residual.float() + x.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(residual.dtype)


def mlp_block(
    attended: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    down_weight: torch.Tensor,
) -> torch.Tensor:
    """A layer's work after the attention: `linear_residual` (O), `norm_gate_up_silu`, `linear_residual` (down).
    `attended` is `[M, heads * head_dim]` and the layer's input `residual` `[M, hidden]`; the result is the layer's
    output `[M, hidden]`."""
    mixed = linear_residual(attended, o_weight, o_bias, residual)
    activated = norm_gate_up_silu(mixed, norm_weight, eps, gate_weight, up_weight)
    return linear_residual(activated, down_weight, None, mixed)


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits `x @ weight.T` of rows `x` `[M, hidden]` with a bias-free LM head `weight` `[V, hidden]`: `[M, V]` in
    the input's dtype."""
    return (x.float() @ weight.float().t()).to(x.dtype)
