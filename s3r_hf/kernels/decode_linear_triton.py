"""A linear layer at decode row counts, with half-precision or 8-bit weights, in one Triton kernel.

At a draft pass's 64 rows a GEMM reads its weight once and does little arithmetic, so its time is the weight's bytes
at the memory's bandwidth once the GPU's SMs all stream. cuBLAS runs the Qwen3-1.7B shape's projections on fewer
output tiles than SMs at these rows (1.6-2.2x their weight reads for the down, Q/K/V and O projections,
docs/benchmarks.md). Here each output tile's K range is split over enough programs to fill the GPU, the partial sums
added in a float32 workspace, and the weights may be int8 or float8 (e4m3) with one scale per output feature, or one
per group of 64 or 128 weights along a row (each K tile is one group, its product scaled before it is added): half
the bytes. 8-bit weights change the products, so they serve only where the result is a proposal (the draft passes,
`S3RConfig.draft_weights`), never a verify or a dense step.

`decode_linear` and `decode_linear_reference.decode_linear_reference` take the same arguments and return the same
result up to the order of float32 additions (the split's partial sums are added atomically, in no fixed order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from s3r_hf.kernels.decode_linear_reference import QUANTIZED

GROUPS = (64, 128)  # the weights per scale a scale per group may cover: one K tile each


def default_launch(rows: int, out_features: int, in_features: int, device: torch.device
                   ) -> tuple[int, int, int, int, int]:
    """`(BLOCK_N, BLOCK_K, splits, warps, stages)`: 128-wide output tiles, and K split until the grid holds about
    two programs per SM with at least 256 of K each."""
    block_n, block_k = 128, 128
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    programs = triton.cdiv(out_features, block_n) * triton.cdiv(rows, 64)
    splits = 1
    while programs * splits * 2 <= 2 * sms and in_features // (splits * 2) >= 256:
        splits *= 2
    return block_n, block_k, splits, 4, 3


@triton.jit(do_not_specialize=["M"])
def _decode_linear_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
                          HAS_SCALE: tl.constexpr, GROUPED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if GROUPED:  # this K tile is one group of every row: its own scale per output feature
            group_scale = tl.load(scale_ptr + cols * (K // BLOCK_K) + k0 // BLOCK_K, mask=col_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype))) * group_scale[None, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    if HAS_SCALE and not GROUPED:
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    offsets = rows[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        tl.atomic_add(out_ptr + offsets, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  launch: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """`decode_linear_reference` as one Triton launch (two more, a zeroing and a cast, where K is split).

    `x` is `[M, K]` (bfloat16, float16 or float32, rows contiguous), `weight` `[N, K]` in `x`'s dtype, or float8 or
    int8 with float32 `scale` `[N]`, or `[N, K // group]` for groups of 64 or 128 weights (`quantize_rows`);
    `launch` overrides `default_launch` (with groups, its K tile is the group)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"decode_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if (weight.dtype in QUANTIZED) != (scale is not None):
        raise ValueError("decode_linear: float8 and int8 weights need a scale per output feature or group, other "
                         "weights none")
    rows, in_features = x.shape
    out_features = weight.shape[0]
    block_n, block_k, splits, warps, stages = launch or default_launch(rows, out_features, in_features, x.device)
    grouped = scale is not None and scale.dim() == 2
    if grouped:
        group = in_features // scale.shape[1] if scale.shape[0] == out_features else 0
        if group not in GROUPS or scale.shape[1] * group != in_features:
            raise ValueError(f"decode_linear: scales {tuple(scale.shape)} for weight {tuple(weight.shape)}; a scale "
                             f"per group takes groups of {' or '.join(map(str, GROUPS))} weights")
        block_k = group
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
    splits = triton.cdiv(in_features, k_per_split)
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    out = torch.zeros if splits > 1 else torch.empty
    result = out(rows, out_features, device=x.device, dtype=torch.float32 if splits > 1 else x.dtype)
    grid = (triton.cdiv(out_features, block_n), splits, triton.cdiv(rows, block_m))
    _decode_linear_kernel[grid](
        x, weight, scale if scale is not None else x, result, rows, out_features, in_features, k_per_split,
        x.stride(0), weight.stride(0), result.stride(0), HAS_SCALE=scale is not None, GROUPED=grouped,
        SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return result.to(x.dtype) if splits > 1 else result
