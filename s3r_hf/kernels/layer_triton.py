"""Triton versions of `layer_reference.py`: a decoder layer's work around the attention in three kernels.

An HF decoder layer compiled by inductor still launches about eleven kernels besides the attention (two norms,
three GEMMs with a split-K reduction, rotary, SiLU·mul, two residual adds, the K/V write), each a few microseconds
of launch and ramp for a weight read that takes less at decode batch sizes. Here the norm rides on the GEMM that
reads its output (each program computes its rows' RMS first), the rotary and Qwen3's per-head norm on the Q/K/V
GEMM's output tile (a program owns one head, its two halves in two accumulators, which is what `rotate_half`
pairs), SiLU·mul on the gate/up GEMM (a program owns matching gate and up columns), and the residual add on the
O and down projections. The weights are read from the model's own linears: nothing is copied, so an optimizer step
between calls needs nothing refreshed.

Every function has the signature and results of its reference (`layer_reference.py`); tests compare them, on CUDA
and under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from s3r_hf.kernels.triton_backend import _dot_precision, variant_keys


def _block_m(rows: int) -> int:
    """Rows per program: tensor-core tiles need 16 at least; more rows reuse each weight tile for more of them."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


_BLOCK_K = 64
# The row count `M` changes from step to step and is left unspecialized (`do_not_specialize`): no new variant is
# compiled when it happens to be 1 or a multiple of 16 (see `triton_backend`).
_STAGES = 2  # float32 tiles of 64 x 64 in three stages would crowd the shared memory the two accumulators leave
_WARPS = 4


