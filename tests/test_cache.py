"""Unit tests of the paged KV cache: allocation, writes/reads, rollback, index views, capacity, offload."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config

from s3r_hf.cache import KVCapacityError, PageAllocator, S3RCache, SparseIndexViews
from s3r_hf.cache.s3r_cache import take_plain_handoff
from s3r_hf.config import S3RConfig
from s3r_hf.kernels.reference import gather_positions, paged_sparse_attention, select_topk_candidates
from s3r_hf.step_plan import StepPlan

NUM_LAYERS, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 2, 2, 4, 8


def small_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
    )


def make_cache(num_pages: int = 32, page_size: int = 4, max_requests: int = 4) -> S3RCache:
    return S3RCache(small_config(), num_pages=num_pages, page_size=page_size, max_requests=max_requests)


class Reference:
    """What each slot's K/V should be, per layer: `[length, Hkv, D]` tensors kept outside the cache."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def new(self, slot: int, count: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Fresh random K/V of `count` tokens per layer, appended to the slot's expected contents."""
        shape = (count, NUM_KV_HEADS, HEAD_DIM)
        keys = [torch.randn(shape, generator=self.generator) for _ in range(NUM_LAYERS)]
        values = [torch.randn(shape, generator=self.generator) for _ in range(NUM_LAYERS)]
        old_k = self.keys.get(slot, [torch.zeros(0, NUM_KV_HEADS, HEAD_DIM)] * NUM_LAYERS)
        old_v = self.values.get(slot, [torch.zeros(0, NUM_KV_HEADS, HEAD_DIM)] * NUM_LAYERS)
        self.keys[slot] = [torch.cat([o, n]) for o, n in zip(old_k, keys)]
        self.values[slot] = [torch.cat([o, n]) for o, n in zip(old_v, values)]
        return keys, values

    def truncate(self, slot: int, length: int) -> None:
        self.keys[slot] = [k[:length] for k in self.keys[slot]]
        self.values[slot] = [v[:length] for v in self.values[slot]]


def plan_write(cache: S3RCache, ref: Reference, chunks: list[tuple[int, int]], commit: bool = True) -> None:
    """One packed engine-style forward writing `count` new tokens for each `(slot, count)` of `chunks`.

    `commit=False` leaves the lengths alone, as a draft pass does with its provisional K/V.
    """
    write, positions, keys, values = [], [], [[] for _ in range(NUM_LAYERS)], [[] for _ in range(NUM_LAYERS)]
    for slot, count in chunks:
        start = cache.lengths[slot]
        cache.reserve(slot, start + count)
        write += cache.flat_indices(slot, range(start, start + count))
        positions += list(range(start, start + count))
        new_k, new_v = ref.new(slot, count)
        for layer in range(NUM_LAYERS):
            keys[layer].append(new_k[layer])
            values[layer].append(new_v[layer])
    cache.step = StepPlan(
        write_index=torch.tensor(write, dtype=torch.long), position_ids=torch.tensor([positions])
    )
    try:
        for layer in range(NUM_LAYERS):
            k = torch.cat(keys[layer]).transpose(0, 1)[None]  # [1, Hkv, N, D]
            v = torch.cat(values[layer]).transpose(0, 1)[None]
            out_k, out_v = cache.update(k, v, layer)
            assert out_k is k and out_v is v  # plan mode returns its inputs; attention reads the pools
    finally:
        cache.step = None
    for slot, count in chunks:
        if commit:
            cache.set_length(slot, cache.lengths[slot] + count)


def read_back(cache: S3RCache, slot: int, layer: int, positions: torch.Tensor | None = None):
    if positions is None:
        positions = torch.arange(cache.lengths[slot])
    table = torch.tensor(cache.page_lists[slot], dtype=torch.int32)
    pools = cache.layers[layer]
    return gather_positions(pools.keys, table, positions), gather_positions(pools.values, table, positions)


def assert_slot_matches(cache: S3RCache, ref: Reference, slot: int) -> None:
    assert cache.lengths[slot] == ref.keys[slot][0].shape[0]
    for layer in range(NUM_LAYERS):
        keys, values = read_back(cache, slot, layer)
        assert torch.equal(keys, ref.keys[slot][layer])
        assert torch.equal(values, ref.values[slot][layer])


def interleaved_cache(page_size: int = 4) -> tuple[S3RCache, Reference, int, int]:
    """Two requests written in alternating chunks, so each spans several non-contiguous pages."""
    cache, ref = make_cache(num_pages=48, page_size=page_size), Reference()
    a, b = cache.add_request(), cache.add_request()
    plan_write(cache, ref, [(a, 5)])
    plan_write(cache, ref, [(b, 3), (a, 6)])
    plan_write(cache, ref, [(a, 1), (b, 9)])
    plan_write(cache, ref, [(b, 1)])
    plan_write(cache, ref, [(a, 7), (b, 4)])
    return cache, ref, a, b


def is_contiguous_run(pages: list[int]) -> bool:
    return pages == list(range(pages[0], pages[0] + len(pages)))


# ==================================================================== allocator
def test_allocator_hands_out_and_reuses_pages():
    allocator = PageAllocator(6)
    assert (allocator.num_free, allocator.num_used) == (6, 0)
    first = allocator.allocate(2)
    second = allocator.allocate(3)
    assert first == [0, 1] and second == [2, 3, 4]
    assert (allocator.num_free, allocator.num_used) == (1, 5)
    allocator.free(first)
    assert allocator.num_free == 3
    again = allocator.allocate(3)
    assert sorted(again) == [0, 1, 5]
    assert allocator.allocate(0) == []
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)


# ==================================================================== writes and reads
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_plan_mode_writes_round_trip_through_pages(page_size):
    cache, ref, a, b = interleaved_cache(page_size)
    assert cache.lengths == {a: 19, b: 17}
    assert len(cache.page_lists[a]) == math.ceil(19 / page_size) > 1
    assert len(cache.page_lists[b]) == math.ceil(17 / page_size) > 1
    assert not set(cache.page_lists[a]) & set(cache.page_lists[b])
    if page_size < 19:
        assert not is_contiguous_run(cache.page_lists[a])
        assert not is_contiguous_run(cache.page_lists[b])
    assert_slot_matches(cache, ref, a)
    assert_slot_matches(cache, ref, b)
    # block_tables rows are the page lists, zero-padded.
    tables = cache.block_tables([b, a])
    assert tables.dtype == torch.int32
    for row, slot in enumerate([b, a]):
        pages = cache.page_lists[slot]
        assert tables[row, : len(pages)].tolist() == pages
        assert not tables[row, len(pages) :].any()
    # flat_indices address the same rows as the block table.
    flat = cache.layers[1].keys.view(-1, NUM_KV_HEADS, HEAD_DIM)
    rows = torch.tensor(cache.flat_indices(b, range(17)))
    assert torch.equal(flat[rows], ref.keys[b][1])


def test_plain_mode_appends_like_dynamic_cache():
    cache, generator = make_cache(page_size=4), torch.Generator().manual_seed(1)
    batch = 2
    all_k = [torch.zeros(batch, NUM_KV_HEADS, 0, HEAD_DIM) for _ in range(NUM_LAYERS)]
    all_v = [torch.zeros(batch, NUM_KV_HEADS, 0, HEAD_DIM) for _ in range(NUM_LAYERS)]
    for new in [7, 1, 1, 5, 1]:
        for layer in range(NUM_LAYERS):
            k = torch.randn(batch, NUM_KV_HEADS, new, HEAD_DIM, generator=generator)
            v = torch.randn(batch, NUM_KV_HEADS, new, HEAD_DIM, generator=generator)
            all_k[layer] = torch.cat([all_k[layer], k], dim=2)
            all_v[layer] = torch.cat([all_v[layer], v], dim=2)
            out_k, out_v = cache.update(k, v, layer)
            assert take_plain_handoff(layer) is cache
            assert take_plain_handoff(layer) is None  # consumed
            assert torch.equal(out_k, all_k[layer]) and torch.equal(out_v, all_v[layer])
    assert cache.get_seq_length() == 15 and cache.batch_size == batch
    assert cache.lengths == {0: 15, 1: 15}
    assert len(cache.page_lists[0]) == len(cache.page_lists[1]) == 4
    # Rows were extended step by step, so their pages interleave.
    assert not is_contiguous_run(cache.page_lists[0])
    for row in range(batch):
        for layer in range(NUM_LAYERS):
            keys, values = read_back(cache, row, layer)
            assert torch.equal(keys, all_k[layer][row].transpose(0, 1))
            assert torch.equal(values, all_v[layer][row].transpose(0, 1))


# ==================================================================== rollback
def test_budgets_of_a_tensor_agree_with_budget():
    """The device-side budgets that size the next round's index views before the host reads the new lengths."""
    contexts = torch.arange(0, 5000)
    for ratio, minimum in [(0.05, 192), (0.1, 12), (0.3, 1), (1 / 3, 7), (1.0, 4)]:
        config = S3RConfig(budget_ratio=ratio, min_budget=minimum)
        assert config.budgets(contexts).tolist() == [config.budget(c) for c in contexts.tolist()]


