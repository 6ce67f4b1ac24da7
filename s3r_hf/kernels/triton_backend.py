"""Triton kernels with the signatures of `s3r_hf.kernels.reference`.

- `paged_sparse_attention`: one program per (draft query, KV head); reads K/V through the index view and the
  block table directly (no gather copy), online softmax over view + provisional tail.
- `paged_dense_attention`: one program per (segment, KV head, query block, key split) of the packed varlen
  batch; the query block's rows are (query, GQA head) pairs so each K/V row read serves the whole group. Verify
  scores are `exp(logit - lse)` averaged per key position, from one of two sources (`stores_logits` picks the
  one that moves fewer bytes): the scored rows' logits, stored by the attention kernel as it streams K and
  reduced afterwards; or a second kernel that reads only K and recomputes them with the attention's saved
  normalisers (the paper's Appendix B.1).
- `merge_splits`: the partial results of a split key range combined in one launch.
- `write_kv`: a step's K and V into the pools in one launch.
- `select_topk_candidates`: `torch.topk` on the GPU (the per-layer selection of `transformers`' assisted loop).
- `select_index_views`: every layer's index views from a dense forward's scores in one launch
  (`view_select_triton`).

Run on CPU tensors under `TRITON_INTERPRET=1` (CI) and on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from s3r_hf.kernels.reference import verify_scores_tensor
from s3r_hf.kernels.view_select_triton import KERNELS as _VIEW_KERNELS
from s3r_hf.kernels.view_select_triton import select_index_views  # noqa: F401  (the backend interface)
from s3r_hf.matmul_precision import tf32_matmuls


def _dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` of the kernels' dot products. bf16/fp16 run on tensor cores anyway. float32 follows torch's
    switch for float32 matmuls, as cuBLAS does: one TF32 product per product where TF32 is allowed (the draft passes
    under `S3RConfig.draft_matmul_precision="high"`, which sets the switch around them, or a user's global setting),
    otherwise three ("tf32x3"), within float32 rounding of the reference (max differences 1e-7 to 1e-6 on the
    outputs, as IEEE products, which run on the CUDA cores 1.7-2.6x slower at the GRPO shapes: docs/benchmarks.md,
    "Kernel launch settings"). Read at launch: a captured graph keeps the kernels chosen at its capture."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32" if tf32_matmuls() else "tf32x3"


# Triton compiles a kernel once per specialization of its integer arguments (equal to 1, divisible by 16), so an
# argument that takes new values from call to call (a block table's width, a loop bound, the stride of a buffer
# sized by the batch) compiles a new variant, for seconds, whenever its specialization changes: mid-rollout, and in
# every CUDA-graph capture of a new batch bucket. Such arguments are left unspecialized (`do_not_specialize`), and
# buffers whose strides address vector loads are padded so those strides are always multiples of 16 (`_PAD`).
_PAD = 16


def _padded(n: int) -> int:
    return -(-max(n, 1) // _PAD) * _PAD


@triton.jit(do_not_specialize=["stride_btn", "stride_vn", "stride_vh", "stride_ls"])
def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, view_ptr, view_len_ptr, tail_ptr, pos_ptr, out_ptr, lse_ptr,
    stride_qn, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_btn,
    stride_vn, stride_vh,
    stride_os, stride_on, stride_oh,
    stride_ls, stride_ln,
    scale,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    query = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + query * stride_qn + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    view_len = tl.load(view_len_ptr + query)
    tail = tl.load(tail_ptr + query)
    position = tl.load(pos_ptr + query)
    total = view_len + (position - tail + 1)
    # The query's own keys are shared out among the splits, not the longest view the grid was sized for.
    keys_per_split = tl.cdiv(total, tl.num_programs(2))
    lo = split * keys_per_split
    hi = tl.minimum(total, lo + keys_per_split)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        valid = idx < hi
        in_view = idx < view_len
        view_pos = tl.load(view_ptr + query * stride_vn + kv_head * stride_vh + idx, mask=valid & in_view, other=0)
        key_pos = tl.where(in_view, view_pos, tail + idx - view_len)
        key_pos = tl.where(valid, key_pos, 0)
        page = tl.load(bt_ptr + query * stride_btn + key_pos // PAGE_SIZE).to(tl.int64)
        row_base = page * stride_kp + (key_pos % PAGE_SIZE) * stride_ko + kv_head * stride_kh
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + row_base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row_base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # Partial result of this split (an empty split stores lse = -inf and zeros); `merge_splits` combines.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    tl.store(
        out_ptr + split * stride_os + query * stride_on + heads[:, None] * stride_oh + dims[None, :],
        (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )
    tl.store(lse_ptr + split * stride_ls + query * stride_ln + heads, m_i + tl.log(l_i), mask=row_ok)


def paged_sparse_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    index_view: torch.Tensor,
    view_lens: torch.Tensor,
    tail_starts: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    max_keys: int | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.paged_sparse_attention` (same arguments and results).

    `num_splits` fixes how many programs share a row's keys; by default `sparse_splits` chooses it from the shape,
    the same choice for every launch of a CUDA graph when `max_keys` is given.
    """
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    query, key_pool, value_pool = _unit_stride(query), key_pool.contiguous(), value_pool.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    index_view = index_view.to(torch.int32).contiguous()
    if index_view.shape[-1] == 0:  # keep a valid pointer for the (fully masked) view loads
        index_view = torch.zeros(num_queries, num_kv_heads, 1, dtype=torch.int32, device=query.device)
    if num_queries == 0:
        return torch.empty_like(query), torch.empty(0, num_heads, dtype=torch.float32, device=query.device)
    longest = max_keys if max_keys is not None else int(view_lens.max() + (positions - tail_starts).max() + 1)
    splits = num_splits or sparse_splits(num_queries, num_kv_heads, longest, head_dim, query.element_size())
    out = torch.empty(splits, num_queries, num_heads, head_dim, dtype=_out_dtype(query, splits), device=query.device)
    lse = torch.empty(splits, num_queries, num_heads, dtype=torch.float32, device=query.device)
    _sparse_decode_kernel[(num_queries, num_kv_heads, splits)](
        query, key_pool, value_pool, block_tables, index_view,
        view_lens.to(torch.int32).contiguous(), tail_starts.to(torch.int32).contiguous(),
        positions.to(torch.int32).contiguous(), out, lse,
        query.stride(0), query.stride(1),
        key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
        block_tables.stride(0),
        index_view.stride(0), index_view.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        scale,
        **sparse_constants(group, head_dim, key_pool.shape[1], query.dtype),
    )
    return merge_splits(out, lse, query.dtype)


