"""CUDA graphs for decode steps: which steps qualify (everywhere) and exactness on CUDA (GPU only)."""

from __future__ import annotations

import gc
import itertools
from types import SimpleNamespace

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.cuda_graphs import BUCKETS, DecodeGraphs, garbage_collection_paused
from s3r_hf.draft_policy import ScriptedDraftLength
from s3r_hf.step_plan import DenseSegments, SparseQueries, StepPlan
from tests.conftest import left_padded_batch, tiny_model


def _dense(length: int, scored: bool) -> DenseSegments:
    return DenseSegments(
        query_index=None, cu_seqlens=torch.arange(3), positions=torch.zeros(2), block_tables=torch.zeros(2, 1),
        score_starts=torch.zeros(2) if scored else None, history_lens=torch.zeros(2), num_candidates=0,
        max_query_len=length, max_context=8,
    )


def test_which_steps_are_graphed():
    sparse = SparseQueries(query_index=None, slots=torch.zeros(2), block_tables=torch.zeros(2, 1),
                           tail_starts=torch.zeros(2), positions=torch.zeros(2), view_width=4, max_keys=6)
    plan = lambda **parts: StepPlan(write_index=torch.zeros(2), position_ids=torch.zeros(1, 2), **parts)  # noqa: E731
    assert DecodeGraphs.kind(plan(sparse=sparse)) == "sparse"
    assert DecodeGraphs.kind(plan(dense=_dense(1, scored=False))) == "dense"
    assert DecodeGraphs.kind(plan(dense=_dense(7, scored=True)), draft_len=6) == "verify"
    assert DecodeGraphs.kind(plan(dense=_dense(8, scored=True)), draft_len=6) is None  # longer than a block
    # Verify blocks of rounds that keep their index views (`refresh_interval` > 1) are not scored.
    assert DecodeGraphs.kind(plan(dense=_dense(7, scored=False)), draft_len=6) == "block"
    assert DecodeGraphs.kind(plan(dense=_dense(8, scored=False)), draft_len=6) is None
    assert DecodeGraphs.kind(plan(dense=_dense(1, scored=False), sparse=sparse)) is None  # mixed steps: eager


def test_buckets_captured_in_a_call_and_replayed_by_later_calls():
    """Within a call a step replays a captured bucket up to `REUSE_FACTOR` times its own and captures a smaller one
    beyond; a later call (graphs kept) replays a larger captured bucket of up to `REPLAY_LARGER_TOKENS` tokens, so a
    tail reaching fewer rows than the first call's captures no graph, unless the padding would cost compute on
    every step of it (a wide verify graph)."""
    graphs = DecodeGraphs(SimpleNamespace(page_size=4), forward=None, max_pages=8, draft_len=6, max_candidates=16)
    graphs.steps[graphs._key("dense", 32, 0)] = None  # captured at 32 rows
    assert graphs._key("dense", 20, 0)[1] == 32
    assert graphs._key("dense", 8, 0)[1] == 32  # 32 <= 4 x 8
    assert graphs._key("dense", 3, 0)[1] == 4  # 32 > 4 x 4: a smaller bucket is captured
    assert graphs._key("dense", 40, 0)[1] == 48  # nothing captured holds 40 rows
    # Other kinds and widths are other graphs; a tail's verify block is captured at the widest bucket within
    # REPLAY_LARGER_TOKENS (32 x 7 = 224 tokens), so that every smaller tail replays it.
    assert graphs._key("verify", 3, 0, width=7)[1] == 32
    assert graphs._key("verify", 40, 0, width=7)[1] == 48  # 48 x 7 tokens: the bucket its rows need
    assert graphs._key("verify", 3, 0, width=1)[1] == 4  # a refresh step: the bucket its rows need
    graphs.steps[graphs._key("verify", 32, 0, width=7)] = None  # 224 tokens
    graphs.steps[graphs._key("block", 64, 0, width=7)] = None  # 448 tokens
    graphs.steps[graphs._key("draft", 256, 0, width=6)] = None  # six passes of 256 rows
    assert graphs._key("verify", 3, 0, width=7)[1] == 32
    graphs.replay_larger = True
    assert graphs._key("dense", 3, 0)[1] == 32
    assert graphs._key("dense", 1, 0)[1] == 32
    assert graphs._key("dense", 40, 0)[1] == 48
    assert graphs._key("verify", 3, 0, width=7)[1] == 32  # 224 <= REPLAY_LARGER_TOKENS
    assert graphs._key("block", 3, 0, width=7)[1] == 32  # 448 tokens on every tail step: capture 224
    assert graphs._key("block", 20, 0, width=7)[1] == 64  # within REUSE_FACTOR, as in any call
    assert graphs._key("draft", 3, 0, width=6)[1] == 256


