"""Reference kernels against naive per-segment/query/head loops, and packed attention on a tiny model."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from s3r_hf.attention import s3r_attention
from s3r_hf.cache import S3RCache
from s3r_hf.kernels.reference import (
    gather_positions,
    paged_dense_attention,
    paged_sparse_attention,
    select_topk_candidates,
)
from s3r_hf.step_plan import DenseSegments, StepPlan

HEAD_DIM = 8
NUM_KV_HEADS = 2
TOL = dict(atol=1e-5, rtol=1e-5)


# ==================================================================== paged layout helpers
def random_paged_kv(contexts: list[int], page_size: int, num_kv_heads: int, generator: torch.Generator):
    """Random pools and shuffled (non-contiguous) pages per request: pools, block tables, page lists.

    Unused pool rows hold random values too, so reading outside a request's context would show.
    """
    pages_per = [-(-c // page_size) for c in contexts]
    num_pages = sum(pages_per) + 3
    key_pool = torch.randn(num_pages, page_size, num_kv_heads, HEAD_DIM, generator=generator)
    value_pool = torch.randn(num_pages, page_size, num_kv_heads, HEAD_DIM, generator=generator)
    order = torch.randperm(num_pages, generator=generator).tolist()
    block_tables = torch.zeros(len(contexts), max(max(pages_per), 1), dtype=torch.int32)
    tables = []
    for row, count in enumerate(pages_per):
        pages, order = order[:count], order[count:]
        block_tables[row, :count] = torch.tensor(pages, dtype=torch.int32)
        tables.append(pages)
    return key_pool, value_pool, block_tables, tables


def naive_rows(pool: torch.Tensor, pages: list[int], positions: list[int]) -> torch.Tensor:
    """`[len(positions), Hkv, D]` read position by position through a request's page list."""
    page_size = pool.shape[1]
    if not positions:
        return pool.new_zeros(0, pool.shape[2], pool.shape[3])
    return torch.stack([pool[pages[p // page_size], p % page_size] for p in positions])


# ==================================================================== naive implementations
def naive_dense(query, key_pool, value_pool, tables, seg_lens, positions, scale, score_starts):
    """Per segment, query and head: softmax over keys `0..position` of the request."""
    num_heads = query.shape[1]
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    lse = torch.zeros(query.shape[0], num_heads)
    contexts = []
    start = 0
    bounds = []
    for length in seg_lens:
        bounds.append((start, start + length))
        contexts.append(int(positions[start + length - 1]) + 1 if length else 0)
        start += length
    scores = torch.zeros(len(seg_lens), num_kv_heads, max(contexts))
    for seg, (begin, end) in enumerate(bounds):
        keys = naive_rows(key_pool, tables[seg], list(range(contexts[seg])))
        values = naive_rows(value_pool, tables[seg], list(range(contexts[seg])))
        first_scored = score_starts[seg] if score_starts is not None else -1
        num_scored = end - begin - first_scored if first_scored >= 0 else 0
        for i in range(begin, end):
            visible = int(positions[i]) + 1
            for head in range(num_heads):
                kv_head = head // group
                logits = keys[:visible, kv_head] @ query[i, head] * scale
                weights = torch.softmax(logits, dim=-1)
                out[i, head] = weights @ values[:visible, kv_head]
                lse[i, head] = torch.logsumexp(logits, dim=-1)
                if first_scored >= 0 and i - begin >= first_scored:
                    scores[seg, kv_head, :visible] += weights / (num_scored * group)
    return out, lse, scores


def naive_sparse(query, key_pool, value_pool, tables, index_view, view_lens, tail_starts, positions, scale):
    """Per query and head: softmax over the view's positions plus the provisional tail."""
    num_heads = query.shape[1]
    num_kv_heads = key_pool.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    lse = torch.zeros(query.shape[0], num_heads)
    for i in range(query.shape[0]):
        tail = list(range(int(tail_starts[i]), int(positions[i]) + 1))
        for head in range(num_heads):
            kv_head = head // group
            keys_at = index_view[i, kv_head, : int(view_lens[i])].tolist() + tail
            keys = naive_rows(key_pool, tables[i], keys_at)[:, kv_head]
            values = naive_rows(value_pool, tables[i], keys_at)[:, kv_head]
            logits = keys @ query[i, head] * scale
            out[i, head] = torch.softmax(logits, dim=-1) @ values
            lse[i, head] = torch.logsumexp(logits, dim=-1)
    return out, lse


def naive_topk(scores, history_lens, num_candidates):
    num_segments, num_kv_heads, length = scores.shape
    result = torch.full((num_segments, num_kv_heads, num_candidates), -1, dtype=torch.int32)
    for seg in range(num_segments):
        history = min(int(history_lens[seg]), length)
        for head in range(num_kv_heads):
            ranked = sorted(range(history), key=lambda p: (-float(scores[seg, head, p]), p))[:num_candidates]
            result[seg, head, : len(ranked)] = torch.tensor(ranked, dtype=torch.int32)
    return result


# ==================================================================== gather
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_gather_positions(page_size):
    generator = torch.Generator().manual_seed(0)
    key_pool, _, block_tables, tables = random_paged_kv([23, 5], page_size, NUM_KV_HEADS, generator)
    positions = torch.randint(0, 23, (11,), generator=generator)
    expected = naive_rows(key_pool, tables[0], positions.tolist())
    assert torch.equal(gather_positions(key_pool, block_tables[0], positions), expected)
    batched = torch.stack([positions, positions % 5])
    got = gather_positions(key_pool, block_tables, batched)
    assert torch.equal(got[0], expected)
    assert torch.equal(got[1], naive_rows(key_pool, tables[1], (positions % 5).tolist()))
    # One request's `[P]` table with positions of any shape.
    grid = positions[:10].view(2, 5)
    got_grid = gather_positions(key_pool, block_tables[0], grid)
    assert torch.equal(got_grid, expected[:10].view(2, 5, NUM_KV_HEADS, HEAD_DIM))


# ==================================================================== dense
# (segment lengths, context length of each segment, score_starts): prompts prefilled from 0 (one of a single
# token), a later prefill chunk, verify blocks, a single-token segment, unscored segments.
DENSE_LAYOUTS = [
    ([7, 1, 4, 1, 5, 12], [7, 19, 30, 1, 9, 26], [2, 0, -1, 0, -1, 5]),
    ([1], [1], [0]),
]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("layout", range(len(DENSE_LAYOUTS)))
def test_paged_dense_attention_matches_naive(page_size, group, layout):
    seg_lens, contexts, score_starts = DENSE_LAYOUTS[layout]
    generator = torch.Generator().manual_seed(100 * page_size + 10 * group + layout)
    num_heads = NUM_KV_HEADS * group
    key_pool, value_pool, block_tables, tables = random_paged_kv(contexts, page_size, NUM_KV_HEADS, generator)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(seg_lens, contexts)])
    cu_seqlens = torch.tensor([0] + torch.tensor(seg_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu_seqlens[-1]), num_heads, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5

    out, lse, scores = paged_dense_attention(
        query, key_pool, value_pool, block_tables, cu_seqlens, positions.to(torch.int32), scale,
        torch.tensor(score_starts, dtype=torch.int32),
    )
    want_out, want_lse, want_scores = naive_dense(
        query, key_pool, value_pool, tables, seg_lens, positions, scale, score_starts
    )
    assert out.shape == query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)
    assert scores.shape == (len(seg_lens), NUM_KV_HEADS, max(contexts))
    torch.testing.assert_close(scores, want_scores, **TOL)
    # Scores are a mean of distributions: each scored (segment, KV head) sums to 1, unscored ones are 0.
    sums = scores.sum(dim=-1)
    for seg, start in enumerate(score_starts):
        torch.testing.assert_close(sums[seg], torch.full((NUM_KV_HEADS,), 1.0 if start >= 0 else 0.0), **TOL)
        assert not scores[seg, :, contexts[seg] :].any()

    out_plain, lse_plain, no_scores = paged_dense_attention(
        query, key_pool, value_pool, block_tables, cu_seqlens, positions, scale
    )
    assert no_scores is None
    torch.testing.assert_close(out_plain, out, **TOL)
    torch.testing.assert_close(lse_plain, lse, **TOL)


# ==================================================================== sparse
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("view_lens", [[0, 3, 17], [1, 25, 6, 2, 9]])
def test_paged_sparse_attention_matches_naive(page_size, group, view_lens):
    generator = torch.Generator().manual_seed(7 * page_size + group + len(view_lens))
    num_queries = len(view_lens)
    num_heads = NUM_KV_HEADS * group
    committed = [max(v, 1) + int(torch.randint(0, 12, (1,), generator=generator)) for v in view_lens]
    # Draft index inside the block: the query sees the tail [committed, committed + step].
    steps = [int(torch.randint(0, 4, (1,), generator=generator)) for _ in view_lens]
    steps[0] = 0
    positions = torch.tensor([c + s for c, s in zip(committed, steps)])
    key_pool, value_pool, block_tables, tables = random_paged_kv(
        [int(p) + 1 for p in positions], page_size, NUM_KV_HEADS, generator
    )
    # Index views: sorted distinct committed positions per KV head; entries past view_lens are stale garbage.
    width = max(view_lens) + 2
    index_view = torch.full((num_queries, NUM_KV_HEADS, width), 10**6, dtype=torch.int32)
    for i, (length, context) in enumerate(zip(view_lens, committed)):
        for head in range(NUM_KV_HEADS):
            picked = torch.randperm(context, generator=generator)[:length].sort().values
            index_view[i, head, :length] = picked.to(torch.int32)
    view_lens_t = torch.tensor(view_lens, dtype=torch.int32)
    tail_starts = torch.tensor(committed, dtype=torch.int32)
    query = torch.randn(num_queries, num_heads, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5

    out, lse = paged_sparse_attention(
        query, key_pool, value_pool, block_tables, index_view, view_lens_t, tail_starts, positions, scale
    )
    want_out, want_lse = naive_sparse(
        query, key_pool, value_pool, tables, index_view, view_lens_t, tail_starts, positions, scale
    )
    assert out.shape == query.shape and lse.shape == (num_queries, num_heads)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(lse, want_lse, **TOL)


def test_sparse_attention_with_full_view_equals_dense_decode():
    """A view holding every committed position (and no tail beyond the query) is plain dense decoding."""
    generator = torch.Generator().manual_seed(11)
    contexts = [13, 6]
    key_pool, value_pool, block_tables, _ = random_paged_kv(contexts, 4, NUM_KV_HEADS, generator)
    query = torch.randn(2, 2 * NUM_KV_HEADS, HEAD_DIM, generator=generator)
    positions = torch.tensor([c - 1 for c in contexts])
    index_view = torch.zeros(2, NUM_KV_HEADS, 12, dtype=torch.int32)
    for i, c in enumerate(contexts):
        index_view[i, :, : c - 1] = torch.arange(c - 1, dtype=torch.int32)
    view_lens = torch.tensor([c - 1 for c in contexts])
    sparse_out, sparse_lse = paged_sparse_attention(
        query, key_pool, value_pool, block_tables, index_view, view_lens, positions, positions, 0.3
    )
    cu_seqlens = torch.tensor([0, 1, 2])
    dense_out, dense_lse, _ = paged_dense_attention(query, key_pool, value_pool, block_tables, cu_seqlens,
                                                    positions, 0.3)
    torch.testing.assert_close(sparse_out, dense_out, **TOL)
    torch.testing.assert_close(sparse_lse, dense_lse, **TOL)


# ==================================================================== top-K
@pytest.mark.parametrize(
    "history_lens, length, num_candidates",
    [
        ([10, 0, 3, 25], 25, 6),  # empty history, history shorter than K, the whole length
        ([40, 17], 40, 40),
        ([5, 9], 9, 12),  # more candidates asked than positions exist
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_select_topk_candidates_matches_naive(history_lens, length, num_candidates, ties):
    generator = torch.Generator().manual_seed(length + num_candidates + ties)
    scores = torch.rand(len(history_lens), NUM_KV_HEADS, length, generator=generator)
    if ties:
        scores = (scores * 4).floor() / 4  # few distinct values: ties resolved lower position first
    history = torch.tensor(history_lens)
    got = select_topk_candidates(scores, history, num_candidates)
    assert got.dtype == torch.int32 and got.shape == (len(history_lens), NUM_KV_HEADS, num_candidates)
    assert torch.equal(got, naive_topk(scores, history, num_candidates))
    for seg, hist in enumerate(history_lens):
        for head in range(NUM_KV_HEADS):
            row = got[seg, head].tolist()
            real = [p for p in row if p >= 0]
            assert row == real + [-1] * (num_candidates - len(real))  # -1 only as trailing padding
            assert len(real) == min(hist, num_candidates, length) and all(p < hist for p in real)
            picked = [float(scores[seg, head, p]) for p in real]
            assert picked == sorted(picked, reverse=True)


# ==================================================================== on a model
def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )
    return Qwen3ForCausalLM(config).eval()


def test_packed_prefill_of_two_prompts_matches_dense_forward():
    model = tiny_qwen3()
    implementation = model.config._attn_implementation
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=generator) for n in (7, 13)]
    cache = S3RCache(model.config, num_pages=16, page_size=4, max_requests=4)
    slots = [cache.add_request(), cache.add_request()]
    write, positions, cu = [], [], [0]
    for slot, prompt in zip(slots, prompts):
        cache.reserve(slot, len(prompt))
        write += cache.flat_indices(slot, range(len(prompt)))
        positions += list(range(len(prompt)))
        cu.append(len(positions))
    block = 3  # the last `block` queries of each prompt score it, as a final prefill chunk does
    dense = DenseSegments(
        query_index=torch.arange(len(positions)),
        cu_seqlens=torch.tensor(cu),
        positions=torch.tensor(positions),
        block_tables=cache.block_tables(slots),
        score_starts=torch.tensor([len(p) - block for p in prompts]),
        history_lens=torch.tensor([len(p) - block for p in prompts]),
        num_candidates=4,
        max_query_len=max(len(p) for p in prompts),
        max_context=max(len(p) for p in prompts),
    )
    plan = StepPlan(write_index=torch.tensor(write), position_ids=dense.positions[None], dense=dense)
    parameters = inspect.signature(model.forward).parameters
    cache_argument = "cache" if "cache" in parameters else "past_key_values"
    with torch.no_grad():
        with s3r_attention(model, packed=True):
            assert model.config._attn_implementation != implementation
            cache.step = plan
            try:
                packed = model(
                    input_ids=torch.cat(prompts)[None], position_ids=plan.position_ids, use_cache=True,
                    s3r_step=plan, s3r_cache=cache, **{cache_argument: cache},
                ).logits[0]
            finally:
                cache.step = None
        assert model.config._attn_implementation == implementation
        dense_outputs = [model(input_ids=p[None], use_cache=True) for p in prompts]
    assert plan.layers_seen == {0, 1}
    for slot, prompt, (begin, end), reference in zip(slots, prompts, zip(cu, cu[1:]), dense_outputs):
        torch.testing.assert_close(packed[begin:end], reference.logits[0], atol=1e-5, rtol=1e-5)
        # The K/V written through the pages are the dense forward's.
        cache.set_length(slot, len(prompt))
        dense_cache = reference.past_key_values
        for layer in range(2):
            table = torch.tensor(cache.page_lists[slot])
            keys = gather_positions(cache.layers[layer].keys, table, torch.arange(len(prompt)))
            expected = dense_cache.layers[layer].keys[0].transpose(0, 1)
            torch.testing.assert_close(keys, expected, atol=1e-5, rtol=1e-5)
    # Each layer leaves its verify scores in one tensor; the engine selects all layers' top-K after the forward.
    assert plan.scores.shape == (2, 2, 2, max(len(p) for p in prompts))
    for layer in range(2):
        candidates = select_topk_candidates(plan.scores[layer], dense.history_lens, dense.num_candidates)
        assert candidates.shape == (2, 2, 4)
        for seg, prompt in enumerate(prompts):
            assert bool((candidates[seg] < len(prompt) - block).all()) and bool((candidates[seg] >= 0).all())
