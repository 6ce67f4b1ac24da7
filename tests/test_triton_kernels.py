"""Triton kernels against the torch reference (CPU through TRITON_INTERPRET=1; CUDA when present)."""

from __future__ import annotations

import pytest
import torch

from s3r_hf.kernels import get_backend, reference

triton_backend = pytest.importorskip("s3r_hf.kernels.triton_backend", reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=2e-5, rtol=2e-5)


def paged_pools(num_pages, page_size, num_kv_heads, head_dim, generator):
    key_pool = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=generator)
    value_pool = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=generator)
    return key_pool.to(DEVICE), value_pool.to(DEVICE)


def block_tables_for(contexts, page_size, num_pages, generator):
    """Shuffled, non-contiguous pages per request."""
    per = [-(-c // page_size) for c in contexts]
    order = torch.randperm(num_pages, generator=generator)
    table = torch.zeros(len(contexts), max(per), dtype=torch.int32)
    used = 0
    for row, count in enumerate(per):
        table[row, :count] = order[used : used + count].int()
        used += count
    return table.to(DEVICE)


def dense_inputs(seg_lens, contexts, page_size, group, generator, spare_pages=1, num_kv_heads=2, head_dim=16):
    """Packed queries over paged K/V, segment `i` holding `seg_lens[i]` queries that end at position `contexts[i]`:
    `(query, key_pool, value_pool, block_tables, cu_seqlens, positions)`, `paged_dense_attention`'s first arguments."""
    num_pages = sum(-(-c // page_size) for c in contexts) + spare_pages
    key_pool, value_pool = paged_pools(num_pages, page_size, num_kv_heads, head_dim, generator)
    tables = block_tables_for(contexts, page_size, num_pages, generator)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(contexts, seg_lens)]).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor(seg_lens).cumsum(0).tolist()], device=DEVICE)
    query = torch.randn(sum(seg_lens), num_kv_heads * group, head_dim, generator=generator).to(DEVICE)
    return query, key_pool, value_pool, tables, cu, positions


@pytest.fixture(params=[None, 3], ids=["auto-splits", "3-splits"])
def key_splits(request, monkeypatch):
    """Also run every kernel with its keys split over 3 programs (flash-decoding path) at these small sizes."""
    if request.param is not None:
        monkeypatch.setattr(
            triton_backend, "_num_splits", lambda programs, keys, min_keys, **_: min(request.param, keys)
        )
    return request.param


@pytest.fixture(params=["stored", "recomputed"])
def score_source(request, monkeypatch):
    """Verify scores from logits the attention kernel stores (in a NaN-filled scratch, so a read of an entry it did
    not write shows), or recomputed from K by the score kernel; `stores_logits` picks one by shape in real runs."""
    stored = request.param == "stored"
    monkeypatch.setattr(triton_backend, "stores_logits", lambda rows, head_dim, size: stored)
    monkeypatch.setattr(
        triton_backend, "_score_scratch",
        lambda shape, device: torch.full(shape, float("nan"), dtype=torch.float32, device=device),
    )
    return request.param


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.usefixtures("score_source")
def test_dense_attention_matches_reference(page_size, group, scored, key_splits):
    generator = torch.Generator().manual_seed(page_size * 10 + group)
    # The third segment is a whole prompt (prefill from position 0).
    inputs = dense_inputs([7, 1, 12, 3], [19, 33, 12, 40], page_size, group, generator, spare_pages=2)
    starts = torch.tensor([0, 0, 9, -1], device=DEVICE) if scored else None
    expected = reference.paged_dense_attention(*inputs, 0.3, starts)
    actual = triton_backend.paged_dense_attention(*inputs, 0.3, starts)
    torch.testing.assert_close(actual[0], expected[0], **TOL)
    torch.testing.assert_close(actual[1], expected[1], **TOL)
    if scored:
        torch.testing.assert_close(actual[2], expected[2], **TOL)
    else:
        assert actual[2] is None