@triton.jit
def _row_rstd(x_ptr, rows, row_ok, stride_xm, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / RMS of each row of `x` (float32), as `LlamaRMSNorm` computes it."""
    ks = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        squares += tl.sum(x * x, 1)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _normed_tile(x_ptr, norm_ptr, rows, row_ok, rstd, k0, stride_xm, K, BLOCK_K: tl.constexpr):
    """`[BLOCK_M, BLOCK_K]` of the normalized rows in the model dtype, rounded where `LlamaRMSNorm` rounds."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    dtype = x.dtype
    weight = tl.load(norm_ptr + ks, mask=k_ok, other=0.0)
    normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
    return (normed.to(tl.float32) * weight.to(tl.float32)[None, :]).to(dtype), ks, k_ok


@triton.jit(do_not_specialize=["M"])
def _norm_qkv_rope_kernel(
    x_ptr, norm_ptr, qw_ptr, kw_ptr, vw_ptr, qb_ptr, kb_ptr, vb_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, out_ptr,
    M, K, stride_xm, stride_cm, stride_om, stride_oh, eps, head_eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HEAD_NORM: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(1)  # queries 0..HQ-1, keys HQ..HQ+HKV-1, values after them
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    dims = tl.arange(0, HALF)
    if head < HQ:
        weight, bias, head_norm = qw_ptr + head * 2 * HALF * K, qb_ptr + head * 2 * HALF, qn_ptr
    elif head < HQ + HKV:
        weight, bias, head_norm = kw_ptr + (head - HQ) * 2 * HALF * K, kb_ptr + (head - HQ) * 2 * HALF, kn_ptr
    else:
        weight, bias, head_norm = (
            vw_ptr + (head - HQ - HKV) * 2 * HALF * K, vb_ptr + (head - HQ - HKV) * 2 * HALF, kn_ptr
        )
    rstd = _row_rstd(x_ptr, rows, row_ok, stride_xm, K, eps, BLOCK_M, BLOCK_K)
    low = tl.zeros([BLOCK_M, HALF], tl.float32)  # the head's first half of dimensions
    high = tl.zeros([BLOCK_M, HALF], tl.float32)  # its second half: `rotate_half` pairs dimension i with i + HALF
    for k0 in range(0, K, BLOCK_K):
        normed, ks, k_ok = _normed_tile(x_ptr, norm_ptr, rows, row_ok, rstd, k0, stride_xm, K, BLOCK_K)
        w_low = tl.load(weight + dims[:, None] * K + ks[None, :], mask=k_ok[None, :], other=0.0)
        w_high = tl.load(weight + (dims + HALF)[:, None] * K + ks[None, :], mask=k_ok[None, :], other=0.0)
        low += tl.dot(normed, tl.trans(w_low), input_precision=PRECISION)
        high += tl.dot(normed, tl.trans(w_high), input_precision=PRECISION)
    if HAS_BIAS:
        low += tl.load(bias + dims).to(tl.float32)[None, :]
        high += tl.load(bias + HALF + dims).to(tl.float32)[None, :]
    if head < HQ + HKV:  # queries and keys: per-head norm (Qwen3), then the rotary embedding
        if HEAD_NORM:
            head_rstd = 1.0 / tl.sqrt((tl.sum(low * low, 1) + tl.sum(high * high, 1)) / (2 * HALF) + head_eps)
            low = low * head_rstd[:, None] * tl.load(head_norm + dims).to(tl.float32)[None, :]
            high = high * head_rstd[:, None] * tl.load(head_norm + HALF + dims).to(tl.float32)[None, :]
        angles = rows[:, None] * stride_cm + dims[None, :]
        mask = row_ok[:, None]
        cos_low = tl.load(cos_ptr + angles, mask=mask, other=0.0).to(tl.float32)
        cos_high = tl.load(cos_ptr + angles + HALF, mask=mask, other=0.0).to(tl.float32)
        sin_low = tl.load(sin_ptr + angles, mask=mask, other=0.0).to(tl.float32)
        sin_high = tl.load(sin_ptr + angles + HALF, mask=mask, other=0.0).to(tl.float32)
        low, high = low * cos_low - high * sin_low, high * cos_high + low * sin_high
    out = out_ptr + rows[:, None] * stride_om + head * stride_oh + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out, low.to(dtype), mask=row_ok[:, None])
    tl.store(out + HALF, high.to(dtype), mask=row_ok[:, None])


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
    head_norm_eps: float = 1e-6,
) -> torch.Tensor:
    """Triton version of `layer_reference.norm_qkv_rope` (same arguments and result)."""
    rows, hidden = x.shape
    num_heads, num_kv_heads = q_weight.shape[0] // head_dim, k_weight.shape[0] // head_dim
    out = torch.empty(rows, num_heads + 2 * num_kv_heads, head_dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    has_bias = q_bias is not None
    head_norm = q_norm_weight is not None
    placeholder = norm_weight  # any pointer of the weights' dtype where an optional tensor is absent
    block_m = _block_m(rows)
    _norm_qkv_rope_kernel[(triton.cdiv(rows, block_m), num_heads + 2 * num_kv_heads)](
        x, norm_weight, q_weight.contiguous(), k_weight.contiguous(), v_weight.contiguous(),
        q_bias if has_bias else placeholder, k_bias if has_bias else placeholder, v_bias if has_bias else placeholder,
        cos, sin, q_norm_weight if head_norm else placeholder, k_norm_weight if head_norm else placeholder, out,
        rows, hidden, x.stride(0), cos.stride(0), out.stride(0), out.stride(1), eps, head_norm_eps,
        HQ=num_heads, HKV=num_kv_heads, HALF=head_dim // 2, BLOCK_M=block_m, BLOCK_K=_BLOCK_K,
        HAS_BIAS=has_bias, HEAD_NORM=head_norm, PRECISION=_dot_precision(x.dtype), num_warps=_WARPS,
        num_stages=_STAGES,
    )
    return out


@triton.jit(do_not_specialize=["M"])
def _norm_gate_up_silu_kernel(
    x_ptr, norm_ptr, gate_ptr, up_ptr, out_ptr, M, K, N, stride_xm, stride_om, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rstd = _row_rstd(x_ptr, rows, row_ok, stride_xm, K, eps, BLOCK_M, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        normed, ks, k_ok = _normed_tile(x_ptr, norm_ptr, rows, row_ok, rstd, k0, stride_xm, K, BLOCK_K)
        mask = col_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(gate_ptr + cols[:, None] * K + ks[None, :], mask=mask, other=0.0)
        w_up = tl.load(up_ptr + cols[:, None] * K + ks[None, :], mask=mask, other=0.0)
        gate += tl.dot(normed, tl.trans(w_gate), input_precision=PRECISION)
        up += tl.dot(normed, tl.trans(w_up), input_precision=PRECISION)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _tiles(rows: int, columns: int) -> tuple[int, int, tuple[int, int]]:
    """`(BLOCK_M, BLOCK_N, grid)` of a GEMM kernel over `[rows, columns]` outputs: 64 columns per program, or 32
    where 64 would leave most of an H200's 132 SMs without a program."""
    block_m = _block_m(rows)
    block_n = 64 if triton.cdiv(rows, block_m) * triton.cdiv(columns, 64) >= 132 else 32
    return block_m, block_n, (triton.cdiv(rows, block_m), triton.cdiv(columns, block_n))


def norm_gate_up_silu(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_weight: torch.Tensor, up_weight: torch.Tensor
) -> torch.Tensor:
    """Triton version of `layer_reference.norm_gate_up_silu` (same arguments and result)."""
    rows, hidden = x.shape
    columns = gate_weight.shape[0]
    out = torch.empty(rows, columns, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x.contiguous()
    block_m, block_n, grid = _tiles(rows, columns)
    _norm_gate_up_silu_kernel[grid](
        x, norm_weight, gate_weight.contiguous(), up_weight.contiguous(), out, rows, hidden, columns,
        x.stride(0), out.stride(0), eps,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, PRECISION=_dot_precision(x.dtype), num_warps=_WARPS,
        num_stages=_STAGES,
    )
    return out


@triton.jit(do_not_specialize=["M"])
def _linear_residual_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, M, K, N, stride_xm, stride_rm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * K + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    acc += tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def linear_residual(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
) -> torch.Tensor:
    """Triton version of `layer_reference.linear_residual` (same arguments and result)."""
    rows, inner = x.shape
    columns = weight.shape[0]
    out = torch.empty(rows, columns, dtype=residual.dtype, device=residual.device)
    if rows == 0:
        return out
    x, residual = x.contiguous(), residual.contiguous()
    block_m, block_n, grid = _tiles(rows, columns)
    _linear_residual_kernel[grid](
        x, weight.contiguous(), bias if bias is not None else weight, residual, out, rows, inner, columns,
        x.stride(0), residual.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_BLOCK_K, HAS_BIAS=bias is not None,
        PRECISION=_dot_precision(x.dtype), num_warps=_WARPS, num_stages=_STAGES,
    )
    return out


KERNELS = (_norm_qkv_rope_kernel, _norm_gate_up_silu_kernel, _linear_residual_kernel)


def layer_variant_keys() -> set[tuple[str, str]]:
    """`(kernel name, specialization key)` of every variant of the layer kernels built in this process."""
    return variant_keys(KERNELS)
