"""Triton version of `reference.select_index_views`: an index-view refresh in one launch.

The torch path stacks every layer's verify scores, masks the positions past each history, runs `torch.topk` (a
radix select with several passes and a sort of the kept scores) and then merges the candidates with the recent
window in another sort. Here one program per (layer, segment, KV head) does all of it over its row of scores:

1. the `top`-th largest score, found over the scores' order-preserving integer keys: for a row of up to `ROW`
   scores, held in registers, by a search of the key range that splits it at `THRESHOLDS` keys a step (a compare
   per key and key tested, and one block-wide sum of the counts, packed into one integer: the sums, one after
   another, are what a step waits for); for a longer row, read in blocks, by a radix select, eight bits a pass (a
   histogram of the next digit among the keys whose higher digits match; a histogram costs far more per key than
   a compare, hence the search where the row fits);
2. the positions of the keys above that threshold, and of the first keys equal to it (lower positions first, as
   the reference's stable sort breaks ties), written in ascending order: the order a view keeps, so no sort is
   needed: one prefix sum per block of the row (two where the threshold's ties are split, some of them taken);
3. the recent window after them, and `UNUSED_POSITION` up to the width.

The top-K and the recent window never overlap (candidates lie below the history length, the window at or above
it), so the view is their concatenation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from s3r_hf.kernels.reference import UNUSED_POSITION

# `(ROW, BLOCK, warps, THRESHOLDS)` by the scores' length: rows of up to ROW scores are held in registers (a search
# step costs each key, so ROW is as short as the rows allow) and searched THRESHOLDS keys a step, longer ones read
# BLOCK scores at a time. ROW, BLOCK and warps: the fastest of `tools/view_refresh.py --sweep` at 4K, 8K and 16K
# (docs/benchmarks.md, "Kernel launch settings"). THRESHOLDS: one key a step (the bisection). More keys a step take
# fewer reductions for more compares per key; the sweep of 1-4 found none faster by more than 3% at any point.
LAUNCHES = ((4096, (4096, 1024, 4, 1)), (8192, (8192, 1024, 8, 1)), (None, (16384, 1024, 16, 1)))
LAUNCH_OVERRIDE: tuple[int, int, int, int] | None = None  # replaces the choice (`tools/view_refresh.py --sweep`)


def _launch(length: int) -> tuple[int, int, int, int]:
    """`(ROW, BLOCK, warps, THRESHOLDS)` for rows of up to `length` scores: three variants at most, whatever the
    contexts."""
    if LAUNCH_OVERRIDE is not None:
        return LAUNCH_OVERRIDE
    return next(launch for longest, launch in LAUNCHES if longest is None or length <= longest)


@triton.jit
def _order_keys(row_ptr, offsets, valid):
    """int32 keys whose signed order is the float order of the scores (-0.0 counted as 0.0)."""
    score = tl.load(row_ptr + offsets, mask=valid, other=0.0)
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip all but the sign bit


@triton.jit
def _digit(keys, SHIFT: tl.constexpr):
    """The 8-bit digit of the keys at `SHIFT`, the keys taken as unsigned (sign bit flipped)."""
    digit = (keys >> SHIFT) & 0xFF
    if SHIFT == 24:
        digit = digit ^ 0x80
    return digit


@triton.jit
def _high_digits(keys, SHIFT: tl.constexpr):
    """The digits above `SHIFT` of the keys taken as unsigned, as one number (`SHIFT < 24`)."""
    return ((keys >> (SHIFT + 8)) & ((1 << (24 - SHIFT)) - 1)) ^ (1 << (23 - SHIFT))


@triton.jit
def _count_at_or_above(keys, low, span_keys, THRESHOLDS: tl.constexpr):
    """How many keys are at or above each tested key `low + ceil(j * span_keys / (THRESHOLDS + 1))`, j = 1 ..
    THRESHOLDS, packed 16 bits a count into one integer: one block-wide reduction for all (int32 for up to two)."""
    packed = tl.zeros(keys.shape, tl.int32 if THRESHOLDS <= 2 else tl.int64)
    for j in tl.static_range(THRESHOLDS):
        tested = (low + (span_keys * (j + 1) + THRESHOLDS) // (THRESHOLDS + 1)).to(tl.int32)
        packed += (keys >= tested).to(packed.dtype) << (16 * j)
    return tl.sum(packed).to(tl.int64)


@triton.jit
def _threshold_in_registers(row_ptr, span, top, ROW: tl.constexpr, THRESHOLDS: tl.constexpr):
    """`(threshold key, how many keys equal to it to take, how many keys equal it)` of a row of at most `ROW`
    scores, held in registers: a search of the key range that tests `THRESHOLDS` keys a step."""
    tl.static_assert(ROW <= 16384)  # a count fits its 16-bit field, the highest one too, with no sign bit set
    tl.static_assert(THRESHOLDS >= 1 and THRESHOLDS <= 4)
    offsets = tl.arange(0, ROW)
    valid = offsets < span
    keys = _order_keys(row_ptr, offsets, valid)
    # The answer is the largest key value with at least `top` keys at or above it: `low` always has them.
    low = tl.min(tl.where(valid, keys, 2147483647)).to(tl.int64)
    # Past the row, the lowest key: below every tested key (> low), so never counted. Only `keys` stays live in
    # the loop (registers set how many programs an SM holds).
    keys = tl.where(valid, keys, -2147483648)
    high = tl.max(keys).to(tl.int64)
    while low < high:  # int64: the key range may span 2**32
        span_keys = high - low
        counts = _count_at_or_above(keys, low, span_keys, THRESHOLDS)
        passed = tl.zeros([], tl.int64)  # tested keys with `top` keys at or above them: the lowest ones
        for j in tl.static_range(THRESHOLDS):
            passed += (((counts >> (16 * j)) & 0xFFFF) >= top).to(tl.int64)
        first_failed = low + (span_keys * (passed + 1) + THRESHOLDS) // (THRESHOLDS + 1)
        high = tl.where(passed < THRESHOLDS, first_failed - 1, high)
        low = low + (span_keys * passed + THRESHOLDS) // (THRESHOLDS + 1)
    threshold = low.to(tl.int32)
    tally = tl.sum((keys > threshold).to(tl.int32) + ((keys == threshold).to(tl.int32) << 16))
    return threshold, top - (tally & 0xFFFF), tally >> 16


@triton.jit
def _threshold_by_radix(row_ptr, span, top, BLOCK: tl.constexpr):
    """The same for rows of any length, read `BLOCK` scores at a time: a radix select, a digit of eight bits per
    pass over the row from the highest (a histogram of the next digit among the keys whose higher digits match)."""
    bins = tl.arange(0, 256)
    prefix = 0  # the digits found so far, as unsigned digits
    remaining = top  # keys at or above the threshold still to be taken
    for level in tl.static_range(4):  # the digit at bit 24 - 8 * level
        counts = tl.zeros([256], tl.int32)
        for start in range(0, span, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            valid = offsets < span
            keys = _order_keys(row_ptr, offsets, valid)
            if level > 0:
                valid = valid & (_high_digits(keys, 24 - 8 * level) == prefix)
            counts += tl.histogram(_digit(keys, 24 - 8 * level), 256, mask=valid)
        # Keys at or above each digit; the threshold's digit is the highest one with `remaining` of them.
        at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts
        digit = tl.sum((at_or_above >= remaining).to(tl.int32)) - 1
        remaining -= tl.sum(tl.where(bins > digit, counts, 0))
        prefix = prefix * 256 + digit
    equal = tl.sum(tl.where(bins == digit, counts, 0))  # the last digit's keys: those equal to the threshold
    return (prefix ^ -2147483648).to(tl.int32), remaining, equal  # back from unsigned digits to a signed key


@triton.jit
def _write_top(row_ptr, out_ptr, span, limit, threshold, remaining, equal, CHUNK: tl.constexpr):
    """The positions of every key above `threshold` and of the first `remaining` of the `equal` keys equal to it,
    ascending, in the row's first `limit` columns: one prefix sum per chunk, two where the ties are split."""
    split_ties = remaining < equal
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, span, CHUNK):
        offsets = start + tl.arange(0, CHUNK)
        valid = offsets < span
        keys = _order_keys(row_ptr, offsets, valid)
        if split_ties:
            is_equal = (valid & (keys == threshold)).to(tl.int32)
            tie_rank = ties + tl.cumsum(is_equal, 0) - is_equal
            take = ((valid & (keys > threshold)) | ((is_equal > 0) & (tie_rank < remaining))).to(tl.int32)
            ties += tl.sum(is_equal)
        else:
            take = (valid & (keys >= threshold)).to(tl.int32)
        slots = taken + tl.cumsum(take, 0) - take
        tl.store(out_ptr + slots, offsets, mask=(take > 0) & (slots < limit))
        taken += tl.sum(take)