def test_flat_rows_give_one_position_of_each_slot_as_flat_indices_do():
    cache, _, a, b = interleaved_cache(page_size=4)
    expected = cache.flat_indices(a, range(7, 8)) + cache.flat_indices(b, range(13, 14))
    assert cache.flat_rows([a, b], [7, 13]) == expected
    assert cache.flat_rows([b, a], [0, 0]) == [cache.page_lists[b][0] * 4, cache.page_lists[a][0] * 4]


def test_set_length_can_keep_reserved_pages_and_offload_moves_only_valid_ones():
    cache, ref, a, b = interleaved_cache(page_size=4)
    pages_a = list(cache.page_lists[a])  # 19 tokens in 5 pages
    free_before = cache.allocator.num_free
    cache.set_length(a, 6, release_pages=False)
    assert cache.page_lists[a] == pages_a and cache.allocator.num_free == free_before
    ref.truncate(a, 6)
    assert_slot_matches(cache, ref, a)
    saved = cache.offload(a)
    assert saved.num_pages == 2 and saved.length == 6
    assert cache.page_lists[a] == [] and cache.allocator.num_free == free_before + 5
    cache.restore(a, saved)
    assert_slot_matches(cache, ref, a)
    assert_slot_matches(cache, ref, b)


def test_set_length_rollback_frees_pages_and_keeps_prefix():
    cache, ref, a, b = interleaved_cache(page_size=4)
    free_before = cache.allocator.num_free
    pages_a = list(cache.page_lists[a])
    assert len(pages_a) == 5  # 19 tokens
    cache.set_length(a, 6)  # keeps ceil(6/4) = 2 pages
    assert cache.page_lists[a] == pages_a[:2]
    assert cache.allocator.num_free == free_before + 3
    ref.truncate(a, 6)
    assert_slot_matches(cache, ref, a)
    assert_slot_matches(cache, ref, b)
    # Shrinking inside the last page frees nothing.
    cache.set_length(a, 5)
    assert cache.page_lists[a] == pages_a[:2] and cache.allocator.num_free == free_before + 3
    ref.truncate(a, 5)
    # Growing again reuses freed pages; data before the cut is still intact and new writes land after it.
    plan_write(cache, ref, [(a, 8)])
    assert_slot_matches(cache, ref, a)
    assert_slot_matches(cache, ref, b)
    # Rolling back to zero frees every page of the slot; the slot stays open.
    cache.set_length(a, 0)
    assert cache.page_lists[a] == [] and cache.lengths[a] == 0
    with pytest.raises(ValueError, match="exceeds"):
        cache.set_length(a, 1)