@pytest.fixture
def partial_lse(monkeypatch):
    """The per-split LSEs `[splits, queries, heads]` of every split launch, as `merge_splits` receives them."""
    seen = []
    merge = triton_backend.merge_splits
    monkeypatch.setattr(triton_backend, "merge_splits", lambda out, lse, dtype, *live: seen.append(lse) or merge(
        out, lse, dtype, *live))
    return seen


@pytest.mark.parametrize("scored", [False, True])
@pytest.mark.usefixtures("score_source")
def test_every_key_split_reads_a_share_of_its_own_segments_keys(scored, partial_lse):
    """A CUDA graph sizes the grid for its longest context; at shorter contexts each segment's keys are still shared
    out among all of the splits, rather than leaving the later splits without work."""
    generator = torch.Generator().manual_seed(3)
    # Contexts long enough for four splits of whole K tiles (128 keys of these 16-wide float32 heads) each.
    inputs = dense_inputs([1, 7, 7], [1200, 1000, 800], 4, 3, generator)
    starts = torch.tensor([0, 0, 3], device=DEVICE) if scored else None
    actual = triton_backend.paged_dense_attention(*inputs, 0.3, starts, max_query_len=7, max_context=8192,
                                                  num_splits=4)
    expected = reference.paged_dense_attention(*inputs, 0.3, starts)
    torch.testing.assert_close(actual[0], expected[0], **TOL)
    torch.testing.assert_close(actual[1], expected[1], **TOL)
    if scored:  # scores as wide as the grid's context: nothing past the longest segment's
        width = expected[2].shape[-1]
        torch.testing.assert_close(actual[2][..., :width], expected[2], **TOL)
        assert not actual[2][..., width:].any()
    assert torch.isfinite(partial_lse[0]).all()  # [splits, queries, heads]: every split saw keys of every query

    # The sparse kernel likewise, over views far shorter than the graph's `max_keys`.
    query, key_pool, value_pool, tables = (inputs[0][:3], *inputs[1:4])
    lens = torch.tensor([60, 40, 70], device=DEVICE)
    view = torch.stack([torch.randperm(80, generator=generator)[:70].sort().values for _ in range(6)]).view(3, 2, 70)
    tails = torch.tensor([80, 80, 80], device=DEVICE)
    args = (query, key_pool, value_pool, tables, view.int().to(DEVICE), lens, tails, tails + 5, 0.3)
    partial_lse.clear()
    actual = triton_backend.paged_sparse_attention(*args, max_keys=1024, num_splits=4)
    expected = reference.paged_sparse_attention(*args)
    torch.testing.assert_close(actual[0], expected[0], **TOL)
    torch.testing.assert_close(actual[1], expected[1], **TOL)
    assert torch.isfinite(partial_lse[0]).all()


