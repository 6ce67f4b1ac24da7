"""`S3RConfig.refresh_interval`: index views refreshed from the verify's scores every few rounds, extended with the
committed tokens in between. Samples stay exact (greedy here and under KV pressure in test_greedy_exactness.py,
the G-test in test_exactness_sampling.py); the views stay sorted, hold the latest committed token and match the
host's idea of their length (the `view_checks` fixture in conftest.py)."""

from __future__ import annotations

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.cache.index_view import SparseIndexViews
from tests.conftest import left_padded_batch, tiny_model


def test_extend_appends_the_committed_positions_to_every_layer_and_head():
    views = SparseIndexViews(num_layers=2, num_kv_heads=3, max_requests=4, device=torch.device("cpu"))
    views.ensure_capacity(16)
    views.positions[..., :5] = torch.tensor([0, 2, 3, 6, 8], dtype=torch.int32)
    views.lengths[:] = torch.tensor([5, 3, 4, 2], dtype=torch.int32)
    before = views.positions.clone()
    views.extend(torch.tensor([1, 3]), torch.tensor([10, 7]), torch.tensor([13, 8]), max_new=4)
    assert views.lengths.tolist() == [5, 6, 4, 3]
    assert torch.equal(views.positions[:, 1, :, :6], torch.tensor([0, 2, 3, 10, 11, 12]).expand(2, 3, 6).int())
    assert torch.equal(views.positions[:, 3, :, :3], torch.tensor([0, 2, 7]).expand(2, 3, 3).int())
    # Other slots, and each extended slot's own entries, are untouched.
    assert torch.equal(views.positions[:, [0, 2]], before[:, [0, 2]])
    assert torch.equal(views.positions[:, 1, :, :3], before[:, 1, :, :3])


@pytest.mark.parametrize("interval", [2, 3])
def test_greedy_with_views_refreshed_every_few_rounds_matches_dense(interval, view_checks):
    model = s3r_hf.enable(tiny_model("qwen3", seed=21))
    input_ids, attention_mask = left_padded_batch([5, 17, 33, 48, 9], seed=22)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=48)
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4,
                       refresh_interval=interval)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=48,
                         s3r_config=config, return_dict_in_generate=True)
    assert torch.equal(out.sequences, dense)
    rounds = out.s3r_stats.steps
    # Prefill builds each prompt's views once (`IndexViewUpdates.refresh` -> `rebuild`); rounds refresh every
    # `interval`-th time and extend otherwise.
    assert view_checks["extend"] == rounds - rounds // interval
    assert view_checks["refresh"] >= rounds // interval
    assert out.s3r_stats.accepted < out.s3r_stats.drafted


def test_history_reading_processors_draft_over_extended_views(view_checks):
    """A repetition penalty reads the token history, so drafts run one host-driven pass per position; those passes
    size their view reads from the host's view lengths, which extended views change."""
    model = s3r_hf.enable(tiny_model("llama", seed=23))
    input_ids, attention_mask = left_padded_batch([6, 19, 27], seed=24)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30, repetition_penalty=1.3)
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.1, min_budget=2, page_size=4, refresh_interval=2)
    out = model.generate(input_ids, s3r_config=config, **kwargs)
    assert torch.equal(out, dense)
    assert view_checks["extend"] > 0
