"""A fixed `S3RConfig.seed`: one call is reproducible, successive calls and data-parallel ranks draw new streams.

Sampled outputs follow the random stream only for a given sequence of draft lengths, so these tests fix `k`
(`adaptive=False`): adaptive draft lengths are chosen from measured times, which differ from run to run.
"""

from __future__ import annotations

import torch

import s3r_hf
from s3r_hf import S3RConfig, runtime_state
from tests.conftest import left_padded_batch, tiny_model

CONFIG = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, seed=1234)


def _sample(model, config=CONFIG):
    input_ids, attention_mask = left_padded_batch([6, 14, 9], seed=61)
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=True, top_k=0, max_new_tokens=24,
                          s3r_config=config)


def _model():
    return s3r_hf.enable(tiny_model("qwen3", seed=60))


def test_a_seeded_call_is_reproducible():
    model = _model()
    first = _sample(model)
    s3r_hf.release(model)  # the count of seeded calls starts again
    assert torch.equal(_sample(model), first)
    # Another model with the same weights, first call with the seed: the same stream.
    assert torch.equal(_sample(_model()), first)
    s3r_hf.release(model)


def test_successive_calls_with_one_seed_draw_new_streams():
    model = _model()
    first, second, third = _sample(model), _sample(model), _sample(model)
    assert not torch.equal(first, second) and not torch.equal(second, third) and not torch.equal(first, third)
    # The n-th call is reproducible too.
    s3r_hf.release(model)
    _sample(model)
    assert torch.equal(_sample(model), second)
    s3r_hf.release(model)


def test_ranks_draw_different_streams(monkeypatch):
    rank0 = _sample(_model())
    monkeypatch.setenv("RANK", "1")  # what `accelerate launch` and `torchrun` set
    rank1 = _sample(_model())
    assert not torch.equal(rank0, rank1)
    assert torch.equal(_sample(_model()), rank1)  # reproducible on that rank


def test_the_rank_comes_from_torch_distributed_once_it_is_initialized(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert runtime_state.process_rank() == 3
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    assert runtime_state.process_rank() == 1


def test_without_a_seed_calls_follow_torchs_global_generator():
    model = _model()
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4)
    torch.manual_seed(7)
    first = _sample(model, config)
    torch.manual_seed(7)
    assert torch.equal(_sample(model, config), first)
    assert not torch.equal(_sample(model, config), first)
    s3r_hf.release(model)