@pytest.mark.usefixtures("score_source")
def test_key_splits_sized_on_the_device_for_the_live_segments(partial_lse):
    """`live_segments`: a graph's grid with padding segments holds the splits one segment would use, and each real
    segment uses as many as a grid of the live segments would choose; the unused ones store lse -inf only. Every
    scored key's logit is still stored (`score_source`: a NaN-filled scratch shows one that is not)."""
    generator = torch.Generator().manual_seed(4)
    # Two verify blocks and 38 empty padding segments, as a tail's verify graph replays them.
    inputs = dense_inputs([7, 7] + [0] * 38, [2000, 1800] + [7] * 38, 4, 3, generator)
    starts = torch.tensor([0, 0] + [-1] * 38, device=DEVICE)
    expected = reference.paged_dense_attention(*inputs, 0.3, starts)
    for live, num_splits in ((None, None), (2, None), (40, None), (2, 3)):
        live_segments = None if live is None else torch.tensor([live], dtype=torch.int32, device=DEVICE)
        actual = triton_backend.paged_dense_attention(*inputs, 0.3, starts, max_query_len=7, max_context=2048,
                                                      live_segments=live_segments, num_splits=num_splits)
        torch.testing.assert_close(actual[0], expected[0], **TOL)
        torch.testing.assert_close(actual[1], expected[1], **TOL)
        torch.testing.assert_close(actual[2][..., :2000], expected[2], **TOL)
    # 40 segments x 2 KV heads: 80 programs, 528 / 80 -> 4 splits. With `live_segments` the grid holds 8 (the most
    # for 2,048 keys of 256 each); 2 live segments (4 programs) use all 8, 40 live segments 4 of them. A fixed
    # `num_splits` (3, not a power of two) is used whole.
    assert [lse.shape[0] for lse in partial_lse] == [4, 8, 8, 3]
    used = [torch.isfinite(lse).all(dim=(1, 2)).tolist() for lse in partial_lse[1:]]
    assert used == [[True] * 8, [True] * 4 + [False] * 4, [True] * 3]
    assert torch.isneginf(partial_lse[2][4:]).all()
    # A graph that never replays with fewer than 5 live segments (10 programs: 8 splits wanted, at most four times
    # the full grid's 4) still counts them; one that never replays with fewer than 40 has a fixed count of 4.
    partial_lse.clear()
    for live, fewest in ((5, 5), (40, 40)):
        live_segments = torch.tensor([live], dtype=torch.int32, device=DEVICE)
        actual = triton_backend.paged_dense_attention(*inputs, 0.3, starts, max_query_len=7, max_context=2048,
                                                      live_segments=live_segments, min_live_segments=fewest)
        torch.testing.assert_close(actual[0], expected[0], **TOL)
        torch.testing.assert_close(actual[1], expected[1], **TOL)
        torch.testing.assert_close(actual[2][..., :2000], expected[2], **TOL)
    assert [lse.shape[0] for lse in partial_lse] == [8, 4]


def test_a_graph_counts_live_segments_only_where_its_fewest_would_split_further():
    """`split_grid`: the grid of a CUDA graph that replays with fewer segments holds the splits its fewest would use
    (at most four times its own), and counts the live ones on the device; where the fewest use no more than the
    full grid, the count is fixed (counting costs the kernel registers and launches programs that only exit)."""
    stored, target = triton_backend._TARGET_PROGRAMS_STORING_LOGITS, triton_backend._TARGET_PROGRAMS
    # Qwen3-1.7B's verify storing logits (8 KV heads), a 64-request graph plus its padding segment, 8K keys: one
    # split for 33-64 requests (its tail graph takes 32 and fewer), up to four for one request.
    assert triton_backend.split_grid(65, 8, 8192, stored) == (1, False)
    assert triton_backend.split_grid(65, 8, 8192, stored, live_floor=33) == (1, False)
    assert triton_backend.split_grid(65, 8, 8192, stored, live_floor=1) == (4, True)
    # SmolLM2's unscored verify (3 KV heads): two splits for 64 requests, four for 33.
    assert triton_backend.split_grid(65, 3, 4096, target) == (2, False)
    assert triton_backend.split_grid(65, 3, 4096, target, live_floor=33) == (4, True)
    # Few keys: no split however few the segments.
    assert triton_backend.split_grid(33, 3, 200, target, live_floor=1) == (1, False)


@pytest.mark.parametrize("tiling", [
    {"ROWS": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"ROWS": 128, "BLOCK_N": 16, "num_warps": 8, "num_stages": 3},
])
@pytest.mark.parametrize("group", [2, 3])
def test_prefill_tilings_match_reference(tiling, group, monkeypatch):
    """Segments of `PREFILL_QUERIES` queries or more take `PREFILL_TILING` (here from 8 queries on): whole prompts
    and later chunks, one scored."""
    monkeypatch.setattr(triton_backend, "PREFILL_QUERIES", 8)
    monkeypatch.setattr(triton_backend, "PREFILL_TILING", tiling)
    generator = torch.Generator().manual_seed(group)
    inputs = dense_inputs([45, 20], [45, 52], 4, group, generator)
    args = (*inputs, 0.3, torch.tensor([38, -1], device=DEVICE))
    for actual, expected in zip(triton_backend.paged_dense_attention(*args), reference.paged_dense_attention(*args)):
        torch.testing.assert_close(actual, expected, **TOL)