SPARSE_LAUNCH_OVERRIDE: dict | None = None
"""Replaces the sparse kernel's launch settings (`BLOCK_N`, `num_warps`, `num_stages`) in every launch
(`tools/sparse_launch_ab.py` times the engine with another setting)."""


def sparse_constants(group: int, head_dim: int, page_size: int, dtype: torch.dtype) -> dict:
    """The sparse kernel's compile-time constants and launch options: what the launch passes, and what
    `tools/kernel_registers.py` compiles."""
    return dict(
        PAGE_SIZE=page_size, GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=_dot_precision(dtype),
        **(SPARSE_LAUNCH_OVERRIDE or sparse_launch_settings(head_dim, dtype.itemsize)),
    )


def sparse_launch_settings(head_dim: int, element_size: int) -> dict:
    """The attention kernels' settings (`launch_settings`), with two pipeline stages for heads wider than 64: at
    Qwen3-1.7B's 128-wide heads three stages hold about 156 registers a thread, three programs per SM, and a draft
    pass's 512 programs (64 rows x 8 KV heads) ran in 1.3 waves; two stages took the kernel from 64 to 47 us and the
    engine's round 2.5% shorter (docs/benchmarks.md, "Kernel launch settings")."""
    settings = launch_settings(head_dim, element_size=element_size)
    return {**settings, "num_stages": 2} if head_dim > 64 else settings


def sparse_splits(rows: int, num_kv_heads: int, keys: int, head_dim: int, element_size: int) -> int:
    """Key splits of the sparse kernel over `keys` keys per (row, KV head). In bf16/fp16 none: over views of 192-205
    keys one program per (row, KV head) was the fastest at 4-64 rows. In float32 a program's K tile holds half the
    keys and its loop takes longer, and splits of one K tile each paid where the grid is small: 4 splits at 16 and
    32 rows (docs/benchmarks.md, "Kernel launch settings")."""
    if element_size < 4:
        return 1
    return _num_splits(rows * num_kv_heads, keys, min_keys=_key_tile(head_dim, element_size))


def launch_settings(head_dim: int, stores_logits: bool = False, element_size: int = 2) -> dict:
    """Keys per loop iteration, warps and software-pipeline stages of the attention kernels.

    Chosen from CUDA-graph timings on the H200 (`tools/tune_kernels.py`, docs/benchmarks.md): a K tile of 16 KiB
    per iteration (in bf16 128 keys of a 64-wide head, 64 of a 128-wide one; never more than 128 keys) with four
    warps; a verify block that stores its logits, with 128-wide heads, runs faster with two pipeline stages, and so
    does every float32 kernel (with three, or with 32 KiB tiles, the float32 verify spilled: up to 40x slower).
    """
    stages = 2 if (stores_logits and head_dim > 64) or element_size > 2 else 3
    return {"BLOCK_N": _key_tile(head_dim, element_size), "num_warps": 4, "num_stages": stages}


PREFILL_QUERIES = 66
"""Segments at least this long (prefill chunks) are tiled for arithmetic throughput: many queries share each K/V
tile, where a decode step or a verify block has a handful and streams its keys. It is one more than the longest
verify block (`S3RConfig.draft_len` is at most 64), so every prompt chunk longer than that takes the same tiling
and the same compiled kernel variant: with a threshold inside the range of prompt lengths, a later GRPO step whose
prompts were all shorter built a variant of its own (docs/benchmarks.md)."""

