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
    """Rows of `pool` (`[pages, page_size, H, D]`) at absolute `positions` of one request → `[..., H, D]`."""
    page_size = pool.shape[1]
    pages = block_table.long()[positions // page_size]
    return pool[pages, positions % page_size]


def _expand_kv_heads(states: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`[L, Hkv, D]` → `[L, Hq, D]` by repeating each KV head over its GQA group."""
    group = num_heads // states.shape[1]
    return states.repeat_interleave(group, dim=1) if group > 1 else states


def paged_dense_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    score_starts: torch.Tensor | None = None,
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

    Returns:
        `out` `[N, Hq, D]`, `lse` `[N, Hq]` (natural-log normaliser of each query's softmax), and, when
        `score_starts` is given, `scores` `[S, Hkv, max_context]`: for each key position, the mean softmax
        weight it received over the scored queries and the query heads of each KV head's GQA group (zero for
        positions outside the segment's context and for unscored segments).
    """
    num_queries, num_heads, _ = query.shape
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    lse = torch.empty(num_queries, num_heads, dtype=torch.float32, device=query.device)
    bounds = cu_seqlens.tolist()
    contexts = [int(positions[end - 1]) + 1 if end > start else 0 for start, end in zip(bounds, bounds[1:])]
    scores = None
    if score_starts is not None:
        max_context = max(contexts, default=0)
        scores = torch.zeros(len(contexts), num_kv_heads, max_context, dtype=torch.float32, device=query.device)
    for seg, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end == start:
            continue
        key_positions = torch.arange(contexts[seg], device=query.device)
        keys = _expand_kv_heads(gather_positions(key_pool, block_tables[seg], key_positions), num_heads)
        values = _expand_kv_heads(gather_positions(value_pool, block_tables[seg], key_positions), num_heads)
        logits = torch.einsum("nhd,khd->hnk", query[start:end].float(), keys.float()) * scale
        future = key_positions[None, :] > positions[start:end, None]
        logits = logits.masked_fill(future[None], float("-inf"))
        seg_lse = torch.logsumexp(logits, dim=-1)  # [Hq, n]
        probs = torch.exp(logits - seg_lse[..., None])
        out[start:end] = torch.einsum("hnk,khd->nhd", probs, values.float()).to(query.dtype)
        lse[start:end] = seg_lse.transpose(0, 1)
        if scores is not None and int(score_starts[seg]) >= 0:
            scored = probs[:, int(score_starts[seg]) :]  # [Hq, n_scored, ctx]
            per_kv_head = scored.reshape(num_kv_heads, group * scored.shape[1], -1).mean(dim=1)
            scores[seg, :, : contexts[seg]] = per_kv_head
    return out, lse, scores


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode attention of single-token draft queries over an index view plus the provisional tail.

    Query `i` attends, for each KV head `h`, to the committed positions `index_view[i, h, :view_lens[i]]` and to
    every position in `[tail_starts[i], positions[i]]` (the draft tokens of the current block, whose K/V are
    provisional). K/V are read through the block table; nothing is copied into the cache.

    Args:
        query: `[N, Hq, D]`, one query per draft segment.
        key_pool, value_pool: `[num_pages, page_size, Hkv, D]`.
        block_tables: `[N, max_pages]` int32.
        index_view: `[N, Hkv, K_max]` int32 sorted positions (entries past `view_lens[i]` are ignored).
        view_lens: `[N]` valid entries of each row of `index_view`.
        tail_starts: `[N]` first provisional position (the committed length).
        positions: `[N]` absolute position of each query.
        scale: softmax scale.

    Returns:
        `out` `[N, Hq, D]` and `lse` `[N, Hq]`.
    """
    num_queries, num_heads, _ = query.shape
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    lse = torch.empty(num_queries, num_heads, dtype=torch.float32, device=query.device)
    for i in range(num_queries):
        tail = torch.arange(int(tail_starts[i]), int(positions[i]) + 1, device=query.device)
        for kv_head in range(num_kv_heads):
            view = index_view[i, kv_head, : int(view_lens[i])].long()
            key_positions = torch.cat([view, tail])
            keys = gather_positions(key_pool, block_tables[i], key_positions)[:, kv_head].float()
            values = gather_positions(value_pool, block_tables[i], key_positions)[:, kv_head].float()
            heads = slice(kv_head * group, (kv_head + 1) * group)
            logits = query[i, heads].float() @ keys.T * scale  # [group, L]
            head_lse = torch.logsumexp(logits, dim=-1)
            out[i, heads] = (torch.exp(logits - head_lse[:, None]) @ values).to(query.dtype)
            lse[i, heads] = head_lse
    return out, lse


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