@pytest.mark.usefixtures("score_source")
def test_scores_of_more_rows_than_one_score_tile():
    """A prefill chunk may score many queries: 40 queries x 2 heads = 80 scored rows, over one 64-row tile."""
    generator = torch.Generator().manual_seed(5)
    inputs = dense_inputs([40, 5], [52, 30], 4, 2, generator)
    args = (*inputs, 0.3, torch.tensor([0, 2], device=DEVICE))
    expected = reference.paged_dense_attention(*args)[2]
    torch.testing.assert_close(triton_backend.paged_dense_attention(*args)[2], expected, **TOL)


@pytest.mark.usefixtures("score_source")
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_scores_written_into_one_layer_of_every_layers_scores(backend):
    """`scores_out`: a layer's part of one `[layers, S, Hkv, context]` tensor, filled with what a new tensor would
    hold and nothing around it touched; one of another shape is an error that names it."""
    generator = torch.Generator().manual_seed(6)
    inputs = dense_inputs([7, 1, 3], [19, 33, 40], 4, 2, generator)
    args = (*inputs, 0.3, torch.tensor([0, 0, -1], device=DEVICE))
    attention = (reference if backend == "reference" else triton_backend).paged_dense_attention
    expected = reference.paged_dense_attention(*args)[2]  # [3, 2, 40]
    layers = torch.full((3, *expected.shape), float("nan"), device=DEVICE)
    scores = attention(*args, max_query_len=7, max_context=40, scores_out=layers[1])[2]
    assert scores.data_ptr() == layers[1].data_ptr()
    torch.testing.assert_close(layers[1], expected, **TOL)
    assert layers[0].isnan().all() and layers[2].isnan().all()
    with pytest.raises(ValueError, match="scores_out must be float32 \\[3, 2, 40\\]"):
        attention(*args, max_query_len=7, max_context=40, scores_out=layers[1, :, :, :39])


def test_prompt_chunks_of_any_length_share_one_tiling_that_no_verify_block_takes():
    """Every segment longer than the longest verify block is tiled as a prefill chunk, so prompt batches of different
    lengths (GRPO steps) launch one compiled variant of the dense kernel, not one per length class."""
    from s3r_hf.config import MAX_DRAFT_LEN

    longest_verify_block = MAX_DRAFT_LEN + 1
    assert triton_backend.PREFILL_QUERIES == longest_verify_block + 1
    for element_size, stores in ((2, True), (4, True), (2, False)):
        tilings = {
            str(triton_backend.query_tiling(length, 3, 64, stores, element_size))
            for length in range(triton_backend.PREFILL_QUERIES, 1024, 7)
        }
        assert len(tilings) == 1
        decode_shaped = triton_backend.query_tiling(longest_verify_block, 3, 64, stores, element_size)
        assert str(decode_shaped) not in tilings


def test_sparse_kernel_splits_keys_in_float32_only_where_the_grid_is_small():
    # SmolLM2's views (3 KV heads, 64-wide heads, 192 keys and a tail of up to 7): one K tile per split in float32.
    assert [triton_backend.sparse_splits(rows, 3, 199, 64, 4) for rows in (16, 32, 64, 256)] == [4, 4, 2, 1]
    assert [triton_backend.sparse_splits(rows, 3, 199, 64, 2) for rows in (4, 16, 64)] == [1, 1, 1]


def test_key_splits_fill_the_gpu_in_powers_of_two():
    assert triton_backend._num_splits(192, 4096, 1024) == 2  # SmolLM2 at B=64: 528 / 192 rounds up to 3, then down
    assert triton_backend._num_splits(512, 8192, 1024) == 2  # Qwen3-1.7B at B=64
    assert triton_backend._num_splits(600, 8192, 1024) == 1  # enough programs already
    assert triton_backend._num_splits(48, 4096, 1024) == 4  # capped by a thousand keys per split
    assert triton_backend._num_splits(48, 3000, 1024) == 2
    assert triton_backend._num_splits(4, 100, 1024) == 1
    # A kernel that stores verify logits fills the GPU with fewer programs.
    stored = triton_backend._TARGET_PROGRAMS_STORING_LOGITS
    assert triton_backend._num_splits(17 * 8, 16384, 1024, target=stored) == 2  # Qwen3-1.7B, B=16 (+1 padding)
    assert triton_backend._num_splits(33 * 8, 16384, 1024, target=stored) == 1  # B=32