def test_crop_in_plain_mode():
    cache, generator = make_cache(page_size=4), torch.Generator().manual_seed(2)
    k = torch.randn(2, NUM_KV_HEADS, 10, HEAD_DIM, generator=generator)
    for layer in range(NUM_LAYERS):
        cache.update(k, k + 1, layer)
    used = cache.allocator.num_used
    assert used == 2 * 3
    cache.crop(-3)  # 10 -> 7 tokens: 2 pages per row
    assert cache.get_seq_length() == 7 and cache.lengths == {0: 7, 1: 7}
    assert cache.allocator.num_used == 2 * 2
    cache.crop(9)  # keeping more than there is changes nothing
    assert cache.get_seq_length() == 7
    cache.crop(0)  # transformers' `crop(-n)` with n == 0 (all candidates accepted) removes nothing
    assert cache.get_seq_length() == 7 and cache.allocator.num_used == 2 * 2
    new = torch.randn(2, NUM_KV_HEADS, 2, HEAD_DIM, generator=generator)
    for layer in range(NUM_LAYERS):
        out_k, out_v = cache.update(new, new + 1, layer)
        expected = torch.cat([k[:, :, :7], new], dim=2)
        assert torch.equal(out_k, expected) and torch.equal(out_v, expected + 1)
    cache.crop(4)
    assert cache.get_seq_length() == 4 and cache.allocator.num_used == 2
    for row in range(2):
        keys, values = read_back(cache, row, 1)
        assert torch.equal(keys, k[row, :, :4].transpose(0, 1))
        assert torch.equal(values, k[row, :, :4].transpose(0, 1) + 1)


