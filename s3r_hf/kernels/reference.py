"""Torch reference kernels: the ground truth every faster backend is tested against.

All functions work on the paged layout of `S3RCache`: per layer, K and V pools of shape
`[num_pages, page_size, num_kv_heads, head_dim]`, and per segment a block table (row of page ids). A token at
absolute position `p` of a request lives in page `block_table[p // page_size]` at offset `p % page_size`.

Queries arrive packed (varlen): `query` is `[num_queries, num_heads, head_dim]` and `cu_seqlens[s]:cu_seqlens[s+1]`
are the queries of segment `s`. `positions[i]` is the absolute position of query `i`; its own K/V is already in
the pool, so "causal" means a query attends to every position `<= positions[i]` of its request.
"""

from __future__ import annotations

import torch


def gather_positions(pool: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of `pool` (`[pages, page_size, H, D]`) at absolute `positions` → `[..., H, D]`.

    `block_table` is `[P]` with `positions` of any shape, or `[S, P]` with `positions` `[S, L]`.
    """
    page_size = pool.shape[1]
    table, page_index = block_table.long(), (positions // page_size).long()
    # torch.gather needs index.dim() == table.dim(): a single `[P]` table is indexed directly instead.
    pages = table[page_index] if table.dim() == 1 else torch.gather(table, -1, page_index)
    return pool[pages, positions % page_size]


def write_kv(
    key_pool: torch.Tensor, value_pool: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Write `keys`/`values` `[N, Hkv, D]` (any strides, any float dtype) into the pools at flat rows `rows` `[N]`
    (`page * page_size + offset`), cast to the pools' dtype."""
    num_kv_heads, head_dim = key_pool.shape[2:]
    key_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, rows, keys.to(key_pool.dtype))
    value_pool.view(-1, num_kv_heads, head_dim).index_copy_(0, rows, values.to(value_pool.dtype))


