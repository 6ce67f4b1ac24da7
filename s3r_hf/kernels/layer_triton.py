"""Triton versions of `layer_reference.py`: a decoder layer's work around the attention in three kernels.

An HF decoder layer compiled by inductor still launches about eleven kernels besides the attention (two norms,
three GEMMs with a split-K reduction, rotary, SiLU·mul, two residual adds, the K/V write), each a few microseconds
of launch and ramp for a weight read that takes less at decode batch sizes. Here the norm rides on the GEMM that
reads its output (each program computes its rows' RMS first), the rotary and Qwen3's per-head norm on the Q/K/V
GEMM's output tile (a program owns one head, its two halves in two accumulators, which is what `rotate_half`
pairs), SiLU·mul on the gate/up GEMM (a program owns matching gate and up columns), and the residual add on the
O and down projections. The weights are read from the model's own linears: nothing is copied, so an optimizer step
between calls needs nothing refreshed.

At decode row counts a GEMM has few output tiles (15 Q/K/V heads for SmolLM2), so a program's chain of dependent
memory round trips sets the time, not its bytes. The chains are kept short: the norm's pass over a row up to
`UNROLLED_NORM_MAX` wide issues all of its loads at once (an unrolled loop), and what the epilogues read (rotary
cos/sin, biases, the residual) is loaded before the K loop, so those round trips overlap it. Where the tiles leave
SMs idle the K range is split over several programs (`_splits`); each stores its float32 partial sums, and the last
of a tile's programs to arrive (an atomic count) adds them in split order and runs the epilogue: one launch, and the
same result in every launch.

A float32 LM head (`lm_head`) is one more kernel: cuBLAS runs float32 GEMMs on the CUDA cores, and at a verify
block's row counts picks tiles of 128 rows, so a few rows cost what a hundred do; here each product is three TF32
tensor-core products (tf32x3, float32's accuracy), over 16-row tiles for draft passes and dense steps.

Every function has the signature and results of its reference (`layer_reference.py`); tests compare them, on CUDA
and under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from s3r_hf.kernels.triton_backend import _dot_precision, variant_keys

BLOCK_M_OVERRIDE: int | None = None  # replaces `_block_m`'s choice (`tools/layer_kernels.py --sweep`)


def _block_m(rows: int) -> int:
    """Rows per program: tensor-core tiles need 16 at least. Up to 32 rows, two programs of 16 rows beat one of 32
    (twice the programs in flight, each with a shorter chain); above, 64-row blocks reuse each weight tile for more
    rows (docs/benchmarks.md, "Kernel launch settings")."""
    if BLOCK_M_OVERRIDE is not None:
        return BLOCK_M_OVERRIDE
    return 16 if rows <= 32 else 64


# The row count `M` changes from step to step and is left unspecialized (`do_not_specialize`): no new variant is
# compiled when it happens to be 1 or a multiple of 16 (see `triton_backend`).

# `(BLOCK_K bytes per row, pipeline stages, warps)`: one row block (draft passes and dense steps, up to 64 rows) runs
# best with 256-byte K tiles and eight warps, more row blocks (verify blocks) with 128-byte tiles and four warps;
# three stages in both (docs/benchmarks.md, "Kernel launch settings"). `LAUNCH_OVERRIDE` replaces the choice
# (`tools/layer_kernels.py --sweep`).
LAUNCH_OVERRIDE: tuple[int, int, int] | None = None
MAX_SPLITS = 8  # most programs one output tile's K range is split over


def _launch(rows: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """`(BLOCK_K, stages, warps)` for a GEMM over `rows` rows of `dtype`."""
    if LAUNCH_OVERRIDE is not None:
        return LAUNCH_OVERRIDE
    row_bytes, stages, warps = (256, 3, 8) if rows <= 64 else (128, 3, 4)
    return row_bytes // dtype.itemsize, stages, warps


# Rows up to this many elements wide have their norm's loads issued at once. Wider rows hold too many registers
# that way: Qwen3-1.7B's 2,048 made the gate/up kernel slower (docs/benchmarks.md, "Kernel launch settings").
UNROLLED_NORM_MAX = 1024


def _norm_blocks(hidden: int, block_k: int) -> int:
    """`NORM_BLOCKS` of the norm kernels: the K tiles of the norm's unrolled pass over a row, or 0 for a loop."""
    return triton.cdiv(hidden, block_k) if hidden <= UNROLLED_NORM_MAX else 0


_sm_counts: dict[torch.device, int] = {}
_arrival_counts: dict[torch.device, torch.Tensor] = {}
_MAX_TILES = 4096


def _sm_count(device: torch.device) -> int:
    if device not in _sm_counts:
        _sm_counts[device] = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        )
    return _sm_counts[device]