def test_few_programs_split_keys_down_to_a_few_hundred_per_split():
    """The engine's floor of keys per split: small grids (a rollout's tail, float32 at 16 rows) split further, while
    the grids the launch settings were tuned at keep their counts."""
    floor = triton_backend._MIN_KEYS_PER_SPLIT

    def splits(programs: int, keys: int) -> int:
        return triton_backend._num_splits(programs, keys, floor)

    assert splits(16 * 3, 3072) == 8  # SmolLM2, B=16: 2 with a floor of a thousand keys
    assert splits(4 * 3, 4096) == 16  # B=4
    assert splits(32 * 3, 1024) == 4  # B=32 at 1K: unsplit with a floor of a thousand keys
    assert splits(4, 200) == 1  # fewer keys than the floor: one split
    assert splits(64 * 3, 4096) == 2  # SmolLM2 at B=64, as before
    assert splits(16 * 8, 4096) == 4  # Qwen3-1.7B at B=16, as before
    assert splits(64 * 8, 8192) == 2  # Qwen3-1.7B at B=64, as before


def test_score_source_is_the_one_that_moves_fewer_bytes():
    assert not triton_backend.stores_logits(7 * 3, 64, 2)  # SmolLM2: 168 B stored and reread vs 128 B of K
    assert triton_backend.stores_logits(7 * 2, 128, 2)  # Qwen3-1.7B: 112 B vs 256 B


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_of_split_results_matches_reference(dtype):
    """Splits that saw no key (lse -inf) weigh nothing; a row no split saw comes out as zeros with lse -inf."""
    generator = torch.Generator().manual_seed(11)
    splits, num_queries, num_heads, head_dim = 3, 5, 6, 16
    partial = torch.randn(splits, num_queries, num_heads, head_dim, generator=generator)
    partial_lse = torch.randn(splits, num_queries, num_heads, generator=generator) * 4
    partial_lse[1, 0] = float("-inf")  # split 1 saw no key of query 0
    partial_lse[:, 2, 3] = float("-inf")  # no split saw a key of query 2, head 3
    partial[:, 2, 3] = 0.0  # what the kernels store for an empty split
    partial, partial_lse = partial.to(DEVICE), partial_lse.to(DEVICE)
    expected = reference.merge_splits(partial, partial_lse, dtype)
    # A split past the ones a CUDA graph's replay uses stores no result at all: whatever its buffer holds is not read.
    unwritten = partial.clone()
    unwritten[1, 0] = float("nan")
    actual = triton_backend.merge_splits(unwritten, partial_lse, dtype)
    assert actual[0].dtype == dtype
    torch.testing.assert_close(actual[0], expected[0], **(TOL if dtype == torch.float32 else {}))
    torch.testing.assert_close(actual[1], expected[1], **TOL)
    assert torch.all(actual[0][2, 3] == 0) and actual[1][2, 3] == float("-inf")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("view_width", [0, 5, 70])