PREFILL_TILING = {"ROWS": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
"""(query, GQA head) rows per program and the launch settings of prefill-length segments: of 24 tilings timed on
8 prompts of 8K (Qwen3-1.7B heads) and 4K (SmolLM2's), the fastest for SmolLM2 and within 10% of the fastest for
Qwen3-1.7B (`tools/prefill_attention.py`, docs/benchmarks.md). Chunks of `SDPA_PREFILL_QUERIES` or more go to
torch's SDPA instead (`engine/model_runner.py`)."""


def query_tiling(
    max_len: int, group: int, head_dim: int, stores_logits: bool, element_size: int
) -> tuple[int, int, dict]:
    """`(queries per program, (query, head) rows per program, launch settings)` of the dense kernel for segments of
    at most `max_len` queries: up to 64 rows (a whole decode step or verify block of a KV head in one program),
    `PREFILL_TILING` from `PREFILL_QUERIES` queries on."""
    if max_len >= PREFILL_QUERIES:
        block_m = max(1, PREFILL_TILING["ROWS"] // group)
        settings = {key: PREFILL_TILING[key] for key in ("BLOCK_N", "num_warps", "num_stages")}
    else:
        block_m = max(1, min(triton.next_power_of_2(max_len), 64 // group if group < 64 else 1))
        settings = launch_settings(head_dim, stores_logits=stores_logits, element_size=element_size)
    return block_m, max(16, triton.next_power_of_2(block_m * group)), settings


def _key_tile(head_dim: int, element_size: int = 2) -> int:
    """Keys per K tile: 16 KiB (in bf16 128 keys of a 64-wide head, 64 of a 128-wide one), 16 to 128 keys."""
    return min(128, max(16, 16384 // (element_size * triton.next_power_of_2(head_dim))))


# Enough programs to fill the GPU several times over (132 SMs on an H100/H200).
_TARGET_PROGRAMS = 528
# Each split's program streams at least this many keys. With few programs (a rollout's tail, small batches, float32)
# splitting down to a few hundred keys per split pays: the grid, not the key loop, limits those launches. Where the
# grid already fills the GPU the program target, not this floor, sets the count (docs/benchmarks.md, "Kernel launch
# settings").
_MIN_KEYS_PER_SPLIT = 256


# A dense kernel that also stores the verify logits does more per program and fills the GPU with fewer programs:
# splitting pays below 256 programs and not at or above it (docs/benchmarks.md, "Kernel launch settings").
_TARGET_PROGRAMS_STORING_LOGITS = 256


def _num_splits(programs: int, keys: int, min_keys: int, target: int = _TARGET_PROGRAMS) -> int:
    """Split each row's keys over several programs (flash-decoding) when there are fewer than `target` programs."""
    if programs >= target:
        return 1
    wanted = max(1, min(-(-target // max(programs, 1)), -(-keys // min_keys)))
    # Rounded down to a power of two: at the SmolLM2 grid 3 splits, the plain quotient, timed slower than 2 and 4
    # (docs/benchmarks.md, "Kernel launch settings").
    return 1 << (wanted.bit_length() - 1)


def _target_programs(stores_logits: bool) -> int:
    return _TARGET_PROGRAMS_STORING_LOGITS if stores_logits else _TARGET_PROGRAMS


def dense_constants(
    group: int, head_dim: int, page_size: int, dtype: torch.dtype, block_m: int, rows: int, settings: dict,
    stores_logits: bool, one_q_block: bool, counts_live: bool, splits: int,
) -> dict:
    """The dense kernel's compile-time constants and launch options for a launch tiled as `query_tiling` says
    (`block_m`, `rows`, `settings`) over `splits` key splits: what the launch passes, and what
    `tools/kernel_registers.py` compiles."""
    return dict(
        PAGE_SIZE=page_size, GROUP=group, BLOCK_M=block_m, ROWS=rows, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=_dot_precision(dtype), **settings,
        STORE_LOGITS=stores_logits, ONE_Q_BLOCK=one_q_block, COUNT_LIVE=counts_live,
        TARGET_PROGRAMS=_target_programs(stores_logits), MIN_KEYS=_MIN_KEYS_PER_SPLIT,
        WHOLE_CONTEXT=stores_logits and splits == 1,
    )


def split_grid(
    segments: int, programs: int, keys: int, target: int, live_floor: int | None = None
) -> tuple[int, bool]:
    """`(key splits of the grid, whether the kernel counts the live segments on the device)` of a dense launch of
    `segments` segments of `programs` programs each over up to `keys` keys.

    `live_floor`, for a CUDA graph that may replay with fewer real segments (`live_segments`), is the fewest it
    replays with. The grid then holds the splits those would use, at most four times its own (a graph serves rows
    down to a quarter of its bucket, `cuda_graphs.REUSE_FACTOR`; unused splits cost little, but a full replay pays
    for each), and the kernel uses as many as suit each replay. Where the fewest would use no more splits than the
    full grid, the count is fixed instead: counting live segments costs the kernel registers (one program fewer per
    SM for the verify at Qwen3-1.7B's heads, docs/benchmarks.md), and its extra splits a launch of programs that only
    exit and a merge of their partial results."""
    splits = _num_splits(segments * programs, keys, _MIN_KEYS_PER_SPLIT, target=target)
    if live_floor is None:
        return splits, False
    wanted = min(_num_splits(max(1, live_floor) * programs, keys, _MIN_KEYS_PER_SPLIT, target=target), 4 * splits)
    return (wanted, True) if wanted > splits else (splits, False)


def _score_scratch(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The stored verify logits, left uninitialised: the kernel writes every entry the reduction reads."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _unit_stride(query: torch.Tensor) -> torch.Tensor:
    """The kernels take the query's row and head strides; only the head dimension must be contiguous (so a
    transposed view of the projection output needs no copy)."""
    return query if query.stride(-1) == 1 else query.contiguous()


def _out_dtype(query: torch.Tensor, splits: int) -> torch.dtype:
    """An unsplit kernel stores its float32 result in the query's dtype (the same single rounding as a cast
    afterwards, one kernel fewer); split partial results stay float32 until they are merged."""
    return query.dtype if splits == 1 else torch.float32


@triton.jit
def _live_splits(live_ptr, programs_per_segment, keys, TARGET_PROGRAMS: tl.constexpr, MIN_KEYS: tl.constexpr):
    """`_num_splits` on the device, for the live segments `live_ptr` holds."""
    programs = tl.maximum(tl.load(live_ptr) * programs_per_segment, 1)
    wanted = tl.minimum(tl.cdiv(TARGET_PROGRAMS, programs), tl.cdiv(keys, MIN_KEYS))
    power = 1  # rounded down to a power of two, as on the host
    for _ in tl.static_range(10):
        power = tl.where(power * 2 <= wanted, power * 2, power)
    return power


@triton.jit(do_not_specialize=["stride_bts", "stride_ls", "num_q_blocks"])
def _dense_varlen_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, pos_ptr, out_ptr, lse_ptr, logit_ptr, score_start_ptr, live_ptr,
    stride_qn, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_bts,
    stride_os, stride_on, stride_oh,
    stride_ls, stride_ln,
    stride_gs, stride_gh, stride_gr,
    scale, num_q_blocks,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    STORE_LOGITS: tl.constexpr, ONE_Q_BLOCK: tl.constexpr,
    COUNT_LIVE: tl.constexpr, TARGET_PROGRAMS: tl.constexpr, MIN_KEYS: tl.constexpr, WHOLE_CONTEXT: tl.constexpr,
):
    segment = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Decode steps and verify blocks have one query block per segment. Compiled knowing that, the verify with stored
    # logits runs about a quarter faster than with `num_q_blocks` only known at run time (docs/benchmarks.md, "Kernel
    # launch settings"); a flag rather than a specialized integer keeps it at two variants, whatever prefill chunks do.
    if ONE_Q_BLOCK:
        q_block = 0
        split = tl.program_id(2)
        splits = tl.num_programs(2)
    else:
        q_block = tl.program_id(2) % num_q_blocks
        split = tl.program_id(2) // num_q_blocks
        splits = tl.num_programs(2) // num_q_blocks
    seg_start = tl.load(cu_ptr + segment)
    seg_end = tl.load(cu_ptr + segment + 1)
    first = seg_start + q_block * BLOCK_M
    rows = tl.arange(0, ROWS)
    query = first + rows // GROUP
    row_ok = (rows < BLOCK_M * GROUP) & (query < seg_end)
    heads = kv_head * GROUP + rows % GROUP
    q_pos = tl.load(pos_ptr + query, mask=row_ok, other=-1)
    context = tl.max(q_pos, 0) + 1
    if COUNT_LIVE:
        # A CUDA graph replayed with fewer real segments than it was captured for: the grid holds the splits one
        # segment would use, and each block uses as many of them as `_num_splits` would choose for the segments
        # present (read on the device) and its own keys. The splits past that store an empty result and stop.
        splits = tl.minimum(
            splits, _live_splits(live_ptr, tl.num_programs(1) * num_q_blocks, context, TARGET_PROGRAMS, MIN_KEYS))
        if split >= splits:
            tl.store(lse_ptr + split * stride_ls + query * stride_ln + heads, float("-inf"), mask=row_ok)
    if first < seg_end and split < splits:
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_offsets = query[:, None] * stride_qn + heads[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        # The block's own keys are shared out among the splits in whole tiles, not the longest context the grid was
        # sized for (a CUDA graph's), which would leave the later splits without work at shorter contexts. Each
        # split starts on a tile boundary, so the compiler may vectorize the stored logits and the block-table reads.
        # An unsplit launch that stores logits takes the plain bounds: with the split arithmetic that kernel compiles
        # to more registers, one program fewer per SM at Qwen3-1.7B's heads (docs/benchmarks.md, "Kernel launch
        # settings"). The other kernels compile to the same registers either way and keep one variant.
        if WHOLE_CONTEXT:
            lo = 0
            hi = context
        else:
            keys_per_split = tl.cdiv(tl.cdiv(context, splits), BLOCK_N) * BLOCK_N
            lo = tl.multiple_of(split * keys_per_split, BLOCK_N)
            hi = tl.minimum(context, lo + keys_per_split)
        if STORE_LOGITS:
            score_start = tl.load(score_start_ptr + segment)
            score_start = tl.where(score_start >= 0, score_start, seg_end - seg_start)  # -1: not scored
            scored_row = (query - seg_start - score_start) * GROUP + rows % GROUP
            scored = row_ok & (query - seg_start >= score_start)

        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            key_ok = key_pos < hi
            page = tl.load(bt_ptr + segment * stride_bts + key_pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            row_base = page * stride_kp + (key_pos % PAGE_SIZE) * stride_ko + kv_head * stride_kh
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + row_base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            if STORE_LOGITS:
                logit_offsets = segment * stride_gs + kv_head * stride_gh + scored_row[:, None] * stride_gr
                tl.store(logit_ptr + logit_offsets + key_pos[None, :], s, mask=scored[:, None] & key_ok[None, :])
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows see no key at all
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + row_base[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # Partial result of this split (rows without keys here store lse = -inf); `merge_splits` combines.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o_offsets = split * stride_os + query[:, None] * stride_on + heads[:, None] * stride_oh + dims[None, :]
        tl.store(
            out_ptr + o_offsets, (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
        tl.store(lse_ptr + split * stride_ls + query * stride_ln + heads, m_i + tl.log(l_i), mask=row_ok)


def paged_dense_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    score_starts: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_context: int | None = None,
    max_scored_queries: int | None = None,
    num_splits: int | None = None,
    live_segments: torch.Tensor | None = None,
    min_live_segments: int = 1,
    scores_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton version of `reference.paged_dense_attention` (same arguments and results).

    `num_splits` fixes how many programs share a query block's keys (CUDA-graph steps need a fixed grid); by
    default it is chosen from the shape. With `live_segments` (a CUDA graph's `[1]` int32 count of the segments that
    hold real queries, the rest padding) and no `num_splits`, the grid holds more splits than its own rows would
    use, and the kernel uses as many of them as suit the segments present, so a graph replayed for fewer rows than
    it was captured for spreads each row's keys over more programs; `min_live_segments` is the fewest a replay holds
    (`split_grid`).
    """
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    num_segments = cu_seqlens.shape[0] - 1
    query, key_pool, value_pool = _unit_stride(query), key_pool.contiguous(), value_pool.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    cu = cu_seqlens.to(torch.int32).contiguous()
    positions = positions.to(torch.int32).contiguous()
    if num_queries == 0 or num_segments == 0:
        empty_lse = torch.empty(num_queries, num_heads, dtype=torch.float32, device=query.device)
        return torch.empty_like(query), empty_lse, None
    hinted = max_query_len is not None and max_context is not None
    if not hinted:  # read back from the device (a sync) unless given
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        last = (cu_seqlens[1:].long() - 1).clamp(min=0)
        contexts = torch.where(lengths > 0, positions.long()[last] + 1, torch.zeros_like(lengths))
        max_query_len, max_context = (int(v) for v in torch.stack([lengths.max(), contexts.max()]).tolist())
    max_len = max_query_len
    # The kernels read the scored rows straight from `score_starts` (-1 = unscored): no torch ops per layer here,
    # each of which would be a launch-bound kernel of its own in a CUDA graph.
    logits = None
    if score_starts is not None:
        score_starts = score_starts.to(torch.int32).contiguous()
        if max_scored_queries is None:  # read back from the device (a sync) unless given
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            max_scored_queries = int(torch.where(score_starts >= 0, lengths - score_starts, 0).max())
        max_scored_rows = max(1, max_scored_queries) * group
        if stores_logits(max_scored_rows, head_dim, key_pool.element_size()):
            logits = _score_scratch((num_segments, num_kv_heads, max_scored_rows, _padded(max_context)), query.device)
    scratch = logits if logits is not None else positions  # any valid pointer when no logits are stored
    block_m, rows, settings = query_tiling(max_len, group, head_dim, logits is not None, query.element_size())
    num_q_blocks = triton.cdiv(max_len, block_m)
    target = _target_programs(logits is not None)
    programs = num_kv_heads * num_q_blocks  # per segment
    if num_splits:  # used as given; the live count applies to a count the kernel chooses
        splits, counts_live = num_splits, False
    else:
        live_floor = min_live_segments if live_segments is not None else None
        splits, counts_live = split_grid(num_segments, programs, max_context, target, live_floor)
    out = torch.empty(splits, num_queries, num_heads, head_dim, dtype=_out_dtype(query, splits), device=query.device)
    lse = torch.empty(splits, num_queries, num_heads, dtype=torch.float32, device=query.device)
    grid = (num_segments, num_kv_heads, num_q_blocks * splits)
    args = [
        query, key_pool, value_pool, block_tables, cu, positions, out, lse, scratch,
        score_starts if score_starts is not None else cu, live_segments if live_segments is not None else cu,
        query.stride(0), query.stride(1),
        key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        scratch.stride(0) if logits is not None else 0,
        scratch.stride(1) if logits is not None else 0,
        scratch.stride(2) if logits is not None else 0,
        scale, num_q_blocks,
    ]
    constants = dense_constants(group, head_dim, key_pool.shape[1], query.dtype, block_m, rows, settings,
                                logits is not None, num_q_blocks == 1, counts_live, splits)
    _dense_varlen_kernel[grid](*args, **constants)
    if logits is not None:
        _build_the_other_split_choice(args, constants, query)
    live = (live_segments, programs, target) if counts_live else None
    out, lse = merge_splits(out, lse, query.dtype, live)
    if score_starts is None:
        return out, lse, None
    length = max(max_context, 1)
    scores = verify_scores_tensor(scores_out, (num_segments, num_kv_heads, length), query.device)
    if logits is not None:
        return out, lse, _reduce_stored_logits(logits, lse, cu, positions, score_starts, group, scores)
    _verify_scores(query, key_pool, block_tables, cu, positions, score_starts, lse, scale, max_scored_rows, scores)
    return out, lse, scores


_SPLIT_CHOICES_BUILT: set[tuple] = set()


def _build_the_other_split_choice(args: list, constants: dict, query: torch.Tensor) -> None:
    """Compile, without launching, the variant of a logit-storing dense launch that the other split choice would
    use (`WHOLE_CONTEXT` unsplit, or split with a fixed count), the first time an eager launch on a GPU meets these
    bounds.

    Whether such a verify is split depends on its batch and contexts, so a later rollout step can meet the other
    choice for the first time and compile it (~1 s) mid-run. Launching it once beside the first launch built it too,
    but left later CUDA-graph captures invalidated in some GPU test runs; `warmup` only compiles: no allocation, no
    work on the device. The two choices pass the same arguments but the output's dtype (`_out_dtype`; `warmup`
    takes a dtype in place of a tensor, specialised as an aligned pointer, as every allocation is) and these flags.
    """
    if query.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return
    whole = constants["WHOLE_CONTEXT"]
    bounds = (query.device, *sorted((name, str(value)) for name, value in constants.items()
                                    if name not in ("WHOLE_CONTEXT", "COUNT_LIVE")))
    key = (*bounds, whole)
    if key in _SPLIT_CHOICES_BUILT:
        return
    _SPLIT_CHOICES_BUILT.add(key)
    other = list(args)
    other[6] = _out_dtype(query, 2 if whole else 1)  # `out`
    _dense_varlen_kernel.warmup(*other, grid=(1,), **{**constants, "WHOLE_CONTEXT": not whole, "COUNT_LIVE": False})


def stores_logits(scored_rows: int, head_dim: int, kv_element_size: int) -> bool:
    """How a verify's scores are made: from the scored rows' logits, stored by the attention kernel (float32, written
    and read back: 8 bytes per row and key), or recomputed from a second read of K (`head_dim` elements per key)
    by `_verify_scores_kernel`, whichever moves fewer bytes per key and KV head (the timings that agree with this
    rule are in docs/benchmarks.md, "Kernel launch settings").
    """
    return scored_rows * 8 < head_dim * kv_element_size


@triton.jit
def _scored_rows(cu_ptr, start_ptr, segment, GROUP: tl.constexpr):
    """First scored query of `segment` and its number of scored (query, GQA head) rows (0 when unscored)."""
    seg_start = tl.load(cu_ptr + segment)
    seg_end = tl.load(cu_ptr + segment + 1)
    score_start = tl.load(start_ptr + segment)
    first_query = tl.where(score_start >= 0, seg_start + score_start, seg_end)  # -1: not scored, no rows
    return first_query, tl.maximum(seg_end - first_query, 0) * GROUP


@triton.jit(do_not_specialize=["stride_bts", "stride_os", "stride_oh", "length"])
def _verify_scores_kernel(
    q_ptr, k_ptr, bt_ptr, cu_ptr, pos_ptr, start_ptr, lse_ptr, out_ptr,
    stride_qn, stride_qh,
    stride_kp, stride_ko, stride_kh,
    stride_bts,
    stride_ln,
    stride_os, stride_oh,
    scale, length,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, PRECISION: tl.constexpr,
):
    segment = tl.program_id(0)
    kv_head = tl.program_id(1)
    keys = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    first_query, num_rows = _scored_rows(cu_ptr, start_ptr, segment, GROUP)
    # The last query sees the most keys; keys past it are never read (their score is zero).
    last_query = first_query + num_rows // GROUP - 1
    context = tl.load(pos_ptr + last_query, mask=num_rows > 0, other=-1) + 1
    key_ok = keys < context
    page = tl.load(bt_ptr + segment * stride_bts + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    row_base = page * stride_kp + (keys % PAGE_SIZE) * stride_ko + kv_head * stride_kh
    k = tl.load(k_ptr + row_base[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_L], tl.float32)
    # One K tile serves every scored (query, head) row of the segment: a verify block is a single iteration.
    for first_row in range(0, num_rows, ROWS):
        rows = first_row + tl.arange(0, ROWS)
        row_ok = rows < num_rows
        query = first_query + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        q = tl.load(
            q_ptr + query[:, None] * stride_qn + heads[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        )
        row_lse = tl.load(lse_ptr + query * stride_ln + heads, mask=row_ok, other=0.0)
        q_pos = tl.load(pos_ptr + query, mask=row_ok, other=-1)
        # The same logits as the attention kernel's: same operands, same dot precision, same scaling.
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        acc += tl.sum(tl.where(visible, tl.exp(logits - row_lse[:, None]), 0.0), 0)
    tl.store(out_ptr + segment * stride_os + kv_head * stride_oh + keys, acc / tl.maximum(num_rows, 1),
             mask=keys < length)


def _verify_scores(
    query, key_pool, block_tables, cu_seqlens, positions, score_starts, lse, scale, max_rows, scores
) -> torch.Tensor:
    """Mean softmax weight per key position over each segment's scored (query, head) rows, into `scores`
    `[S, Hkv, length]`.

    Each program owns a block of key positions of one (segment, KV head): it reads that K tile once, recomputes
    the scored rows' logits against it and sums `exp(logit - lse)` with the attention's merged normalisers.
    """
    num_segments, num_kv_heads, length = scores.shape
    head_dim = key_pool.shape[3]
    group = query.shape[1] // num_kv_heads
    block = _key_tile(head_dim)  # the attention kernels' K tile (fixed while tune_kernels sweeps theirs)
    _verify_scores_kernel[(num_segments, num_kv_heads, triton.cdiv(length, block))](
        query, key_pool, block_tables, cu_seqlens, positions, score_starts, lse, scores,
        query.stride(0), query.stride(1),
        key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
        block_tables.stride(0),
        lse.stride(0),
        scores.stride(0), scores.stride(1),
        scale, length,
        PAGE_SIZE=key_pool.shape[1], GROUP=group, ROWS=min(64, max(16, triton.next_power_of_2(max_rows))),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_L=block,
        PRECISION=_dot_precision(query.dtype), num_warps=4,
    )
    return scores


@triton.jit(do_not_specialize=["stride_os", "stride_oh", "length"])
def _reduce_scores_kernel(
    logit_ptr, lse_ptr, cu_ptr, pos_ptr, start_ptr, out_ptr,
    stride_gs, stride_gh, stride_gr,
    stride_ln,
    stride_os, stride_oh,
    length,
    GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_L: tl.constexpr,
):
    segment = tl.program_id(0)
    kv_head = tl.program_id(1)
    keys = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    key_ok = keys < length
    first_query, num_rows = _scored_rows(cu_ptr, start_ptr, segment, GROUP)
    acc = tl.zeros([BLOCK_L], tl.float32)
    # A tile of scored (query, head) rows per iteration, one iteration for a verify block, instead of one row at a
    # time with two dependent scalar loads each.
    for first_row in range(0, num_rows, ROWS):
        rows = first_row + tl.arange(0, ROWS)
        row_ok = rows < num_rows
        query = first_query + rows // GROUP
        row_lse = tl.load(lse_ptr + query * stride_ln + kv_head * GROUP + rows % GROUP, mask=row_ok, other=0.0)
        q_pos = tl.load(pos_ptr + query, mask=row_ok, other=-1)
        # Only keys the query sees were written (the scratch is not initialised); the others weigh zero.
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        logits = tl.load(
            logit_ptr + segment * stride_gs + kv_head * stride_gh + rows[:, None] * stride_gr + keys[None, :],
            mask=visible, other=float("-inf"),
        )
        acc += tl.sum(tl.exp(logits - row_lse[:, None]), 0)
    tl.store(out_ptr + segment * stride_os + kv_head * stride_oh + keys, acc / tl.maximum(num_rows, 1), mask=key_ok)


def _reduce_stored_logits(logits, lse, cu_seqlens, positions, score_starts, group, scores) -> torch.Tensor:
    """Mean softmax weight per key position from the scored rows' logits and their saved LSE, into `scores`
    `[S, Hkv, length]`.

    One pass over the logit scratch (a few rows per segment), never over K: each program owns a block of key
    positions of one (segment, KV head) and sums `exp(logit - lse)` over the scored (query, head) rows.
    """
    num_segments, num_kv_heads, max_rows, _ = logits.shape  # the key axis padded past `length` (`_padded`)
    length = scores.shape[-1]
    rows = min(64, max(2, triton.next_power_of_2(max_rows)))
    block = min(1024, 8192 // rows)  # ~8K logits per tile
    _reduce_scores_kernel[(num_segments, num_kv_heads, triton.cdiv(length, block))](
        logits, lse, cu_seqlens, positions, score_starts, scores,
        logits.stride(0), logits.stride(1), logits.stride(2),
        lse.stride(0),
        scores.stride(0), scores.stride(1),
        length,
        GROUP=group, ROWS=rows, BLOCK_L=block,
    )
    return scores


@triton.jit(do_not_specialize=["splits", "programs_per_segment", "stride_qs"])
def _merge_splits_kernel(
    part_ptr, part_lse_ptr, out_ptr, lse_ptr, live_ptr,
    splits, programs_per_segment,
    stride_ps, stride_pn, stride_ph,
    stride_qs, stride_qn,
    stride_on, stride_oh,
    stride_ln,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    COUNT_LIVE: tl.constexpr, TARGET_PROGRAMS: tl.constexpr,
):
    query = tl.program_id(0)
    if COUNT_LIVE:  # the most splits the attention kernel used for the live segments (fewer at short contexts)
        splits = tl.minimum(splits, _live_splits(live_ptr, programs_per_segment, splits, TARGET_PROGRAMS, 1))
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < NUM_HEADS
    mask = head_ok[:, None] & (dims[None, :] < HEAD_DIM)
    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(splits):
        part_lse = tl.load(part_lse_ptr + split * stride_qs + query * stride_qn + heads, mask=head_ok,
                           other=float("-inf"))
        top = tl.maximum(top, part_lse)
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: weights are all zero
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(splits):
        part_lse = tl.load(part_lse_ptr + split * stride_qs + query * stride_qn + heads, mask=head_ok,
                           other=float("-inf"))
        weight = tl.exp(part_lse - top)
        # A split that saw no key of a row may have stored no result for it (a graph's unused splits): not read.
        seen = part_lse > float("-inf")
        part = tl.load(part_ptr + split * stride_ps + query * stride_pn + heads[:, None] * stride_ph + dims[None, :],
                       mask=mask & seen[:, None], other=0.0)
        total += weight
        acc += weight[:, None] * part
    merged = acc / tl.maximum(total, 1e-30)[:, None]
    tl.store(out_ptr + query * stride_on + heads[:, None] * stride_oh + dims[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + query * stride_ln + heads, top + tl.log(total), mask=head_ok)


def merge_splits(
    partial: torch.Tensor, partial_lse: torch.Tensor, dtype: torch.dtype,
    live: tuple[torch.Tensor, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.merge_splits`: one launch instead of a dozen small torch kernels, so splitting a
    short key range over more programs pays even at rollout batch sizes.

    `live`: `(live_segments, programs per segment, target programs)` of a dense launch that chose its split count
    on the device; only the splits it can have used are read.
    """
    splits, num_queries, num_heads, head_dim = partial.shape
    if splits == 1:
        return partial[0].to(dtype), partial_lse[0]
    out = torch.empty(num_queries, num_heads, head_dim, dtype=dtype, device=partial.device)
    lse = torch.empty(num_queries, num_heads, dtype=torch.float32, device=partial.device)
    live_segments, programs, target = live if live is not None else (partial_lse, 1, _TARGET_PROGRAMS)
    _merge_splits_kernel[(num_queries,)](
        partial, partial_lse, out, lse, live_segments,
        splits, programs,
        partial.stride(0), partial.stride(1), partial.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), COUNT_LIVE=live is not None, TARGET_PROGRAMS=target,
    )
    return out, lse


@triton.jit
def _write_kv_kernel(
    key_pool_ptr, value_pool_ptr, rows_ptr, keys_ptr, values_ptr,
    stride_pool_row, stride_pool_h,
    stride_kn, stride_kh, stride_vn, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    row = tl.load(rows_ptr + token).to(tl.int64)
    target = row * stride_pool_row + heads[:, None] * stride_pool_h + dims[None, :]
    key = tl.load(keys_ptr + token * stride_kn + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(key_pool_ptr + target, key.to(key_pool_ptr.dtype.element_ty), mask=mask)
    value = tl.load(values_ptr + token * stride_vn + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(value_pool_ptr + target, value.to(value_pool_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key_pool: torch.Tensor, value_pool: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Triton version of `reference.write_kv`: K and V of a step in one launch instead of two `index_copy_`s (at
    rollout batch sizes each is a launch-bound kernel, once per layer and forward)."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    if not (key_pool.is_contiguous() and value_pool.is_contiguous()):
        raise ValueError("write_kv needs contiguous K/V pools (a flat row is page * page_size + offset)")
    if num_tokens == 0:
        return
    keys, values = _unit_stride(keys), _unit_stride(values)
    _write_kv_kernel[(num_tokens,)](
        key_pool, value_pool, rows, keys, values,
        key_pool.stride(1), key_pool.stride(2),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


KERNELS = (
    _sparse_decode_kernel, _dense_varlen_kernel, _verify_scores_kernel, _reduce_scores_kernel, _merge_splits_kernel,
    _write_kv_kernel, *_VIEW_KERNELS,
)


def compiled_variants() -> int:
    """Variants of `KERNELS` built in this process (one per device and specialization of their arguments)."""
    return len(variant_keys())


def variant_keys(kernels: tuple = KERNELS) -> set[tuple[str, str]]:
    """`(kernel name, specialization key)` of every variant of `kernels` built in this process."""
    return {
        (kernel.fn.__name__, str(key))
        for kernel in kernels for caches in getattr(kernel, "device_caches", {}).values() for key in caches[0]
    }


def select_topk_candidates(scores: torch.Tensor, history_lens: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """`torch.topk` version of `reference.select_topk_candidates` (tie order may differ)."""
    num_segments, num_kv_heads, length = scores.shape
    keep = min(num_candidates, length)
    in_history = torch.arange(length, device=scores.device)[None, :] < history_lens[:, None].to(scores.device)
    masked = scores.masked_fill(~in_history[:, None, :], float("-inf"))
    order = torch.topk(masked, keep, dim=-1, sorted=True).indices
    picked = torch.gather(in_history[:, None, :].expand(-1, num_kv_heads, -1), 2, order)
    result = torch.full((num_segments, num_kv_heads, num_candidates), -1, dtype=torch.int32, device=scores.device)
    result[..., :keep] = torch.where(picked, order, torch.full_like(order, -1)).to(torch.int32)
    return result