def _splits(device: torch.device, programs: int, k_blocks: int) -> tuple[int, int]:
    """`(splits, K blocks per split)`: over how many programs each output tile's K range is split, doubled while the
    grid still fits the GPU's SMs once and each split keeps a K block, then lowered where equal shares of the
    blocks fill fewer. The point is the latency of each program's K loop, a chain of dependent loads, at decode row
    counts (see the module's docstring)."""
    splits = 1
    while splits * 2 <= min(MAX_SPLITS, k_blocks) and programs * splits * 2 <= _sm_count(device):
        splits *= 2
    share = triton.cdiv(k_blocks, splits)
    return triton.cdiv(k_blocks, share), share  # as many splits as the shares fill: none left empty


def _zeroed_counts(device: torch.device) -> torch.Tensor:
    """The device's int32 counts that the layer kernels synchronize their programs with. Every launch leaves the counts
    it used at zero (the last program to use each resets it), so one buffer per device serves every launch, CUDA-graph
    replays included (launches on one stream run one after another). It is created on first use, which is outside any
    capture: `capture_graph` runs a warm-up first."""
    if device not in _arrival_counts:
        _arrival_counts[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _arrival_counts[device]


def _split_buffers(device: torch.device, splits: int, tiles: int, tile_elements: int):
    """`(partials, arrival counts)` of a split launch: a float32 workspace for every program's partial sums, and one
    arrival count per output tile (`_zeroed_counts`; the last program of each tile resets its count)."""
    counts = _zeroed_counts(device)
    if splits == 1:  # the kernel reads neither: any float32 pointer will do, nothing is allocated
        return counts.view(torch.float32), counts
    if tiles > _MAX_TILES:  # a split launch has fewer programs than SMs, so far fewer tiles than this
        raise ValueError(f"a split launch of {tiles} output tiles; the arrival counts hold {_MAX_TILES}")
    return torch.empty(splits * tiles * tile_elements, dtype=torch.float32, device=device), counts


@triton.jit
def _output_tile():
    """`(tiles, tile)`: the launch's output tiles (row blocks x column blocks) and this program's."""
    return tl.num_programs(0) * tl.num_programs(1), tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)


