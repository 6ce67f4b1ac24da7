"""`S3RConfig.refresh_interval`: index views refreshed from the verify's scores every few rounds, extended with the
committed tokens in between. Samples stay exact (greedy here, the G-test in test_exactness_sampling.py); the views
stay sorted, hold the latest committed token and match the host's idea of their length."""

from __future__ import annotations

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.cache.index_view import SparseIndexViews
from s3r_hf.engine import S3REngine
from s3r_hf.request import RequestStatus
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


@pytest.fixture
def view_checks(monkeypatch):
    """After every round: each running request's views are sorted, end at its last committed position, and are as
    long as the host thinks. Also counts refreshed and extended rounds."""
    counts = {"refresh": 0, "extend": 0}
    original_round, original_rebuild, original_extend = (
        S3REngine._round, S3REngine._rebuild_views, S3REngine._extend_views
    )

    def checked_round(self, requests):
        original_round(self, requests)
        views = self.cache.index_views
        for request in requests:
            if request.status is RequestStatus.FINISHED:
                continue
            length = int(views.lengths[request.slot])
            assert length == request.view_len
            positions = views.positions[:, request.slot, :, :length]
            assert bool((positions[..., 1:] > positions[..., :-1]).all()), "a view is not sorted"
            assert bool((positions[..., -1] == request.committed - 1).all()), "a view misses the latest token"

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(S3REngine, "_round", checked_round)
    monkeypatch.setattr(S3REngine, "_rebuild_views", counted("refresh", original_rebuild))
    monkeypatch.setattr(S3REngine, "_extend_views", counted("extend", original_extend))
    return counts


@pytest.mark.parametrize("interval", [2, 3])
def test_greedy_with_views_refreshed_every_few_rounds_matches_dense(interval, view_checks):
    model = s3r_hf.enable(tiny_model("qwen3", seed=21))
    input_ids, attention_mask = left_padded_batch([5, 17, 33, 48, 9], seed=22)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=48)
    config = S3RConfig(draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, refresh_interval=interval)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=48,
                         s3r_config=config, return_dict_in_generate=True)
    assert torch.equal(out.sequences, dense)
    rounds = out.s3r_stats.steps
    # Prefill builds each prompt's views once (`refresh_views` -> `_rebuild_views`); rounds refresh every
    # `interval`-th time and extend otherwise.
    assert view_checks["extend"] == rounds - rounds // interval
    assert view_checks["refresh"] >= rounds // interval
    assert out.s3r_stats.accepted < out.s3r_stats.drafted


def test_extended_views_survive_pauses_under_kv_pressure(view_checks):
    model = s3r_hf.enable(tiny_model("llama", seed=13))
    input_ids, attention_mask = left_padded_batch([20, 22, 24, 26], seed=14)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    config = S3RConfig(draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, num_pages=36, refresh_interval=3)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert out.s3r_stats.offload_episodes > 0, "the pool is too small for all four: some must be paused"
    assert view_checks["extend"] > 0