def test_a_wide_verify_graph_names_its_tails_graph_to_capture_ahead_from_padding_rows():
    """A block graph wider than `REPLAY_LARGER_TOKENS` names the tail's graph of its width (captured ahead), which
    `_fill_padding` sets up with every token slot in the padding segment: K/V to the scratch page, nothing scored."""
    assert DecodeGraphs.tail_key(("verify", 48, 0, 7, None)) == ("verify", 32, 0, 7, None)
    assert DecodeGraphs.tail_key(("block", 256, 5, 3, None)) == ("block", 64, 5, 3, None)
    assert DecodeGraphs.tail_key(("verify", 32, 0, 7, None)) is None  # it is the tail's graph
    assert DecodeGraphs.tail_key(("verify", 24, 0, 7, None)) is None
    assert DecodeGraphs.tail_key(("verify", 256, 0, 1, None)) is None  # a refresh step: no tail graph
    assert DecodeGraphs.tail_key(("dense", 256, 0, 1, None)) is None
    assert DecodeGraphs.tail_key(("draft", 256, 0, 6, ("signature", ()))) is None
    cache = SimpleNamespace(page_size=4, device=torch.device("cpu"), scratch_page=3, padding_slot=0)
    graphs = DecodeGraphs(cache, forward=None, max_pages=8, draft_len=6, max_candidates=16)
    step = graphs._static_step("verify", 32, 7)
    for buffer in (step.input_ids, step.plan.position_ids, step.plan.dense.positions, step.plan.dense.block_tables,
                   step.plan.dense.history_lens, step.plan.dense.score_starts):
        buffer.fill_(5)
    graphs._fill_padding("verify", step)
    dense = step.plan.dense
    assert dense.cu_seqlens.tolist() == [0] + [32 * 7] * 33  # no real segment, one padding segment of all tokens
    assert step.plan.write_index.eq(3 * 4).all() and dense.score_starts.eq(-1).all()
    for buffer in (step.input_ids, step.plan.position_ids, dense.positions, dense.block_tables, dense.history_lens):
        assert buffer.eq(0).all()
    assert dense.live_segments.tolist() == [32]


def test_the_graphs_captured_ahead_leave_no_request_count_of_a_later_call_to_capture():
    """With a wide block graph and the graphs `keys_ahead` names for it captured, a later call (`replay_larger`)
    replays a captured graph at every request count up to the wide one's, whatever the block width: under a verify
    graph of 256 requests of 7 tokens, 33-48 requests are a bucket of their own (a graph of 256 serves no fewer than
    49 within `REUSE_FACTOR`, the tail's graph of 32 no more than 32)."""
    assert DecodeGraphs.keys_ahead(("verify", 256, 0, 7, None)) == [("verify", 32, 0, 7, None),
                                                                    ("verify", 48, 0, 7, None)]
    assert DecodeGraphs.keys_ahead(("block", 64, 3, 7, None)) == [("block", 32, 3, 7, None)]
    assert DecodeGraphs.keys_ahead(("verify", 32, 0, 7, None)) == []
    assert DecodeGraphs.keys_ahead(("dense", 256, 0, 1, None)) == []
    graphs = DecodeGraphs(SimpleNamespace(page_size=4), forward=None, max_pages=8, draft_len=6, max_candidates=16)
    graphs.replay_larger = True
    for kind, width, bucket in itertools.product(("verify", "block"), range(2, 8), BUCKETS):
        key = (kind, bucket, 0, width, None)
        graphs.steps = dict.fromkeys([key, *DecodeGraphs.keys_ahead(key)])
        for rows in range(1, bucket + 1):
            assert graphs._key(kind, rows, 0, width) in graphs.steps, (key, rows)


def test_a_verify_graph_names_its_unscored_twin_where_a_call_may_skip_refreshes():
    graphs = DecodeGraphs(SimpleNamespace(page_size=4), forward=None, max_pages=8, draft_len=6, max_candidates=16)
    assert graphs.ahead_of(("verify", 32, 0, 7, None)) == []
    graphs.unscored_blocks = True
    assert graphs.ahead_of(("verify", 32, 0, 7, None)) == [("block", 32, 0, 7, None)]
    assert graphs.ahead_of(("verify", 256, 0, 7, None)) == [
        ("verify", 32, 0, 7, None), ("verify", 48, 0, 7, None),
        ("block", 256, 0, 7, None), ("block", 32, 0, 7, None), ("block", 48, 0, 7, None),
    ]
    assert graphs.ahead_of(("verify", 64, 0, 1, None)) == []  # a one-query refresh step has no unscored block
    assert graphs.ahead_of(("block", 32, 0, 7, None)) == []
    assert graphs.ahead_of(("dense", 32, 0, 1, None)) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("refresh_interval", [None, 1])