@triton.jit
def _store_partial(acc, partials_ptr, tile, index, TILES, NUM_ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """This program's (its split's) partial sums of accumulator `index` of `tile`, where `_sum_partials` reads."""
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    slot = (tl.program_id(2) * TILES + tile) * NUM_ACC + index
    tl.store(partials_ptr + slot * (BLOCK_M * BLOCK_N) + offsets, acc)


@triton.jit
def _arrive_last(counts_ptr, tile, SPLITS: tl.constexpr):
    """Whether this program is the last of its tile's `SPLITS` to have stored its partial sums."""
    tl.debug_barrier()  # every thread's partial is written before the count says so
    arrived = tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return arrived == SPLITS - 1


@triton.jit
def _sum_partials(partials_ptr, tile, index, TILES, NUM_ACC: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulator `index` of `tile` summed over its splits in split order (the same order every launch)."""
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for split in tl.static_range(SPLITS):
        slot = (split * TILES + tile) * NUM_ACC + index
        total += tl.load(partials_ptr + slot * (BLOCK_M * BLOCK_N) + offsets, cache_modifier=".cg")
    return total


@triton.jit
def _tile_squares(x_ptr, rows, row_ok, stride_xm, k0, K, BLOCK_K: tl.constexpr, CACHE: tl.constexpr):
    """Sum of squares over the row tile `[k0, k0 + BLOCK_K)` of each row of `x` (float32). `CACHE` is the loads'
    cache modifier: ".cg" (L2 only) where other programs of the same launch wrote `x`."""
    ks = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0,
                cache_modifier=CACHE)
    x = x.to(tl.float32)
    return tl.sum(x * x, 1)


@triton.jit
def _row_rstd(x_ptr, rows, row_ok, stride_xm, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              NORM_BLOCKS: tl.constexpr, CACHE: tl.constexpr):
    """1 / RMS of each row of `x` (float32), as `LlamaRMSNorm` computes it. Where `NORM_BLOCKS` is not 0 the pass
    over the row's `NORM_BLOCKS` tiles is unrolled, so their loads are issued together: one memory round trip before
    the K loop instead of one per tile (`_norm_blocks` says for which rows)."""
    squares = tl.zeros([BLOCK_M], tl.float32)
    if NORM_BLOCKS > 0:
        for block in tl.static_range(NORM_BLOCKS):
            squares += _tile_squares(x_ptr, rows, row_ok, stride_xm, block * BLOCK_K, K, BLOCK_K, CACHE)
    else:
        for k0 in range(0, K, BLOCK_K):
            squares += _tile_squares(x_ptr, rows, row_ok, stride_xm, k0, K, BLOCK_K, CACHE)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _normed_tile(x_ptr, norm_ptr, rows, row_ok, rstd, k0, stride_xm, K, BLOCK_K: tl.constexpr, CACHE: tl.constexpr):
    """`[BLOCK_M, BLOCK_K]` of the normalized rows in the model dtype, rounded where `LlamaRMSNorm` rounds."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0,
                cache_modifier=CACHE)
    dtype = x.dtype
    weight = tl.load(norm_ptr + ks, mask=k_ok, other=0.0)
    normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
    return (normed.to(tl.float32) * weight.to(tl.float32)[None, :]).to(dtype), ks, k_ok


@triton.jit
def _k_range(K, BLOCKS_PER_SPLIT, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr):
    """This program's `[begin, end)` of the reduction dimension (all of it unless the launch is split). `begin` is
    a product with `BLOCK_K`, so the compiler knows every K tile's alignment and vectorizes its loads."""
    if SPLITS == 1:
        return 0, K
    begin = tl.program_id(2) * BLOCKS_PER_SPLIT * BLOCK_K
    return begin, tl.minimum(begin + BLOCKS_PER_SPLIT * BLOCK_K, K)


@triton.jit
def _qkv_epilogue_inputs(rows, row_ok, dims, head, bias, head_norm, cos_ptr, sin_ptr, pool_rows_ptr, stride_cm,
                         HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HEAD_NORM: tl.constexpr, WRITE_KV: tl.constexpr):
    """What `_qkv_epilogue` reads besides the products: loaded before the K loop, so these loads overlap it instead
    of adding a round trip after it. Value heads rotate nothing: their cos/sin loads are masked off; query heads
    write no pool row."""
    if HAS_BIAS:
        bias_low, bias_high = tl.load(bias + dims), tl.load(bias + HALF + dims)
    else:
        bias_low, bias_high = tl.zeros([HALF], tl.float32), tl.zeros([HALF], tl.float32)
    if HEAD_NORM:
        norm_low, norm_high = tl.load(head_norm + dims), tl.load(head_norm + HALF + dims)
    else:
        norm_low, norm_high = tl.zeros([HALF], tl.float32), tl.zeros([HALF], tl.float32)
    angles = rows[:, None] * stride_cm + dims[None, :]
    rotates = tl.zeros_like(rows) + head < HQ + HKV  # a vector: the interpreter masks with no scalar boolean
    mask = (row_ok & rotates)[:, None]
    cos_low = tl.load(cos_ptr + angles, mask=mask, other=0.0)
    cos_high = tl.load(cos_ptr + angles + HALF, mask=mask, other=0.0)
    sin_low = tl.load(sin_ptr + angles, mask=mask, other=0.0)
    sin_high = tl.load(sin_ptr + angles + HALF, mask=mask, other=0.0)
    if WRITE_KV:
        writes = row_ok & (tl.zeros_like(rows) + head >= HQ)
        pool_rows = tl.load(pool_rows_ptr + rows, mask=writes, other=0).to(tl.int64)
    else:
        pool_rows = tl.zeros_like(rows).to(tl.int64)
    return bias_low, bias_high, norm_low, norm_high, cos_low, cos_high, sin_low, sin_high, pool_rows


@triton.jit
def _qkv_epilogue(low, high, inputs, rows, row_ok, dims, head, out_ptr, key_pool_ptr, value_pool_ptr, stride_om,
                  stride_oh, stride_pool_row, stride_pool_h, head_eps, HQ: tl.constexpr, HKV: tl.constexpr,
                  HALF: tl.constexpr, HAS_BIAS: tl.constexpr, HEAD_NORM: tl.constexpr, WRITE_KV: tl.constexpr):
    bias_low, bias_high, norm_low, norm_high, cos_low, cos_high, sin_low, sin_high, pool_rows = inputs
    if HAS_BIAS:
        low += bias_low.to(tl.float32)[None, :]
        high += bias_high.to(tl.float32)[None, :]
    if head < HQ + HKV:  # queries and keys: per-head norm (Qwen3), then the rotary embedding
        if HEAD_NORM:
            head_rstd = 1.0 / tl.sqrt((tl.sum(low * low, 1) + tl.sum(high * high, 1)) / (2 * HALF) + head_eps)
            low = low * head_rstd[:, None] * norm_low.to(tl.float32)[None, :]
            high = high * head_rstd[:, None] * norm_high.to(tl.float32)[None, :]
        c_low, c_high = cos_low.to(tl.float32), cos_high.to(tl.float32)
        s_low, s_high = sin_low.to(tl.float32), sin_high.to(tl.float32)
        low, high = low * c_low - high * s_low, high * c_high + low * s_high
    out = out_ptr + rows[:, None] * stride_om + head * stride_oh + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    rounded_low, rounded_high = low.to(dtype), high.to(dtype)
    tl.store(out, rounded_low, mask=row_ok[:, None])
    tl.store(out + HALF, rounded_high, mask=row_ok[:, None])
    if WRITE_KV:  # keys and values also to the cache's pools, in the model dtype, as the cache gets them
        if head >= HQ + HKV:
            _store_pool_head(value_pool_ptr, pool_rows, head - HQ - HKV, dims, rounded_low, rounded_high, row_ok,
                             stride_pool_row, stride_pool_h, HALF)
        elif head >= HQ:
            _store_pool_head(key_pool_ptr, pool_rows, head - HQ, dims, rounded_low, rounded_high, row_ok,
                             stride_pool_row, stride_pool_h, HALF)


@triton.jit
def _store_pool_head(pool_ptr, pool_rows, kv_head, dims, low, high, row_ok, stride_pool_row, stride_pool_h,
                     HALF: tl.constexpr):
    """Head `kv_head`'s two halves of each row to the pool's flat rows `pool_rows`, in the pool's dtype."""
    target = pool_ptr + pool_rows[:, None] * stride_pool_row + kv_head * stride_pool_h + dims[None, :]
    tl.store(target, low.to(pool_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(target + HALF, high.to(pool_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["M", "BLOCKS_PER_SPLIT"])
def _norm_qkv_rope_kernel(
    x_ptr, norm_ptr, qw_ptr, kw_ptr, vw_ptr, qb_ptr, kb_ptr, vb_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, out_ptr,
    key_pool_ptr, value_pool_ptr, pool_rows_ptr, partials_ptr, counts_ptr, M, K, BLOCKS_PER_SPLIT, stride_xm,
    stride_cm, stride_om, stride_oh, stride_pool_row, stride_pool_h, eps, q_head_eps, k_head_eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM_BLOCKS: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, HEAD_NORM: tl.constexpr,
    WRITE_KV: tl.constexpr, PRECISION: tl.constexpr,
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
    head_eps = tl.where(head < HQ, q_head_eps, k_head_eps)  # the model's q_norm and k_norm each have their own
    rstd = _row_rstd(x_ptr, rows, row_ok, stride_xm, K, eps, BLOCK_M, BLOCK_K, NORM_BLOCKS, "")
    inputs = _qkv_epilogue_inputs(rows, row_ok, dims, head, bias, head_norm, cos_ptr, sin_ptr, pool_rows_ptr,
                                  stride_cm, HQ, HKV, HALF, HAS_BIAS, HEAD_NORM, WRITE_KV)
    low = tl.zeros([BLOCK_M, HALF], tl.float32)  # the head's first half of dimensions
    high = tl.zeros([BLOCK_M, HALF], tl.float32)  # its second half: `rotate_half` pairs dimension i with i + HALF
    begin, end = _k_range(K, BLOCKS_PER_SPLIT, BLOCK_K, SPLITS)
    for k0 in range(begin, end, BLOCK_K):
        normed, ks, k_ok = _normed_tile(x_ptr, norm_ptr, rows, row_ok, rstd, k0, stride_xm, K, BLOCK_K, "")
        w_low = tl.load(weight + dims[:, None] * K + ks[None, :], mask=k_ok[None, :], other=0.0)
        w_high = tl.load(weight + (dims + HALF)[:, None] * K + ks[None, :], mask=k_ok[None, :], other=0.0)
        low += tl.dot(normed, tl.trans(w_low), input_precision=PRECISION)
        high += tl.dot(normed, tl.trans(w_high), input_precision=PRECISION)
    epilogue_args = (inputs, rows, row_ok, dims, head, out_ptr, key_pool_ptr, value_pool_ptr, stride_om, stride_oh,
                     stride_pool_row, stride_pool_h, head_eps, HQ, HKV, HALF, HAS_BIAS, HEAD_NORM, WRITE_KV)
    if SPLITS == 1:
        _qkv_epilogue(low, high, *epilogue_args)
    else:
        tiles, tile = _output_tile()
        _store_partial(low, partials_ptr, tile, 0, tiles, 2, BLOCK_M, HALF)
        _store_partial(high, partials_ptr, tile, 1, tiles, 2, BLOCK_M, HALF)
        if _arrive_last(counts_ptr, tile, SPLITS):
            low = _sum_partials(partials_ptr, tile, 0, tiles, 2, SPLITS, BLOCK_M, HALF)
            high = _sum_partials(partials_ptr, tile, 1, tiles, 2, SPLITS, BLOCK_M, HALF)
            tl.store(counts_ptr + tile, 0)  # ready for the next launch
            _qkv_epilogue(low, high, *epilogue_args)


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
    """Triton version of `layer_reference.norm_qkv_rope` (same arguments and result): the K/V write, where asked
    for, is in the epilogue of the heads it writes, so the cache's own write launch is saved."""
    rows, hidden = x.shape
    num_heads, num_kv_heads = q_weight.shape[0] // head_dim, k_weight.shape[0] // head_dim
    out = torch.empty(rows, num_heads + 2 * num_kv_heads, head_dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    has_bias = q_bias is not None
    head_norm = q_norm_weight is not None
    placeholder = norm_weight  # any pointer of the weights' dtype where an optional tensor is absent
    write_kv = key_pool is not None
    if write_kv and not (key_pool.is_contiguous() and value_pool.is_contiguous()):
        raise ValueError("norm_qkv_rope writes K/V to contiguous pools only (a flat row is page * page_size + offset)")
    block_m = _block_m(rows)
    block_k, stages, warps = _launch(rows, x.dtype)
    grid = (triton.cdiv(rows, block_m), num_heads + 2 * num_kv_heads)
    splits, blocks_per_split = _splits(x.device, grid[0] * grid[1], triton.cdiv(hidden, block_k))
    partials, counts = _split_buffers(x.device, splits, grid[0] * grid[1], 2 * block_m * (head_dim // 2))
    _norm_qkv_rope_kernel[(*grid, splits)](
        x, norm_weight, q_weight.contiguous(), k_weight.contiguous(), v_weight.contiguous(),
        q_bias if has_bias else placeholder, k_bias if has_bias else placeholder, v_bias if has_bias else placeholder,
        cos, sin, q_norm_weight if head_norm else placeholder, k_norm_weight if head_norm else placeholder, out,
        key_pool if write_kv else out, value_pool if write_kv else out, pool_rows if write_kv else counts,
        partials, counts, rows, hidden, blocks_per_split, x.stride(0), cos.stride(0),
        out.stride(0), out.stride(1), key_pool.stride(1) if write_kv else 0, key_pool.stride(2) if write_kv else 0,
        eps, q_norm_eps, k_norm_eps,
        HQ=num_heads, HKV=num_kv_heads, HALF=head_dim // 2, BLOCK_M=block_m, BLOCK_K=block_k,
        NORM_BLOCKS=_norm_blocks(hidden, block_k), SPLITS=splits, HAS_BIAS=has_bias, HEAD_NORM=head_norm,
        WRITE_KV=write_kv, PRECISION=_dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )
    return out


@triton.jit
def _gate_up_products(x_ptr, norm_ptr, gate_ptr, up_ptr, rows, cols, row_ok, col_ok, rstd, begin, end, stride_xm, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                      CACHE: tl.constexpr):
    """`(gate, up)`: float32 products of the normalized rows' `[begin, end)` with the gate and up columns `cols`."""
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(begin, end, BLOCK_K):
        normed, ks, k_ok = _normed_tile(x_ptr, norm_ptr, rows, row_ok, rstd, k0, stride_xm, K, BLOCK_K, CACHE)
        mask = col_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(gate_ptr + cols[:, None] * K + ks[None, :], mask=mask, other=0.0)
        w_up = tl.load(up_ptr + cols[:, None] * K + ks[None, :], mask=mask, other=0.0)
        gate += tl.dot(normed, tl.trans(w_gate), input_precision=PRECISION)
        up += tl.dot(normed, tl.trans(w_up), input_precision=PRECISION)
    return gate, up


@triton.jit
def _store_silu_mul(gate, up, out_ptr, rows, cols, row_ok, col_ok, stride_om):
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M", "BLOCKS_PER_SPLIT"])
def _norm_gate_up_silu_kernel(
    x_ptr, norm_ptr, gate_ptr, up_ptr, out_ptr, partials_ptr, counts_ptr, M, K, N, BLOCKS_PER_SPLIT, stride_xm,
    stride_om, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCKS: tl.constexpr,
    SPLITS: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    rstd = _row_rstd(x_ptr, rows, row_ok, stride_xm, K, eps, BLOCK_M, BLOCK_K, NORM_BLOCKS, "")
    begin, end = _k_range(K, BLOCKS_PER_SPLIT, BLOCK_K, SPLITS)
    gate, up = _gate_up_products(x_ptr, norm_ptr, gate_ptr, up_ptr, rows, cols, row_ok, col_ok, rstd, begin, end,
                                 stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, "")
    if SPLITS == 1:
        _store_silu_mul(gate, up, out_ptr, rows, cols, row_ok, col_ok, stride_om)
    else:
        tiles, tile = _output_tile()
        _store_partial(gate, partials_ptr, tile, 0, tiles, 2, BLOCK_M, BLOCK_N)
        _store_partial(up, partials_ptr, tile, 1, tiles, 2, BLOCK_M, BLOCK_N)
        if _arrive_last(counts_ptr, tile, SPLITS):
            gate = _sum_partials(partials_ptr, tile, 0, tiles, 2, SPLITS, BLOCK_M, BLOCK_N)
            up = _sum_partials(partials_ptr, tile, 1, tiles, 2, SPLITS, BLOCK_M, BLOCK_N)
            tl.store(counts_ptr + tile, 0)
            _store_silu_mul(gate, up, out_ptr, rows, cols, row_ok, col_ok, stride_om)


class _Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    splits: int
    blocks_per_split: int
    grid: tuple[int, int, int]
    stages: int
    warps: int


def _tiles(device: torch.device, rows: int, columns: int, inner: int, dtype: torch.dtype) -> _Tiles:
    """The launch of a GEMM over `[rows, columns]` outputs and an `inner`-long reduction: 64 columns per program,
    or 32 where 64 would leave most of the GPU's SMs without a program; then the K range split (`_splits`) until
    the programs fill the SMs."""
    block_m = _block_m(rows)
    block_k, stages, warps = _launch(rows, dtype)
    row_blocks = triton.cdiv(rows, block_m)
    block_n = 64 if row_blocks * triton.cdiv(columns, 64) >= _sm_count(device) else 32
    grid = (row_blocks, triton.cdiv(columns, block_n))
    splits, blocks_per_split = _splits(device, grid[0] * grid[1], triton.cdiv(inner, block_k))
    return _Tiles(block_m, block_n, block_k, splits, blocks_per_split, (*grid, splits), stages, warps)


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
    t = _tiles(x.device, rows, columns, hidden, x.dtype)
    partials, counts = _split_buffers(x.device, t.splits, t.grid[0] * t.grid[1], 2 * t.block_m * t.block_n)
    _norm_gate_up_silu_kernel[t.grid](
        x, norm_weight, gate_weight.contiguous(), up_weight.contiguous(), out, partials, counts, rows, hidden,
        columns, t.blocks_per_split, x.stride(0), out.stride(0), eps,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, NORM_BLOCKS=_norm_blocks(hidden, t.block_k),
        SPLITS=t.splits, PRECISION=_dot_precision(x.dtype), num_warps=t.warps, num_stages=t.stages,
    )
    return out


@triton.jit
def _residual_epilogue(acc, residual, bias, out_ptr, rows, cols, row_ok, col_ok, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += bias.to(tl.float32)[None, :]
    acc += residual.to(tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_products(x_ptr, w_ptr, rows, cols, row_ok, col_ok, begin, end, stride_xm, K, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, CACHE: tl.constexpr):
    """Float32 products of rows `x[:, begin:end]` with the weight's columns `cols`."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(begin, end, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0, cache_modifier=CACHE)
        w = tl.load(w_ptr + cols[:, None] * K + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    return acc


@triton.jit
def _residual_epilogue_inputs(res_ptr, b_ptr, rows, cols, row_ok, col_ok, stride_rm, BLOCK_N: tl.constexpr,
                              HAS_BIAS: tl.constexpr, CACHE: tl.constexpr):
    """The epilogue's residual and bias, loaded before the K loop so that their round trip overlaps it."""
    residual = tl.load(res_ptr + rows[:, None] * stride_rm + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                       other=0.0, cache_modifier=CACHE)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=col_ok, other=0.0)
    else:
        bias = tl.zeros([BLOCK_N], tl.float32)
    return residual, bias


@triton.jit(do_not_specialize=["M", "BLOCKS_PER_SPLIT"])
def _linear_residual_kernel(
    x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, partials_ptr, counts_ptr, M, K, N, BLOCKS_PER_SPLIT, stride_xm, stride_rm,
    stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    residual, bias = _residual_epilogue_inputs(res_ptr, b_ptr, rows, cols, row_ok, col_ok, stride_rm, BLOCK_N,
                                               HAS_BIAS, "")
    begin, end = _k_range(K, BLOCKS_PER_SPLIT, BLOCK_K, SPLITS)
    acc = _linear_products(x_ptr, w_ptr, rows, cols, row_ok, col_ok, begin, end, stride_xm, K, BLOCK_M, BLOCK_N,
                           BLOCK_K, PRECISION, "")
    epilogue_args = (residual, bias, out_ptr, rows, cols, row_ok, col_ok, stride_om, HAS_BIAS)
    if SPLITS == 1:
        _residual_epilogue(acc, *epilogue_args)
    else:
        tiles, tile = _output_tile()
        _store_partial(acc, partials_ptr, tile, 0, tiles, 1, BLOCK_M, BLOCK_N)
        if _arrive_last(counts_ptr, tile, SPLITS):
            acc = _sum_partials(partials_ptr, tile, 0, tiles, 1, SPLITS, BLOCK_M, BLOCK_N)
            tl.store(counts_ptr + tile, 0)
            _residual_epilogue(acc, *epilogue_args)


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
    t = _tiles(x.device, rows, columns, inner, x.dtype)
    partials, counts = _split_buffers(x.device, t.splits, t.grid[0] * t.grid[1], t.block_m * t.block_n)
    _linear_residual_kernel[t.grid](
        x, weight.contiguous(), bias if bias is not None else weight, residual, out, partials, counts, rows, inner,
        columns, t.blocks_per_split, x.stride(0), residual.stride(0), out.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLITS=t.splits, HAS_BIAS=bias is not None,
        PRECISION=_dot_precision(x.dtype), num_warps=t.warps, num_stages=t.stages,
    )
    return out


# --------------------------------------------------------------------------------------------- one MLP launch
# `mlp_block` runs the O projection + residual, norm + gate/up + SiLU·mul and down projection + residual (three
# launches above) as one persistent launch. Its programs claim output tiles in one order from an atomic counter, the
# O projection's first, then gate/up's, then down's, and a tile waits only for the tiles it reads: a gate/up tile for
# every O tile of its row block (its norm reads whole rows), a down tile for every gate/up tile of its row block. A
# program waits only on tiles claimed before its own, by programs already running, so the launch cannot deadlock, and
# no grid-wide barrier is needed. Under `TRITON_INTERPRET=1`, which runs programs one after another, the first program
# claims and runs every tile in order and the others find none left. `PERSISTENT_MLP` chooses it (off: the three
# launches; it is not yet timed against them, docs/benchmarks.md).
PERSISTENT_MLP = False
MLP_BLOCK_N = 32  # columns per tile: at decode row counts even 32 leaves few tiles per phase
_MLP_SYNC_WORDS = 256  # most counts a launch uses: the claim counter, the exit counter and two per row block


@triton.jit
def _await_count(count_ptr, target):
    """Spin until the count at `count_ptr` reaches `target`; what the counted tiles wrote is then visible."""
    while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _signal_tile(count_ptr):
    """Count a finished tile, after every thread of the program has stored its part."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _tile_coordinates(index, tiles_per_block, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """`(row block, rows, columns, row mask, column mask)` of a phase's output tile `index`, column tiles of a row
    block numbered together."""
    block, column = index // tiles_per_block, index % tiles_per_block
    rows, cols = block * BLOCK_M + tl.arange(0, BLOCK_M), column * BLOCK_N + tl.arange(0, BLOCK_N)
    return block, rows, cols, rows < M, cols < N


@triton.jit(do_not_specialize=["M"])
def _mlp_block_kernel(
    attn_ptr, o_ptr, o_bias_ptr, x_ptr, norm_ptr, gate_ptr, up_ptr, down_ptr, mixed_ptr, act_ptr, out_ptr, sync_ptr,
    M, ATTN, HIDDEN, INTER, stride_am, stride_xm, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    SYNC_WORDS: tl.constexpr,
):
    # sync_ptr: [0] tiles claimed, [1] programs done, [2 + r] O tiles done of row block r, [2 + R + r] gate/up tiles.
    row_blocks = tl.cdiv(M, BLOCK_M)
    hidden_tiles = tl.cdiv(HIDDEN, BLOCK_N)
    inter_tiles = tl.cdiv(INTER, BLOCK_N)
    o_end = row_blocks * hidden_tiles
    gate_up_end = o_end + row_blocks * inter_tiles
    tiles = gate_up_end + row_blocks * hidden_tiles
    o_done, gate_up_done = sync_ptr + 2, sync_ptr + 2 + row_blocks
    tile = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    while tile < tiles:
        if tile < o_end:  # mixed = x + attended @ o.T (+ bias)
            block, rows, cols, row_ok, col_ok = _tile_coordinates(tile, hidden_tiles, M, HIDDEN, BLOCK_M, BLOCK_N)
            residual, bias = _residual_epilogue_inputs(x_ptr, o_bias_ptr, rows, cols, row_ok, col_ok, stride_xm,
                                                       BLOCK_N, HAS_BIAS, "")
            acc = _linear_products(attn_ptr, o_ptr, rows, cols, row_ok, col_ok, 0, ATTN, stride_am, ATTN, BLOCK_M,
                                   BLOCK_N, BLOCK_K, PRECISION, "")
            _residual_epilogue(acc, residual, bias, mixed_ptr, rows, cols, row_ok, col_ok, HIDDEN, HAS_BIAS)
            _signal_tile(o_done + block)
        elif tile < gate_up_end:  # activated = SiLU(gate(norm(mixed))) * up(norm(mixed))
            block, rows, cols, row_ok, col_ok = _tile_coordinates(tile - o_end, inter_tiles, M, INTER, BLOCK_M,
                                                                  BLOCK_N)
            _await_count(o_done + block, hidden_tiles)
            # ".cg": other programs wrote `mixed` in this launch, so its lines are read from L2, never from L1.
            rstd = _row_rstd(mixed_ptr, rows, row_ok, HIDDEN, HIDDEN, eps, BLOCK_M, BLOCK_K, NORM_BLOCKS, ".cg")
            gate, up = _gate_up_products(mixed_ptr, norm_ptr, gate_ptr, up_ptr, rows, cols, row_ok, col_ok, rstd, 0,
                                         HIDDEN, HIDDEN, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, ".cg")
            _store_silu_mul(gate, up, act_ptr, rows, cols, row_ok, col_ok, INTER)
            _signal_tile(gate_up_done + block)
        else:  # out = mixed + activated @ down.T
            block, rows, cols, row_ok, col_ok = _tile_coordinates(tile - gate_up_end, hidden_tiles, M, HIDDEN,
                                                                  BLOCK_M, BLOCK_N)
            _await_count(gate_up_done + block, inter_tiles)
            residual, bias = _residual_epilogue_inputs(mixed_ptr, o_bias_ptr, rows, cols, row_ok, col_ok, HIDDEN,
                                                       BLOCK_N, False, ".cg")
            acc = _linear_products(act_ptr, down_ptr, rows, cols, row_ok, col_ok, 0, INTER, INTER, INTER, BLOCK_M,
                                   BLOCK_N, BLOCK_K, PRECISION, ".cg")
            _residual_epilogue(acc, residual, bias, out_ptr, rows, cols, row_ok, col_ok, HIDDEN, False)
        tile = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    # Every program claims once past the end and then leaves; the last to leave (no claim or count is touched after
    # it) zeroes the counters for the next launch, so one buffer serves every launch, CUDA-graph replays included.
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        words = tl.arange(0, SYNC_WORDS)
        tl.store(sync_ptr + words, tl.zeros([SYNC_WORDS], tl.int32), mask=words < 2 + 2 * row_blocks)


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
    """Triton version of `layer_reference.mlp_block` (same arguments and result): the three launches of
    `linear_residual`, `norm_gate_up_silu` and `linear_residual`, or one persistent launch where `PERSISTENT_MLP`
    says so."""
    if not PERSISTENT_MLP:
        mixed = linear_residual(attended, o_weight, o_bias, residual)
        activated = norm_gate_up_silu(mixed, norm_weight, eps, gate_weight, up_weight)
        return linear_residual(activated, down_weight, None, mixed)
    rows, hidden = residual.shape
    inter = gate_weight.shape[0]
    mixed = torch.empty_like(residual, memory_format=torch.contiguous_format)
    out = torch.empty_like(mixed)
    if rows == 0:
        return out
    activated = torch.empty(rows, inter, dtype=residual.dtype, device=residual.device)
    attended, residual = attended.contiguous(), residual.contiguous()
    block_m = _block_m(rows)
    block_k, stages, warps = _launch(rows, residual.dtype)
    row_blocks = triton.cdiv(rows, block_m)
    if 2 + 2 * row_blocks > _MLP_SYNC_WORDS:
        raise ValueError(f"mlp_block over {row_blocks} row blocks; its counters hold {(_MLP_SYNC_WORDS - 2) // 2}")
    sync = _zeroed_counts(residual.device)  # the split launches' counts: every launch leaves them at zero
    tiles = row_blocks * (2 * triton.cdiv(hidden, MLP_BLOCK_N) + triton.cdiv(inter, MLP_BLOCK_N))
    _mlp_block_kernel[(min(tiles, _sm_count(residual.device)),)](
        attended, o_weight.contiguous(), o_bias if o_bias is not None else o_weight, residual, norm_weight,
        gate_weight.contiguous(), up_weight.contiguous(), down_weight.contiguous(), mixed, activated, out, sync, rows,
        attended.shape[1], hidden, inter, attended.stride(0), residual.stride(0), eps,
        BLOCK_M=block_m, BLOCK_N=MLP_BLOCK_N, BLOCK_K=block_k, NORM_BLOCKS=_norm_blocks(hidden, block_k),
        HAS_BIAS=o_bias is not None, PRECISION=_dot_precision(residual.dtype), SYNC_WORDS=_MLP_SYNC_WORDS,
        num_warps=warps, num_stages=stages,
    )
    return out


@triton.jit(do_not_specialize=["M"])
def _lm_head_kernel(x_ptr, w_ptr, out_ptr, M, K, N, stride_xm, stride_om, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    # Row blocks vary fastest, so the programs that read one tile of the vocabulary's weights run together and all
    # but the first find it in L2: the weights are read from memory about once.
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
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _lm_head_block_m(rows: int) -> int:
    """Rows per program: 16 for a draft pass or a dense step (up to 32 rows, two row blocks reading each weight tile
    from L2 the second time), 128 for a verify block. Two heights, so that a GRPO step reaching a row count the steps
    before it did not reach builds no new kernel variant."""
    return 16 if rows <= 32 else 128


# `(BLOCK_N, K-tile bytes, warps, stages)` of the LM head; None: 128 columns, 128-byte K tiles (16 KiB of weights a
# stage), four warps for 16-row blocks and eight for 128-row ones, three stages. `tools/layer_kernels.py --lm-head
# --sweep` times others.
LM_HEAD_OVERRIDE: tuple[int, int, int, int] | None = None


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Triton version of `layer_reference.lm_head` (same arguments and result). One launch over (row blocks x vocabulary
    column blocks); no split of the hidden dimension, which a vocabulary's hundreds of column blocks do not need."""
    rows, hidden = x.shape
    vocab = weight.shape[0]
    out = torch.empty(rows, vocab, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    x = x.contiguous()
    block_m = _lm_head_block_m(rows)
    block_n, k_bytes, warps, stages = LM_HEAD_OVERRIDE or (128, 128, 4 if block_m == 16 else 8, 3)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(vocab, block_n))
    _lm_head_kernel[grid](
        x, weight.contiguous(), out, rows, hidden, vocab, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=k_bytes // x.element_size(), PRECISION=_dot_precision(x.dtype),
        num_warps=warps, num_stages=stages,
    )
    return out


KERNELS = (_norm_qkv_rope_kernel, _norm_gate_up_silu_kernel, _linear_residual_kernel, _mlp_block_kernel,
           _lm_head_kernel)


def layer_variant_keys() -> set[tuple[str, str]]:
    """`(kernel name, specialization key)` of every variant of the layer kernels built in this process."""
    return variant_keys(KERNELS)