def test_sparse_attention_matches_reference(page_size, group, view_width, key_splits):
    generator = torch.Generator().manual_seed(page_size + 7 * group + view_width)
    num_kv_heads, head_dim = 2, 16
    contexts = [90, 75, 80]  # committed lengths
    tails = [1, 3, 6]  # provisional draft positions written so far (the query is the last)
    num_pages = sum(-(-(c + t) // page_size) for c, t in zip(contexts, tails)) + 2
    key_pool, value_pool = paged_pools(num_pages, page_size, num_kv_heads, head_dim, generator)
    tables = block_tables_for([c + t for c, t in zip(contexts, tails)], page_size, num_pages, generator)
    lens = torch.tensor([min(view_width, c) for c in contexts])
    view = torch.zeros(len(contexts), num_kv_heads, max(view_width, 1), dtype=torch.int32)
    for row, context in enumerate(contexts):
        for head in range(num_kv_heads):
            picked = torch.randperm(context, generator=generator)[: int(lens[row])].sort().values
            view[row, head, : picked.numel()] = picked.int()
    # Entries past a view's length are garbage the kernel must not read.
    view[0, :, int(lens[0]) :] = 10**6 if view_width else 0
    tail_starts = torch.tensor(contexts)
    positions = tail_starts + torch.tensor(tails) - 1
    query = torch.randn(len(contexts), num_kv_heads * group, head_dim, generator=generator).to(DEVICE)
    args = (query, key_pool, value_pool, tables, view.to(DEVICE), lens.to(DEVICE), tail_starts.to(DEVICE),
            positions.to(DEVICE), 0.25)
    expected_view = view.clone()
    expected_view[0, :, int(lens[0]) :] = 0  # the reference masks entries past the length too
    expected = reference.paged_sparse_attention(*args[:4], expected_view.to(DEVICE), *args[5:])
    actual = triton_backend.paged_sparse_attention(*args)
    torch.testing.assert_close(actual[0], expected[0], **TOL)
    torch.testing.assert_close(actual[1], expected[1], **TOL)


def test_sparse_attention_under_a_launch_override_matches_reference(monkeypatch):
    """`SPARSE_LAUNCH_OVERRIDE` (how `tools/sparse_launch_ab.py` times other settings in the engine) changes how the
    kernel tiles its keys (here 16 a tile, where the chosen tile holds them all), not what it computes."""
    monkeypatch.setattr(triton_backend, "SPARSE_LAUNCH_OVERRIDE", {"BLOCK_N": 16, "num_warps": 2, "num_stages": 2})
    assert triton_backend.sparse_constants(2, 16, 4, torch.float32)["BLOCK_N"] == 16
    test_sparse_attention_matches_reference(page_size=4, group=2, view_width=70, key_splits=None)


@pytest.mark.parametrize("splits", [1, 3])
def test_kernels_take_a_transposed_half_precision_query(splits, monkeypatch):
    """The attention function hands the kernels a transposed view of the projection (no copy) and reads their
    result in the model's dtype: an unsplit kernel stores it directly, a split one after the float32 merge."""
    monkeypatch.setattr(triton_backend, "_num_splits", lambda programs, keys, min_keys, **_: min(splits, keys))
    generator = torch.Generator().manual_seed(splits)
    page_size, num_kv_heads, group, head_dim = 4, 2, 2, 16
    contexts = [21, 9, 30]
    num_pages = sum(-(-c // page_size) for c in contexts) + 1
    key_pool, value_pool = (pool.half() for pool in paged_pools(num_pages, page_size, num_kv_heads, head_dim,
                                                                 generator))
    tables = block_tables_for(contexts, page_size, num_pages, generator)
    positions = torch.tensor(contexts, device=DEVICE) - 1
    query = torch.randn(num_kv_heads * group, len(contexts), head_dim, generator=generator).half().to(DEVICE)
    query = query.transpose(0, 1)  # [N, H, D] with unit stride only in the last dimension
    assert not query.is_contiguous()
    cu = torch.arange(len(contexts) + 1, device=DEVICE)
    dense = (query, key_pool, value_pool, tables, cu, positions, 0.25)
    expected = reference.paged_dense_attention(query.float(), key_pool.float(), value_pool.float(), *dense[3:])[0]
    actual = triton_backend.paged_dense_attention(*dense)[0]
    assert actual.dtype == torch.float16
    torch.testing.assert_close(actual.float(), expected, atol=2e-3, rtol=2e-3)
    # A sparse view of every other position, read through the same transposed query.
    width = 5
    view = torch.stack([torch.arange(0, 2 * width, 2)] * num_kv_heads)[None].repeat(len(contexts), 1, 1)
    lens = torch.full((len(contexts),), width)
    sparse = (tables, view.int().to(DEVICE), lens.to(DEVICE), positions.int(), positions.int(), 0.25)
    expected = reference.paged_sparse_attention(query.float(), key_pool.float(), value_pool.float(), *sparse)[0]
    actual = triton_backend.paged_sparse_attention(query, key_pool, value_pool, *sparse)[0]
    assert actual.dtype == torch.float16
    torch.testing.assert_close(actual.float(), expected, atol=2e-3, rtol=2e-3)


def test_topk_matches_reference_without_ties():
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(3, 2, 50, generator=generator).to(DEVICE)
    history = torch.tensor([50, 20, 3], device=DEVICE)
    expected = reference.select_topk_candidates(scores, history, 8)
    actual = triton_backend.select_topk_candidates(scores, history, 8)
    assert torch.equal(actual, expected)


def test_backend_selection(monkeypatch):
    assert get_backend("cpu") is reference
    monkeypatch.setenv("S3R_HF_KERNELS", "triton")
    assert get_backend("cpu") is triton_backend
    monkeypatch.setenv("S3R_HF_KERNELS", "fast")
    with pytest.raises(ValueError, match="S3R_HF_KERNELS"):
        get_backend("cpu")


def test_greedy_generation_with_triton_kernels_matches_dense(monkeypatch):
    import s3r_hf
    from s3r_hf import S3RConfig
    from tests.conftest import left_padded_batch, tiny_model

    model = s3r_hf.enable(tiny_model("qwen3", seed=21).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 23, 15], seed=22))
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    monkeypatch.setenv("S3R_HF_KERNELS", "triton")
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.1, min_budget=2, page_size=4)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert out.s3r_stats.drafted > out.s3r_stats.accepted


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (2, 16), (1, 24)])
def test_write_kv_matches_reference(num_kv_heads, head_dim):
    """A step's K/V (transposed views of the projections, another dtype) land at the same pool rows as the
    reference's two `index_copy_`s put them; the other rows are untouched."""
    generator = torch.Generator().manual_seed(head_dim)
    key_pool, value_pool = paged_pools(6, 4, num_kv_heads, head_dim, generator)
    rows = torch.randperm(24, generator=generator)[:7].to(DEVICE)
    keys = torch.randn(1, num_kv_heads, 7, head_dim, generator=generator).double().to(DEVICE)[0].transpose(0, 1)
    values = torch.randn(1, num_kv_heads, 7, head_dim, generator=generator).double().to(DEVICE)[0].transpose(0, 1)
    expected_keys, expected_values = key_pool.clone(), value_pool.clone()
    reference.write_kv(expected_keys, expected_values, rows, keys, values)
    triton_backend.write_kv(key_pool, value_pool, rows, keys, values)
    assert torch.equal(key_pool, expected_keys)
    assert torch.equal(value_pool, expected_values)


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton builds kernel variants on a GPU only (interpreted, none)")
@pytest.mark.parametrize("stored", [False, True], ids=["recomputed", "stored"])
def test_new_batch_sizes_and_contexts_reuse_the_kernel_variants_built(stored, monkeypatch):
    """A rollout meets new batch sizes, contexts and block-table widths every step; none of them may make Triton
    build (compile, ~1 s) a new variant of a kernel that already ran the same kind of step."""
    monkeypatch.setattr(triton_backend, "stores_logits", lambda rows, head_dim, size: stored)
    generator = torch.Generator().manual_seed(3)
    num_kv_heads, group, head_dim, page_size, draft_len = 2, 3, 64, 16, 6

    def steps(num_requests: int, context: int) -> None:
        """A dense step, a scored verify block and a sparse draft pass of `num_requests` requests at `context`."""
        contexts = [context - row % 5 for row in range(num_requests)]
        num_pages = sum(-(-(c + draft_len) // page_size) for c in contexts) + 1
        key_pool, value_pool = paged_pools(num_pages, page_size, num_kv_heads, head_dim, generator)
        tables = block_tables_for([c + draft_len for c in contexts], page_size, num_pages, generator)
        for width, scored in ((1, False), (draft_len + 1, True)):
            positions = torch.cat([torch.arange(c, c + width) for c in contexts]).to(DEVICE)
            cu = torch.arange(0, num_requests * width + 1, width, device=DEVICE)
            query = torch.randn(num_requests * width, num_kv_heads * group, head_dim, generator=generator).to(DEVICE)
            starts = torch.zeros(num_requests, dtype=torch.long, device=DEVICE) if scored else None
            triton_backend.paged_dense_attention(query, key_pool, value_pool, tables, cu, positions, 0.1, starts)
        view_width = max(context // 20, 8)
        view = torch.randint(0, min(contexts), (num_requests, num_kv_heads, view_width), generator=generator)
        lens = torch.full((num_requests,), view_width)
        tails = torch.tensor(contexts)
        query = torch.randn(num_requests, num_kv_heads * group, head_dim, generator=generator).to(DEVICE)
        triton_backend.paged_sparse_attention(
            query, key_pool, value_pool, tables, view.int().to(DEVICE), lens.to(DEVICE), tails.to(DEVICE),
            (tails + 2).to(DEVICE), 0.1,
        )

    for num_requests, context in ((64, 4096), (1, 100)):  # split and unsplit keys
        steps(num_requests, context)
    built = triton_backend.compiled_variants()
    for num_requests, context in ((48, 3001), (17, 1000), (33, 517), (3, 77), (2, 250), (64, 8191)):
        steps(num_requests, context)
    assert triton_backend.compiled_variants() == built


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton builds kernel variants on a GPU only (interpreted, none)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("first", ["split", "unsplit"])
def test_a_logit_storing_verify_builds_the_other_split_choice_at_its_first_launch(first, dtype, monkeypatch):
    """Whether a verify that stores logits is split depends on its batch and contexts: a GRPO step that met the other
    choice for the first time built its dense-kernel variant (~1 s) mid-run. The first launch of such a kernel also
    builds the other choice's variant (bf16: its output's dtype differs too), and both outputs are the reference's."""
    monkeypatch.setattr(triton_backend, "stores_logits", lambda rows, head_dim, size: True)
    generator = torch.Generator().manual_seed(5)
    num_kv_heads, group, page_size, width = 2, 3, 16, 4
    # Head sizes no other test launches, so the variants are this test's own.
    head_dim = {("split", torch.float32): 40, ("unsplit", torch.float32): 48,
                ("split", torch.bfloat16): 56, ("unsplit", torch.bfloat16): 80}[first, dtype]
    tolerance = 2e-3 if dtype == torch.float32 else 3e-2

    def verify(num_requests: int, context: int) -> None:
        contexts = [context - row % 3 for row in range(num_requests)]
        num_pages = sum(-(-(c + width) // page_size) for c in contexts) + 1
        key_pool, value_pool = (pool.to(dtype) for pool in paged_pools(num_pages, page_size, num_kv_heads, head_dim,
                                                                       generator))
        tables = block_tables_for([c + width for c in contexts], page_size, num_pages, generator)
        positions = torch.cat([torch.arange(c, c + width) for c in contexts]).to(DEVICE)
        cu = torch.arange(0, num_requests * width + 1, width, device=DEVICE)
        query = torch.randn(num_requests * width, num_kv_heads * group, head_dim, generator=generator)
        starts = torch.zeros(num_requests, dtype=torch.long, device=DEVICE)
        args = (query.to(DEVICE, dtype), key_pool, value_pool, tables, cu, positions, 0.1, starts)
        out, lse, scores = triton_backend.paged_dense_attention(*args)
        expected = reference.paged_dense_attention(*args)
        torch.testing.assert_close(out, expected[0], atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(scores, expected[2], atol=tolerance, rtol=tolerance)

    def dense_variants() -> set:
        return triton_backend.variant_keys((triton_backend._dense_varlen_kernel,))

    shapes = [(32, 4096), (1, 100)]  # split keys (few programs, long contexts), then unsplit (one short row)
    if first == "unsplit":
        shapes.reverse()
    before = dense_variants()
    verify(*shapes[0])
    built = dense_variants()
    assert len(built - before) == 2  # the launched choice and the other
    verify(*shapes[1])
    assert dense_variants() == built