def test_release_frees_everything():
    cache, _, a, b = interleaved_cache()
    cache.release(a)
    assert a not in cache.page_lists and a not in cache.lengths
    cache.release(b)
    assert cache.allocator.num_free == cache.num_pages and cache.utilization == 0.0
    # Released slots can be opened again.
    assert {cache.add_request(), cache.add_request()} == {a, b}
    cache.reset()
    assert cache.lengths == {} and cache.allocator.num_free == cache.num_pages


# ==================================================================== index views
def expected_view(candidates: list[int], history: int, context: int, budget: int) -> list[int]:
    recent = list(range(history, context))[-budget:] if budget else []
    top = [c for c in candidates if c >= 0][: budget - len(recent)]
    return sorted(recent + top)


def check_view(positions: torch.Tensor, length: int, candidates: torch.Tensor, history: int, context: int,
               budget: int) -> None:
    """`positions` `[Hkv, width]` of one slot against `R ∪ TopK` built from `candidates` `[Hkv, C]`."""
    assert positions.dtype == torch.int32 and length == budget
    for head in range(positions.shape[0]):
        row = positions[head, :length].tolist()
        assert row == sorted(row) and len(set(row)) == length
        assert all(0 <= p < context for p in row)
        expected = expected_view(candidates[head].tolist(), history, context, budget)
        assert row == expected
        recent = set(range(history, context))
        if len(recent) <= budget:
            assert recent <= set(row)
            top = [c for c in candidates[head].tolist() if c >= 0][: budget - len(recent)]
            assert set(top) <= set(row)