@triton.jit(do_not_specialize=["num_segments", "width", "stride_sl", "stride_ss", "stride_sh", "stride_ol",
                               "stride_os", "stride_oh"])
def _select_views_kernel(
    scores_ptr, segments_ptr, history_ptr, context_ptr, budget_ptr, out_ptr, num_segments, width,
    stride_sl, stride_ss, stride_sh, stride_ol, stride_os, stride_oh,
    UNUSED: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr, THRESHOLDS: tl.constexpr,
):
    # Offsets in int64: every layer's scores of a long-context batch pass 2**31 elements.
    layer = (tl.program_id(0) // num_segments).to(tl.int64)
    index = (tl.program_id(0) % num_segments).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    segment = tl.load(segments_ptr + index).to(tl.int64)
    history = tl.load(history_ptr + index).to(tl.int32)
    context = tl.load(context_ptr + index).to(tl.int32)
    budget = tl.load(budget_ptr + index).to(tl.int32)
    recent = tl.minimum(context - history, budget)
    top = budget - recent
    row = scores_ptr + layer * stride_sl + segment * stride_ss + head * stride_sh
    out = out_ptr + layer * stride_ol + index * stride_os + head * stride_oh
    span = tl.where(top > 0, history, 0)  # a view of the recent window alone reads no scores

    # 1. The `top`-th largest key, and how many of the keys equal to it are taken (lower positions first);
    # 2. the top keys' positions, in ascending order. Exactly `top` are taken; the bound keeps even a wrong
    # threshold or a budget past the width (a caller's error) from writing past the row.
    if span <= ROW:
        threshold, remaining, equal = _threshold_in_registers(row, span, top, ROW, THRESHOLDS)
    else:
        threshold, remaining, equal = _threshold_by_radix(row, span, top, BLOCK)
    # `BLOCK` at a time: fewer registers than `ROW`.
    _write_top(row, out, span, tl.minimum(top, width), threshold, remaining, equal, BLOCK)

    # 3. The recent window `[context - recent, context)` after them, then unused entries.
    for start in range(0, width, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        positions = tl.where(columns < budget, context - recent + (columns - top), UNUSED)
        tl.store(out + columns, positions, mask=(columns >= top) & (columns < width))


def select_index_views(
    scores: torch.Tensor,
    segments: torch.Tensor,
    history_lens: torch.Tensor,
    context_lens: torch.Tensor,
    budgets: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Triton version of `reference.select_index_views` (same arguments and result, ties broken the same way)."""
    num_layers, _, num_kv_heads, _ = scores.shape
    num_segments = segments.shape[0]
    out = torch.empty(num_layers, num_segments, num_kv_heads, width, dtype=torch.int32, device=scores.device)
    if num_segments == 0 or width == 0:
        return out
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    device = scores.device
    metadata = [t.to(device, torch.int32).contiguous() for t in (segments, history_lens, context_lens, budgets)]
    row, block, warps, thresholds = _launch(scores.shape[-1])  # the scores' length bounds every history
    _select_views_kernel[(num_layers * num_segments, num_kv_heads)](
        scores, *metadata, out, num_segments, width,
        scores.stride(0), scores.stride(1), scores.stride(2), out.stride(0), out.stride(1), out.stride(2),
        UNUSED=UNUSED_POSITION, ROW=row, BLOCK=block, THRESHOLDS=thresholds, num_warps=warps,
    )
    return out


KERNELS = (_select_views_kernel,)
