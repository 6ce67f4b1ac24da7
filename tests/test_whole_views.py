"""Index views that hold the whole context (`S3RConfig.whole_view`: up to `min_budget` tokens) are every position, so
they are built without scores: a prompt that short is prefilled unscored and its first views are set whole. They must
be the views the scored path builds, and the samples those of dense decoding."""

from __future__ import annotations

import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.engine.first_tokens import FirstTokens
from tests.conftest import left_padded_batch, tiny_model

# Prompts on both sides of `min_budget` in one prefill step: whole views and scored ones are built side by side.
LENGTHS = [5, 11, 12, 13, 30, 9]
MIN_BUDGET = 12


def _first_views(model, input_ids, attention_mask, monkeypatch) -> tuple[dict[int, torch.Tensor], list, torch.Tensor]:
    """Each prompt's first index views (every layer and KV head), the prefill plans' `score_starts`, and the greedy
    output."""
    views, score_starts = {}, []
    commit = FirstTokens.commit

    def recording(self, plan, segments, finished, logits):
        commit(self, plan, segments, finished, logits)
        score_starts.append(plan.dense.score_starts)
        index_views = self.views.cache.index_views
        for request in finished:
            views[request.row] = index_views.positions[:, request.slot, :, : request.view_len].clone()
            assert int(index_views.lengths[request.slot]) == request.view_len

    monkeypatch.setattr(FirstTokens, "commit", recording)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.1, min_budget=MIN_BUDGET, page_size=4,
                       share_prompts=False)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24,
                         s3r_config=config)
    monkeypatch.setattr(FirstTokens, "commit", commit)
    return views, score_starts, out


def test_short_prompts_get_whole_views_without_scores_equal_to_the_scored_ones(monkeypatch):
    model = s3r_hf.enable(tiny_model("qwen3", seed=91))
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=92)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24)

    views, score_starts, out = _first_views(model, input_ids, attention_mask, monkeypatch)
    assert torch.equal(out, dense)
    # Only the prompts longer than `min_budget` were scored.
    starts = torch.cat([s for s in score_starts if s is not None]).tolist()
    assert sum(start >= 0 for start in starts) == sum(length > MIN_BUDGET for length in LENGTHS)
    for row, length in enumerate(LENGTHS):
        if length <= MIN_BUDGET:
            assert torch.equal(views[row], torch.arange(length, dtype=torch.int32).expand_as(views[row]))

    # The scored path everywhere (as before whole views were built unscored) gives the same views.
    monkeypatch.setattr(S3RConfig, "whole_view", lambda self, context_len: False)
    scored_views, scored_starts, scored_out = _first_views(model, input_ids, attention_mask, monkeypatch)
    assert torch.equal(scored_out, dense)
    assert sum(start >= 0 for s in scored_starts for start in s.tolist()) == len(LENGTHS)
    for row in range(len(LENGTHS)):
        assert torch.equal(views[row], scored_views[row])


def test_a_view_holds_the_whole_context_up_to_min_budget_tokens():
    config = S3RConfig(budget_ratio=0.1, min_budget=MIN_BUDGET)
    assert all(config.whole_view(n) for n in range(1, MIN_BUDGET + 1))
    assert not any(config.whole_view(n) for n in range(MIN_BUDGET + 1, 400))
    assert S3RConfig(budget_ratio=1.0, min_budget=1).whole_view(10_000)  # a dense "sparse" view