@pytest.mark.parametrize(
    "contexts, recent_lens",
    [
        ([300, 40, 9], [7, 5, 3]),  # ratio budget, min budget, whole context
        ([60, 200], [20, 1]),  # recent window wider than the min budget
    ],
)
def test_index_views_recent_window_plus_top_candidates(contexts, recent_lens):
    config = S3RConfig(budget_ratio=0.1, min_budget=12)
    views = SparseIndexViews(NUM_LAYERS, NUM_KV_HEADS, max_requests=5, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    slots = torch.tensor([4, 0, 2][: len(contexts)])
    context_lens = torch.tensor(contexts)
    history_lens = context_lens - torch.tensor(recent_lens)
    budgets = torch.tensor([config.budget(c) for c in contexts])
    assert budgets.tolist() == [
        min(c, max(config.min_budget, math.ceil(config.budget_ratio * c))) for c in contexts
    ]
    num_candidates = int(budgets.max())
    per_layer = []
    for layer in range(NUM_LAYERS):
        scores = torch.rand(len(contexts), NUM_KV_HEADS, max(contexts), generator=generator)
        candidates = select_topk_candidates(scores, history_lens, num_candidates)
        per_layer.append(candidates)
        views.build(layer, slots, candidates, history_lens, context_lens, budgets)
    for layer in range(NUM_LAYERS):
        positions, lengths = views.view(layer, slots)
        assert positions.dtype == torch.int32 and lengths.dtype == torch.int32
        assert lengths.tolist() == budgets.tolist()
        assert positions.shape == (len(contexts), NUM_KV_HEADS, int(budgets.max()))
        for row in range(len(contexts)):
            check_view(positions[row], int(lengths[row]), per_layer[layer][row], int(history_lens[row]),
                       contexts[row], int(budgets[row]))
        # Heads pick different positions (random scores), all within one budget.
        if recent_lens[0] < budgets[0] < contexts[0]:
            assert not torch.equal(positions[0, 0], positions[0, 1])
    # A view of a subset of slots, in another order.
    positions, lengths = views.view(1, slots.flip(0))
    assert lengths.tolist() == budgets.flip(0).tolist()


def test_index_view_capacity_growth_keeps_other_views():
    views = SparseIndexViews(NUM_LAYERS, NUM_KV_HEADS, max_requests=2, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)

    def build(slot: int, context: int, budget: int) -> list[torch.Tensor]:
        history = torch.tensor([context - 4])
        candidates = []
        for layer in range(NUM_LAYERS):
            scores = torch.rand(1, NUM_KV_HEADS, context, generator=generator)
            candidates.append(select_topk_candidates(scores, history, budget))
            views.build(layer, torch.tensor([slot]), candidates[-1], history, torch.tensor([context]),
                        torch.tensor([budget]))
        return candidates

    small = build(0, 50, 10)
    capacity = views.capacity
    large = build(1, 400, 150)  # wider than the first allocation: the storage grows
    assert views.capacity > capacity
    for layer in range(NUM_LAYERS):
        for slot, context, budget, candidates in [(0, 50, 10, small), (1, 400, 150, large)]:
            positions, lengths = views.view(layer, torch.tensor([slot]))
            check_view(positions[0], int(lengths[0]), candidates[layer][0], context - 4, context, budget)


def test_index_views_too_few_candidates_is_an_error():
    views = SparseIndexViews(1, 1, max_requests=1, device=torch.device("cpu"))
    candidates = torch.tensor([[[3, -1, -1]]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="fewer candidate"):
        views.build(0, torch.tensor([0]), candidates, torch.tensor([10]), torch.tensor([12]),
                    torch.tensor([5]))


def test_set_full_views_cover_the_context():
    views = SparseIndexViews(NUM_LAYERS, NUM_KV_HEADS, max_requests=3, device=torch.device("cpu"))
    views.set_full(torch.tensor([1, 2]), torch.tensor([5, 9]))
    for layer in range(NUM_LAYERS):
        positions, lengths = views.view(layer, torch.tensor([2, 1]))
        assert lengths.tolist() == [9, 5]
        assert positions[0, :, :9].tolist() == [list(range(9))] * NUM_KV_HEADS
        assert positions[1, :, :5].tolist() == [list(range(5))] * NUM_KV_HEADS


def test_cache_index_views_read_kv_in_place():
    """Views are positions into the pools: building and reading them never moves or copies K/V."""
    cache, ref, a, b = interleaved_cache(page_size=4)
    slots = [b, a]
    # Provisional draft K/V beyond the committed length (the block's tail), as a draft pass writes them.
    committed = {s: cache.lengths[s] for s in slots}
    plan_write(cache, ref, [(a, 2), (b, 3)], commit=False)
    assert cache.lengths == committed
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    contents = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    config = S3RConfig(budget_ratio=0.2, min_budget=6)
    generator = torch.Generator().manual_seed(4)
    slot_t = torch.tensor(slots)
    context_lens = torch.tensor([committed[s] for s in slots])
    history_lens = context_lens - 2
    budgets = torch.tensor([config.budget(c) for c in context_lens.tolist()])
    per_layer = []
    for layer in range(NUM_LAYERS):
        scores = torch.rand(len(slots), NUM_KV_HEADS, int(context_lens.max()), generator=generator)
        per_layer.append(select_topk_candidates(scores, history_lens, int(budgets.max())))
        cache.index_views.build(layer, slot_t, per_layer[-1], history_lens, context_lens, budgets)

    tails = {a: 2, b: 3}
    draft_step = 1  # query at committed + 1: the view plus tail positions [committed, committed + 1]
    positions = context_lens + draft_step
    block_tables = cache.block_tables(slots)
    scale = HEAD_DIM**-0.5
    for layer in range(NUM_LAYERS):
        view, view_lens = cache.index_views.view(layer, slot_t)
        assert view.dtype == torch.int32 and view_lens.tolist() == budgets.tolist()
        for row in range(len(slots)):
            check_view(view[row], int(view_lens[row]), per_layer[layer][row], int(history_lens[row]),
                       int(context_lens[row]), int(budgets[row]))
        query = torch.randn(len(slots), NUM_HEADS, HEAD_DIM, generator=generator)
        pools = cache.layers[layer]
        out, lse = paged_sparse_attention(query, pools.keys, pools.values, block_tables, view, view_lens,
                                          context_lens, positions, scale)
        group = NUM_HEADS // NUM_KV_HEADS
        for row, slot in enumerate(slots):
            assert tails[slot] > draft_step
            for head in range(NUM_HEADS):
                kv_head = head // group
                picked = view[row, kv_head, : int(view_lens[row])].long()
                assert bool((picked < committed[slot]).all())
                keys_at = torch.cat([picked, torch.arange(committed[slot], int(positions[row]) + 1)])
                k = ref.keys[slot][layer][keys_at, kv_head]
                v = ref.values[slot][layer][keys_at, kv_head]
                logits = k @ query[row, head] * scale
                expected = torch.softmax(logits, dim=-1) @ v
                torch.testing.assert_close(out[row, head], expected, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse[row, head], torch.logsumexp(logits, dim=-1),
                                           atol=1e-5, rtol=1e-5)

    for layer, (key_ptr, value_ptr), (keys, values) in zip(cache.layers, pointers, contents):
        assert layer.keys.data_ptr() == key_ptr and layer.values.data_ptr() == value_ptr
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


# ==================================================================== capacity
def test_allocator_exhaustion_raises_and_takes_nothing():
    allocator = PageAllocator(4)
    allocator.allocate(1)
    with pytest.raises(KVCapacityError, match=r"out of pages: 4 more page\(s\) needed, 3 free of 4"):
        allocator.allocate(4)
    assert allocator.num_free == 3
    assert allocator.allocate(3) == [1, 2, 3]
    assert isinstance(KVCapacityError("x"), RuntimeError)


def test_reserve_beyond_capacity_raises_and_takes_nothing():
    cache = make_cache(num_pages=5, page_size=4)
    a, b = cache.add_request(), cache.add_request()
    cache.reserve(a, 9)  # 3 pages
    with pytest.raises(KVCapacityError, match="3 more page.*2 free of 5"):
        cache.reserve(b, 12)
    assert cache.page_lists[b] == [] and cache.allocator.num_free == 2
    with pytest.raises(KVCapacityError, match="out of pages"):
        cache.reserve(a, 9 + 4 * 3)  # grows by 3 pages
    assert len(cache.page_lists[a]) == 3 and cache.allocator.num_free == 2
    cache.reserve(b, 8)
    assert cache.allocator.num_free == 0


def test_plain_mode_overflow_raises():
    cache = make_cache(num_pages=2, page_size=4)
    k = torch.zeros(1, NUM_KV_HEADS, 9, HEAD_DIM)
    with pytest.raises(KVCapacityError, match="out of pages"):
        cache.update(k, k, 0)
    assert cache.allocator.num_free == 2


def test_add_request_beyond_max_requests_raises():
    cache = make_cache(max_requests=2)
    cache.add_request()
    cache.add_request()
    with pytest.raises(KVCapacityError, match=r"no free request slot \(max_requests=2\)"):
        cache.add_request()


# ==================================================================== offload / restore
def test_offload_and_restore_bring_back_identical_kv():
    cache, ref, a, b = interleaved_cache(page_size=4)
    pages_a = list(cache.page_lists[a])
    free_before = cache.allocator.num_free
    saved = cache.offload(a)
    assert saved.length == 19 and saved.num_pages == len(pages_a) == 5
    assert cache.page_lists[a] == [] and cache.lengths[a] == 0
    assert cache.allocator.num_free == free_before + 5
    assert saved.kv.device.type == "cpu" and saved.kv.shape[:3] == (2, cache.num_layers, 5)
    # Another request takes (some of) the freed pages and overwrites them.
    plan_write(cache, ref, [(b, 9)])
    assert set(cache.page_lists[b]) & set(pages_a)
    assert_slot_matches(cache, ref, b)
    # Not enough room to restore: nothing taken, slot unchanged.
    hog = cache.add_request()
    cache.reserve(hog, cache.page_size * (cache.allocator.num_free - 2))
    free_now = cache.allocator.num_free
    with pytest.raises(KVCapacityError):
        cache.restore(a, saved)
    assert cache.allocator.num_free == free_now and cache.page_lists[a] == []
    cache.release(hog)
    cache.restore(a, saved)
    assert cache.page_lists[a] != pages_a and len(cache.page_lists[a]) == 5
    assert len(cache.page_lists[b]) == 7  # 26 tokens
    assert cache.allocator.num_free == free_before - 2 == cache.num_pages - 5 - 7
    assert_slot_matches(cache, ref, a)
    assert_slot_matches(cache, ref, b)
    # The restored request keeps going.
    plan_write(cache, ref, [(a, 3), (b, 1)])
    assert_slot_matches(cache, ref, a)
    assert_slot_matches(cache, ref, b)


def test_offload_of_empty_request():
    cache = make_cache()
    slot = cache.add_request()
    saved = cache.offload(slot)
    assert saved.num_pages == 0 and saved.length == 0
    cache.restore(slot, saved)
    assert cache.page_lists[slot] == [] and cache.lengths[slot] == 0


def test_block_tables_follow_every_page_list_change():
    # The host mirror behind `block_tables` must agree with the page lists after reserves, rollbacks, offload,
    # restore and release, in any order, including growth past the mirror's initial width.
    cache = make_cache(num_pages=400, page_size=2, max_requests=4)
    generator = torch.Generator().manual_seed(0)
    slots = [cache.add_request() for _ in range(3)]
    saved = {}
    for _ in range(600):
        slot = slots[int(torch.randint(0, 3, (1,), generator=generator))]
        action = int(torch.randint(0, 10, (1,), generator=generator))
        if slot in saved:
            if cache.allocator.num_free >= saved[slot].num_pages:
                cache.restore(slot, saved.pop(slot))
            continue
        if action < 7:
            length = cache.lengths[slot] + int(torch.randint(1, 12, (1,), generator=generator))
            if cache.allocator.num_free >= cache.pages_for(length) - len(cache.page_lists[slot]):
                cache.reserve(slot, length)
                cache.set_length(slot, length)
        elif action < 9:  # roll back a few tokens (sometimes across a page boundary)
            cache.set_length(slot, max(0, cache.lengths[slot] - int(torch.randint(0, 5, (1,), generator=generator))))
        else:
            saved[slot] = cache.offload(slot)
        live = [s for s in slots if s not in saved]
        tables = cache.block_tables(live)
        for row, s in enumerate(live):
            pages = cache.page_lists[s]
            assert tables[row, : len(pages)].tolist() == pages
            assert not tables[row, len(pages) :].any()
    assert max(len(p) for p in cache.page_lists.values()) > 64  # grew past the initial mirror width
    cache.release(slots[0])
    assert cache.add_request() == slots[0] and not cache.block_tables([slots[0]]).any()