def _segment_layout(cu_seqlens: torch.Tensor, positions: torch.Tensor):
    """Segment id and offset of each packed query, segment lengths, and each segment's context length."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    segment = torch.repeat_interleave(torch.arange(lengths.shape[0], device=positions.device), lengths)
    offset = torch.arange(positions.shape[0], device=positions.device) - cu_seqlens[:-1][segment]
    last = (cu_seqlens[1:] - 1).clamp(min=0)
    contexts = torch.where(lengths > 0, positions[last] + 1, torch.zeros_like(lengths))
    return segment, offset, lengths, contexts


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
    """Dense causal attention of packed varlen queries over paged K/V (prefill chunks and verify blocks).

    Args:
        query: `[N, Hq, D]` packed queries.
        key_pool, value_pool: `[num_pages, page_size, Hkv, D]`.
        block_tables: `[S, max_pages]` int32, one row per segment.
        cu_seqlens: `[S + 1]` query offsets of the segments.
        positions: `[N]` absolute position of each query in its request.
        scale: softmax scale.
        score_starts: optional `[S]`; queries `score_starts[s]..` (index inside segment `s`) contribute to the
            segment's verify scores, `-1` means the segment is not scored.
        max_query_len, max_context: the longest segment and context when the caller knows them (host ints);
            saves reading them back from the device. `scores` is `max_context` wide when given.
        max_scored_queries: the most scored queries of any segment, when known (sizes a kernel's scratch).
        num_splits: how many programs a kernel splits each row's keys over (ignored here).
        live_segments: `[1]` int32, how many segments hold real queries, the rest padding, when a kernel sizes its
            key splits for those on the device (a CUDA graph replayed at other row counts; ignored here).
        min_live_segments: the fewest segments `live_segments` will hold (sizes that grid; ignored here).
        scores_out: where to write `scores` (float32 `[S, Hkv, max_context]`, unit stride in its last dimension),
            e.g. one layer's part of every layer's scores; by default a new tensor.

    Returns:
        `out` `[N, Hq, D]`, `lse` `[N, Hq]` (natural-log normaliser of each query's softmax), and, when
        `score_starts` is given, `scores` `[S, Hkv, max_context]`: for each key position, the mean softmax
        weight it received over the scored queries and the query heads of each KV head's GQA group (zero for
        positions outside the segment's context and for unscored segments).
    """
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    cu_seqlens, positions = cu_seqlens.long(), positions.long()
    segment, offset, lengths, contexts = _segment_layout(cu_seqlens, positions)
    num_segments = lengths.shape[0]
    width = max_query_len if max_query_len is not None else (int(lengths.max()) if num_segments else 0)
    context = max_context if max_context is not None else (int(contexts.max()) if num_segments else 0)

    # Padded views: queries [S, n, Hkv, G, D], keys/values [S, L, Hkv, D] gathered through the block tables.
    padded_q = query.new_zeros(num_segments, width, num_heads, head_dim)
    padded_q[segment, offset] = query
    padded_q = padded_q.view(num_segments, width, num_kv_heads, group, head_dim).float()
    query_pos = torch.full((num_segments, width), -1, dtype=torch.long, device=query.device)
    query_pos[segment, offset] = positions
    key_pos = torch.arange(context, device=query.device)
    keys = gather_positions(key_pool, block_tables, key_pos[None, :].expand(num_segments, -1)).float()
    values = gather_positions(value_pool, block_tables, key_pos[None, :].expand(num_segments, -1)).float()

    logits = torch.einsum("snhgd,skhd->shgnk", padded_q, keys) * scale  # [S, Hkv, G, n, L]
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, n, L]; padding queries see nothing
    logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    seg_lse = torch.logsumexp(logits, dim=-1)  # [S, Hkv, G, n]
    probs = torch.exp(logits - seg_lse[..., None]).nan_to_num(0.0)
    padded_out = torch.einsum("shgnk,skhd->snhgd", probs, values)

    out = padded_out.reshape(num_segments, width, num_heads, head_dim)[segment, offset].to(query.dtype)
    lse = seg_lse.permute(0, 3, 1, 2).reshape(num_segments, width, num_heads)[segment, offset]
    scores = None
    if score_starts is not None:
        starts = score_starts.long()
        scored = (torch.arange(width, device=query.device)[None, :] >= starts[:, None]) & (starts[:, None] >= 0)
        scored &= query_pos >= 0  # [S, n]
        weight = scored.float() / (scored.sum(dim=1, keepdim=True).clamp(min=1) * group)
        scores = torch.einsum("shgnk,sn->shk", probs, weight)
        if scores_out is not None:
            scores = verify_scores_tensor(scores_out, tuple(scores.shape), query.device).copy_(scores)
    return out, lse, scores


def verify_scores_tensor(scores_out: torch.Tensor | None, shape: tuple[int, ...], device) -> torch.Tensor:
    """The tensor a dense attention writes its verify scores into: the caller's `scores_out`, checked against
    `shape`, or a new one."""
    if scores_out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(scores_out.shape) != tuple(shape) or scores_out.dtype != torch.float32 or scores_out.stride(-1) != 1:
        raise ValueError(f"scores_out must be float32 {list(shape)} with unit stride in its last dimension, got "
                         f"{scores_out.dtype} {list(scores_out.shape)} with strides {list(scores_out.stride())}")
    return scores_out


def merge_splits(
    partial: torch.Tensor, partial_lse: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine the softmax results of a key range split over several programs (flash-decoding).

    Args:
        partial: `[P, N, H, D]` float32, each split's output normalised over its own keys.
        partial_lse: `[P, N, H]` each split's log-sum-exp (`-inf` where a split saw no key).
        dtype: dtype of the merged output.

    Returns:
        `out` `[N, H, D]` in `dtype` and `lse` `[N, H]`: the attention over all keys (zeros and `-inf` for rows
        that saw no key at all).
    """
    top = partial_lse.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(partial_lse - top)
    total = weights.sum(dim=0)
    merged = (weights[..., None] * partial).sum(dim=0) / total.clamp(min=1e-30)[..., None]
    return merged.to(dtype), top + torch.log(total)


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
    """Sparse decode attention of single-token draft queries over an index view plus the provisional tail.

    Query `i` attends, for each KV head `h`, to the committed positions `index_view[i, h, :view_lens[i]]` and to
    every position in `[tail_starts[i], positions[i]]` (the draft tokens of the current block, whose K/V are
    provisional). K/V are read through the block table by position.

    Args:
        query: `[N, Hq, D]`, one query per draft segment.
        key_pool, value_pool: `[num_pages, page_size, Hkv, D]`.
        block_tables: `[N, max_pages]` int32.
        index_view: `[N, Hkv, K_max]` int32 sorted positions (entries past `view_lens[i]` are ignored).
        view_lens: `[N]` valid entries of each row of `index_view`.
        tail_starts: `[N]` first provisional position (the committed length).
        positions: `[N]` absolute position of each query.
        scale: softmax scale.
        max_keys: the largest `view_lens + tail length` when the caller knows it (a host int; used by kernels
            that split keys over programs, ignored here).
        num_splits: how many programs a kernel splits each row's keys over (ignored here).

    Returns:
        `out` `[N, Hq, D]` and `lse` `[N, Hq]`.
    """
    num_queries, num_heads, head_dim = query.shape
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    page_size = key_pool.shape[1]
    positions, tail_starts, view_lens = positions.long(), tail_starts.long(), view_lens.long()
    tail_lens = positions - tail_starts + 1
    view_width, tail_width = index_view.shape[-1], int(tail_lens.max()) if num_queries else 0

    # Key positions per (query, KV head): the view's entries, then the tail; with a validity mask.
    view_valid = torch.arange(view_width, device=query.device)[None, :] < view_lens[:, None]  # [N, K]
    tail_offsets = torch.arange(tail_width, device=query.device)
    tail_valid = tail_offsets[None, :] < tail_lens[:, None]  # [N, T]
    tail_pos = (tail_starts[:, None] + tail_offsets[None, :])[:, None, :].expand(-1, num_kv_heads, -1)
    key_pos = torch.cat([index_view.long(), tail_pos], dim=-1)  # [N, Hkv, K + T]
    valid = torch.cat([view_valid, tail_valid], dim=-1)[:, None, :].expand(-1, num_kv_heads, -1)
    key_pos = torch.where(valid, key_pos, torch.zeros_like(key_pos))

    pages = torch.gather(block_tables.long(), 1, (key_pos // page_size).reshape(num_queries, -1))
    pages = pages.view_as(key_pos)
    heads = torch.arange(num_kv_heads, device=query.device)[None, :, None]
    keys = key_pool[pages, key_pos % page_size, heads].float()  # [N, Hkv, W, D]
    values = value_pool[pages, key_pos % page_size, heads].float()

    grouped_q = query.view(num_queries, num_kv_heads, group, head_dim).float()
    logits = torch.einsum("nhgd,nhwd->nhgw", grouped_q, keys) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    head_lse = torch.logsumexp(logits, dim=-1)  # [N, Hkv, G]
    out = torch.einsum("nhgw,nhwd->nhgd", torch.exp(logits - head_lse[..., None]), values)
    return out.reshape(num_queries, num_heads, head_dim).to(query.dtype), head_lse.reshape(num_queries, num_heads)


def select_topk_candidates(scores: torch.Tensor, history_lens: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """Top-K of verify scores over each segment's history, best first.

    Args:
        scores: `[S, Hkv, L]` mean softmax weights per key position (from `paged_dense_attention`).
        history_lens: `[S]`; only positions `< history_lens[s]` are candidates (later positions are the block
            itself, which enters the index view as the recent window).
        num_candidates: how many to keep per (segment, KV head).

    Returns:
        `[S, Hkv, num_candidates]` int32 positions in descending score order (ties: lower position first);
        `-1` where a segment has fewer than `num_candidates` history positions.
    """
    num_segments, num_kv_heads, length = scores.shape
    keep = min(num_candidates, length)
    positions = torch.arange(length, device=scores.device)
    in_history = positions[None, :] < history_lens[:, None].to(scores.device)  # [S, L]
    masked = scores.masked_fill(~in_history[:, None, :], float("-inf"))
    # Stable descending sort gives a deterministic tie order (lower position first) on every backend.
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :keep]
    picked = torch.gather(in_history[:, None, :].expand(-1, num_kv_heads, -1), 2, order)
    result = torch.full((num_segments, num_kv_heads, num_candidates), -1, dtype=torch.int32, device=scores.device)
    result[..., :keep] = torch.where(picked, order, torch.full_like(order, -1)).to(torch.int32)
    return result


# An index view's unused entries (past its budget); sorts after every real position.
UNUSED_POSITION = torch.iinfo(torch.int32).max


def merge_index_views(
    candidates: torch.Tensor,
    history_lens: torch.Tensor,
    context_lens: torch.Tensor,
    budgets: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Index views `R ∪ TopK_{K-|R|}` from top-K candidates: the recent window plus the best-scored history.

    Args:
        candidates: `[L, S, Hkv, C]` history positions in descending score order (`-1` = none).
        history_lens: `[S]`; the recent window is `R = [history_lens, context_lens)`, cut to its last `budgets`
            positions where it is longer.
        context_lens: `[S]` committed length after the refresh.
        budgets: `[S]` view size `K` (`<= context_lens`).
        width: columns of the result (`>= max(budgets)`).

    Returns:
        `[L, S, Hkv, width]` int32 positions, ascending; entries past `budgets[s]` are `UNUSED_POSITION`.
    """
    device = candidates.device
    history_lens, context_lens, budgets = (t.to(device).long() for t in (history_lens, context_lens, budgets))
    recent_len = torch.minimum(context_lens - history_lens, budgets)  # [S]
    top_len = budgets - recent_len  # [S]
    num_layers, _, num_kv_heads, num_candidates = candidates.shape
    # Top part: the first `top_len` candidates of each row.
    cand_idx = torch.arange(num_candidates, device=device)
    cand_ok = (cand_idx[None, :] < top_len[:, None])[None, :, None, :] & (candidates >= 0)
    top = torch.where(cand_ok, candidates, torch.full_like(candidates, UNUSED_POSITION))
    # Recent part: the last `recent_len` positions before `context_lens` (at most the whole window).
    offsets = torch.arange(width, device=device)
    recent_pos = context_lens[:, None] - recent_len[:, None] + offsets[None, :]
    unused = torch.full_like(recent_pos, UNUSED_POSITION)
    recent = torch.where(offsets[None, :] < recent_len[:, None], recent_pos, unused)
    recent = recent[None, :, None, :].expand(num_layers, -1, num_kv_heads, -1).to(torch.int32)
    return torch.sort(torch.cat([top.to(torch.int32), recent], dim=-1), dim=-1).values[..., :width]


def select_index_views(
    scores: torch.Tensor,
    segments: torch.Tensor,
    history_lens: torch.Tensor,
    context_lens: torch.Tensor,
    budgets: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Every layer's index views of some scored segments, straight from a dense forward's verify scores.

    Args:
        scores: `[L, Sd, Hkv, ctx]` mean softmax weights per key position (`paged_dense_attention`, every layer).
        segments: `[S]` the rows of `Sd` to build views for.
        history_lens, context_lens, budgets: `[S]`, as `merge_index_views` takes them; top-K candidates are the
            positions `< history_lens` (ties: lower position first).
        width: columns of the result (`>= max(budgets)`).

    Returns:
        `merge_index_views`'s result: `[L, S, Hkv, width]` int32, ascending, `UNUSED_POSITION` past each budget.
    """
    picked = scores[:, segments.to(scores.device).long()]
    num_layers, num_segments, num_kv_heads = picked.shape[:3]
    history = history_lens.to(scores.device)
    candidates = select_topk_candidates(picked.flatten(0, 1), history.repeat(num_layers), width)
    candidates = candidates.view(num_layers, num_segments, num_kv_heads, width)
    return merge_index_views(candidates, history, context_lens, budgets, width)
