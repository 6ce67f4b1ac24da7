"""Prefill steps with long chunks attend through torch's SDPA chunk by chunk, the shorter chunks of the step through
the paged kernel in one launch, and the scores of the scored queries come from the paged kernel over those queries
alone (`attention._prefill_attention`). The results must be the paged kernel's over the whole step, for chunks that
start a prompt and chunks that continue one; greedy S3R must still equal dense decoding on this path."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.attention import _prefill_attention
from s3r_hf.engine import model_runner
from s3r_hf.engine.model_runner import prefill_parts, query_subset
from s3r_hf.kernels import get_backend, reference
from s3r_hf.step_plan import DenseSegments
from tests.conftest import left_padded_batch, tiny_model

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))


def _on(segments: DenseSegments, device: torch.device) -> DenseSegments:
    moved = {name: value.to(device) for name, value in vars(segments).items() if isinstance(value, torch.Tensor)}
    return dataclasses.replace(segments, **moved)


def test_a_prefill_step_splits_into_long_chunks_short_chunks_and_scored_queries():
    spans = [(0, 0, 10), (10, 4, 12), (18, 0, 5)]  # 10 queries, 8 queries (4 cached before), 5 queries
    long, short, scored = prefill_parts(spans, [7, -1, 2], min_queries=8)
    assert long == [(0, 0, 0, 10), (1, 10, 4, 12)]
    assert short == [(0, 0), (0, 0), (0, 5)]
    assert scored == [(7, 3), (0, 0), (2, 3)]
    assert query_subset(spans, scored) == ([7, 8, 9, 20, 21, 22], [0, 3, 3, 6], [7, 8, 9, 2, 3, 4])
    assert query_subset(spans, short) == ([18, 19, 20, 21, 22], [0, 0, 0, 5], [0, 1, 2, 3, 4])


def _subset(spans, picks, tables, history_lens, scored: bool) -> DenseSegments:
    rows, cu, positions = query_subset(spans, picks)
    counts = [count for _, count in picks]
    return DenseSegments(
        query_index=torch.tensor(rows), cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        positions=torch.tensor(positions, dtype=torch.int32), block_tables=tables,
        score_starts=torch.tensor([0 if c else -1 for c in counts], dtype=torch.int32) if scored else None,
        history_lens=history_lens, num_candidates=8, max_query_len=max(counts), max_context=56,
        max_scored_queries=7 if scored else 0,
    )


def test_prefill_attention_matches_the_paged_kernel_over_the_whole_step():
    generator = torch.Generator().manual_seed(0)
    page, kv_heads, heads, dim = 4, 2, 4, 16
    # Segment 0 starts a prompt (40 queries); segment 1 continues another after 24 cached tokens (32 queries); both
    # are long. Segment 2 continues a third after 10 cached tokens (6 queries): short, through the paged kernel.
    spans = [(0, 0, 40), (40, 24, 56), (72, 10, 16)]
    lengths = [end - start for _, start, end in spans]
    pages = [10, 14, 4]
    key_pool = torch.randn(sum(pages), page, kv_heads, dim, generator=generator)
    value_pool = torch.randn_like(key_pool)
    order = torch.randperm(sum(pages), generator=generator)
    tables = torch.zeros(3, max(pages), dtype=torch.int32)
    tables[0, :10], tables[1, :14], tables[2, :4] = order[:10], order[10:24], order[24:]
    positions = torch.cat([torch.arange(start, end) for _, start, end in spans])
    segment_of = torch.cat([torch.full((n,), s) for s, n in enumerate(lengths)])
    # The layer's own K/V of the step's tokens: what `S3RCache.update` wrote into the pools before attention.
    flat = tables[segment_of, positions // page].long() * page + positions % page
    key = key_pool.flatten(0, 1)[flat].transpose(0, 1).unsqueeze(0)  # [1, Hkv, N, D]
    value = value_pool.flatten(0, 1)[flat].transpose(0, 1).unsqueeze(0)
    query = torch.randn(1, heads, sum(lengths), dim, generator=generator)
    cu = torch.tensor([0, 40, 72, 78], dtype=torch.int32)
    score_starts = [33, 25, 1]
    history_lens = torch.tensor([33, 49, 11])
    long, short, scored = prefill_parts(spans, score_starts, min_queries=30)
    dense = DenseSegments(
        query_index=None, cu_seqlens=cu, positions=positions.int(), block_tables=tables,
        score_starts=torch.tensor(score_starts, dtype=torch.int32), history_lens=history_lens,
        num_candidates=8, max_query_len=40, max_context=56, max_scored_queries=7, prefill_spans=long,
        paged=_subset(spans, short, tables, history_lens, scored=False),
        scored=_subset(spans, scored, tables, history_lens, scored=True),
    )
    pools = SimpleNamespace(keys=key_pool, values=value_pool)
    scale = dim**-0.5
    expected_out, _, expected_scores = reference.paged_dense_attention(
        query[0].transpose(0, 1), key_pool, value_pool, tables, cu, positions.int(), scale, dense.score_starts,
    )
    # On CUDA: SDPA's kernels and the Triton kernels, against the reference on the CPU.
    dense = _on(dense, DEVICE)
    dense.paged, dense.scored = _on(dense.paged, DEVICE), _on(dense.scored, DEVICE)
    pools = SimpleNamespace(keys=key_pool.to(DEVICE), values=value_pool.to(DEVICE))
    scores = torch.full(expected_scores.shape, float("nan"), device=DEVICE)  # the layer's part of `StepPlan.scores`
    out = _prefill_attention(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), pools, dense, scale,
                             get_backend(DEVICE), scores)
    tolerance = 1e-5 if DEVICE.type == "cpu" else 1e-4
    torch.testing.assert_close(out.cpu(), expected_out, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(scores.cpu(), expected_scores, rtol=tolerance, atol=tolerance / 10)


def _prefill_plans(monkeypatch) -> list[DenseSegments]:
    """The dense segments of every prefill step that goes through `attention._prefill_attention`, as they run."""
    plans, original = [], _prefill_attention

    def spy(*args, **kwargs):
        plans.append(args[4])
        return original(*args, **kwargs)

    monkeypatch.setattr("s3r_hf.attention._prefill_attention", spy)
    return plans


@pytest.mark.parametrize("chunk", [2048, 24])  # whole prompts; chunks that continue a prompt
def test_greedy_matches_dense_when_prefill_attends_through_sdpa(chunk, monkeypatch):
    # Prompts of 60, 17 and 45 tokens. Whole, the 17-token one goes through the paged kernel in the step where the
    # others go through SDPA; in steps of at most 24 tokens, later chunks of a prompt attend to its cached K/V.
    monkeypatch.setattr(model_runner, "SDPA_PREFILL_QUERIES", 20)
    plans = _prefill_plans(monkeypatch)
    model = s3r_hf.enable(tiny_model("qwen3", seed=31).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([60, 17, 45], seed=32))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=24)
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=4, page_size=4,
                       prefill_chunk_size=chunk)
    out = model.generate(input_ids, s3r_config=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, dense)
    assert plans and out.s3r_stats.accepted > 0
    assert any(start > 0 for plan in plans for _, _, start, _ in plan.prefill_spans) == (chunk == 24)
    if chunk == 2048:  # one step packs all three prompts: two long chunks and a short one
        assert any(plan.paged is not None for plan in plans)


def test_scored_prefill_steps_score_in_a_launch_of_their_own(monkeypatch):
    """Chunks longer than their scored queries: the paged kernel's launch over every query stores no logits (a
    prefill tiling builds one kernel variant, whether a step's prompts are scored or not) and the scores come from a
    launch over the scored queries alone; greedy S3R still equals dense decoding."""
    taken = _prefill_plans(monkeypatch)
    model = s3r_hf.enable(tiny_model("llama", seed=33).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([60, 17, 45], seed=34))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=24)
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=4, page_size=4)
    out = model.generate(input_ids, s3r_config=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, dense)
    assert taken and out.s3r_stats.accepted > 0
    for step in taken:
        assert step.prefill_spans == []  # no chunk reaches SDPA's length
        assert step.paged is not None and step.paged.score_starts is None
        assert step.paged.max_query_len == 60
        assert step.scored is not None and step.scored.max_query_len == config.draft_len + 1