def test_a_call_that_may_skip_refreshes_captures_the_unscored_block_graph_with_the_verify_graph(refresh_interval):
    """A first call refreshes every round, so it verifies with scores only; where the config lets rounds skip a
    refresh (the adaptive rule's own interval), the unscored graph of the same rows is captured with the verify
    graph, and a later call that skips refreshes captures nothing and decodes as dense decoding does. With
    `refresh_interval=1` no round ever skips one, and no unscored graph is captured."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=41).cuda())
    config = S3RConfig(draft_len=6, budget_ratio=0.1, min_budget=2, page_size=4, cuda_graphs=True,
                       refresh_interval=refresh_interval)
    input_ids, attention_mask = (t.cuda() for t in left_padded_batch([12, 7, 15, 9], seed=42))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30, eos_token_id=None)

    def captures(refreshes: list[bool]) -> tuple[list[str], torch.Tensor]:
        out = model.generate(input_ids, s3r_config=config, s3r_draft_policy=ScriptedDraftLength([6], refreshes),
                             return_dict_in_generate=True, **kwargs)
        return [graph.split(" (")[0] for graph in out.s3r_stats.captured_graphs], out.sequences

    first, _ = captures([True])
    assert any(graph.startswith("verify") for graph in first)
    if refresh_interval == 1:
        assert not any(graph.startswith("block") for graph in first)
    else:
        assert first.index("verify 32x7") + 1 == first.index("block 32x7")
        later, sequences = captures([True, False, False])
        assert later == []
        assert torch.equal(sequences, model.generate(input_ids, **kwargs))
    s3r_hf.release(model)


def test_a_block_graph_replay_tells_the_attention_how_many_requests_are_real():
    """A verify graph replayed for fewer requests than it holds (a tail's widened verify graph, a larger bucket) sizes
    its key splits for the real ones, through `DenseSegments.live_segments`, which each fill sets; a dense-step
    graph keeps its bucket's split count."""
    cache = SimpleNamespace(page_size=4, device=torch.device("cpu"), scratch_page=0, padding_slot=0)
    graphs = DecodeGraphs(cache, forward=None, max_pages=8, draft_len=6, max_candidates=16)
    verify = graphs._static_step("verify", 32, 7)
    dense = graphs._static_step("dense", 16, 1)
    for rows in (3, 5):
        lens = torch.full((rows,), 7)
        tokens = 7 * rows
        plan = StepPlan(write_index=torch.arange(tokens), position_ids=torch.arange(tokens)[None])
        plan.dense = DenseSegments(
            query_index=None, cu_seqlens=torch.cat([torch.zeros(1), lens.cumsum(0)]).int(),
            positions=torch.arange(tokens).int(), block_tables=torch.ones(rows, 8, dtype=torch.int32),
            score_starts=torch.zeros(rows, dtype=torch.int32), history_lens=torch.zeros(rows, dtype=torch.long),
            num_candidates=16, max_query_len=7, max_context=32,
        )
        graphs._fill("verify", verify, torch.zeros(tokens, dtype=torch.long), plan, tokens)
        assert verify.plan.dense.live_segments.tolist() == [rows]
        one = StepPlan(write_index=torch.arange(rows), position_ids=torch.arange(rows)[None])
        one.dense = DenseSegments(
            query_index=None, cu_seqlens=torch.arange(rows + 1).int(), positions=torch.arange(rows).int(),
            block_tables=torch.ones(rows, 8, dtype=torch.int32), score_starts=None,
            history_lens=torch.zeros(rows, dtype=torch.long), num_candidates=0, max_query_len=1, max_context=32,
        )
        graphs._fill("dense", dense, torch.zeros(rows, dtype=torch.long), one, rows)
        assert dense.plan.dense.live_segments is None


def test_a_block_graph_tells_the_attention_the_fewest_requests_it_replays_with():
    """A block graph within `REPLAY_LARGER_TOKENS` may replay for any smaller tail; a wider one never replays for
    its tail graph's rows (captured with it) or for rows whose own bucket is more than `REUSE_FACTOR` times smaller:
    its attention sizes the grid's key splits for the fewest it serves (`split_grid`)."""
    cache = SimpleNamespace(page_size=4, device=torch.device("cpu"), scratch_page=0, padding_slot=0)
    graphs = DecodeGraphs(cache, forward=None, max_pages=8, draft_len=6, max_candidates=16)
    fewest = {bucket: graphs._static_step("verify", bucket, 7).plan.dense.min_live_segments
              for bucket in (8, 32, 48, 64, 256)}
    assert fewest == {8: 1, 32: 1, 48: 33, 64: 33, 256: 49}  # the tail graph holds 32 rows of 7 tokens
    assert graphs._static_step("block", 128, 3).plan.dense.min_live_segments == 65  # tail: 64 rows of 3
    for rows in (33, 40, 64):  # every count the fewest admits replays the 64-request graph, not a smaller one
        graphs.steps = {("verify", 32, 0, 7, None): None, ("verify", 64, 0, 7, None): None}
        assert graphs._key("verify", rows, 0, 7)[1] == 64
    assert graphs._key("verify", 32, 0, 7)[1] == 32


def test_garbage_collection_is_paused_inside_the_block_and_restored_after():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), garbage_collection_paused():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with garbage_collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "a collector the caller had turned off stays off"
    finally:
        gc.enable()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_greedy_with_cuda_graphs_matches_dense_on_cuda():
    model = s3r_hf.enable(tiny_model("qwen3", seed=31).cuda())
    input_ids, attention_mask = (t.cuda() for t in left_padded_batch([9, 30, 17, 41, 5], seed=32))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, cuda_graphs=True)
    out = model.generate(input_ids, s3r_config=config, **kwargs)
    assert torch.equal(out, dense)
    assert out.s3r_stats.drafted > out.s3r_stats.accepted
    # Drafts, verify blocks and AR steps all replay graphs; the index views they refresh keep results exact.
    sampled = model.generate(input_ids, s3r_config=config, **{**kwargs, "do_sample": True, "top_k": 1})
    assert torch.equal(sampled, dense)
    ar = model.generate(input_ids, s3r_config=config, s3r_mode="ar", **kwargs)
    assert torch.equal(ar, dense)
    # Rounds between index-view refreshes replay unscored verify graphs (kind "block") and extend the views.
    extended = model.generate(input_ids, s3r_config=S3RConfig(**{**config.to_dict(), "refresh_interval": 2}),
                              **kwargs)
    assert torch.equal(extended, dense)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_later_calls_drafting_at_fewer_rows_share_one_tail_verify_graph():
    """A first call verifies 40 requests' blocks of 7 tokens (a graph of 48 requests, 336 tokens: too wide to replay
    for a few rows), and captures ahead, from padding rows, the verify graph of 32 requests, the widest within
    `REPLAY_LARGER_TOKENS`. Later calls that draft at 2 and 8 rows replay it and capture nothing, and a greedy call
    at 5 rows that replays it equals dense decoding. The acceptance of the others is forced to 1 so that every row
    of a call finishes in the same round (no call reaches fewer rows than it starts with). In a fresh runtime, after a
    call at 200 rows (a graph of 256, with those of 32 and 48 captured ahead), a call at 40 rows captures nothing."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=33).cuda())
    config = S3RConfig(adaptive=False, draft_len=6, budget_ratio=0.1, min_budget=2, page_size=4, cuda_graphs=True)

    def captures(rows: int, seed: int) -> list[str]:
        input_ids, attention_mask = (t.cuda() for t in left_padded_batch([12] * rows, seed=seed))
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=15,
                             eos_token_id=None, s3r_config=config, s3r_forced_acceptance=1.0,
                             return_dict_in_generate=True)
        return [graph.split(" (")[0] for graph in out.s3r_stats.captured_graphs]

    first = captures(40, seed=34)
    assert first.index("verify 48x7") + 1 == first.index("verify 32x7")  # captured ahead, right after the wide one
    assert captures(2, seed=35) == []
    assert captures(8, seed=36) == []
    # Under a verify graph of 256 requests, 33-48 requests need a graph of their own, captured ahead with it.
    s3r_hf.release(model)  # a fresh runtime: no graph of 32 or 48 requests kept
    widest = captures(200, seed=38)
    assert widest.index("verify 256x7") + 1 == widest.index("verify 32x7") == widest.index("verify 48x7") - 1
    assert captures(40, seed=39) == []
    input_ids, attention_mask = (t.cuda() for t in left_padded_batch([12, 7, 15, 9, 11], seed=37))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30, eos_token_id=None)
    out = model.generate(input_ids, s3r_config=config, return_dict_in_generate=True, **kwargs)
    assert not any(graph.startswith("verify") for graph in out.s3r_stats.captured_graphs)
    assert out.s3r_stats.drafted > 0
    assert torch.equal(out.sequences, model.generate(input_ids, **kwargs))
    s3r_hf.release(model)
