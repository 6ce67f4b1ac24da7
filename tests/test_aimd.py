"""The KV-aware AIMD concurrency limit (paper, Appendix B.2): the rule against scripted traces of KV utilisation
and restore backlog, and an engine run in which the limit moves while outputs stay exact."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.engine.concurrency import AIMDConcurrency
from s3r_hf.engine.prompt_chunks import PromptChunks
from s3r_hf.stats import S3RStats
from tests.conftest import left_padded_batch, tiny_model
from tests.exact_distribution import (
    count_continuations,
    exact_continuation_distribution,
    g_test,
    sampling_warpers,
    tiny_enumerable_model,
)

# On a GPU machine (`S3R_HF_TEST_DEVICE=cuda`) the greedy engine run pauses and restores requests through the
# offloader's CUDA stream.
DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
VOCAB, PROMPT_LEN, NEW_TOKENS = 8, 24, 4  # as in test_exactness_sampling.py

# C_min 4, C_max 20, δ 2, β 0.5, u_low 0.5, u_high 0.9, O_th 2.
RULE = dict(concurrency_min=4, concurrency_max=20, concurrency_step=2, concurrency_backoff=0.5, utilization_low=0.5,
            utilization_high=0.9, restore_backlog_threshold=2)


def _drive(trace: list[tuple[float, int]], **overrides) -> list[int]:
    """The limits after each `(utilisation, restore backlog)` step of `trace`, the starting limit first."""
    rule = AIMDConcurrency(S3RConfig(**{**RULE, **overrides}))
    limits = [rule.limit] + [rule.update(utilization, backlog) for utilization, backlog in trace]
    assert rule.trace == limits
    return limits


def test_the_limit_starts_at_c_max():
    assert _drive([]) == [20]


def test_high_utilisation_backs_off_multiplicatively_down_to_c_min():
    assert _drive([(0.95, 0)] * 4) == [20, 10, 5, 4, 4]  # ⌊0.5·5⌋ = 2 is clipped to C_min


def test_low_utilisation_increases_additively_up_to_c_max():
    assert _drive([(0.95, 0)] * 2 + [(0.1, 0)] * 7) == [20, 10, 5, 7, 9, 11, 13, 15, 17, 19]
    assert _drive([(0.95, 0)] + [(0.1, 0)] * 7)[-3:] == [20, 20, 20]  # 10 + 2·5 reaches C_max and stays


def test_utilisation_between_the_thresholds_holds_the_limit():
    limits = _drive([(0.95, 0), (0.5, 0), (0.7, 0), (0.9, 0)])
    assert limits == [20, 10, 10, 10, 10]  # u_low and u_high themselves are inside the band (strict comparisons)


def test_a_restore_backlog_above_o_th_backs_off_even_at_low_utilisation():
    # O = O_th is tolerated (the low utilisation then increases the limit); O = O_th + 1 backs off.
    assert _drive([(0.95, 0), (0.1, 2), (0.1, 3), (0.1, 3)]) == [20, 10, 12, 6, 4]


def test_a_scripted_episode_of_pressure_and_relief():
    """Pressure builds (utilisation high, then paused requests wait), then the pool drains."""
    trace = [(0.7, 0), (0.92, 0), (0.85, 1), (0.85, 3), (0.6, 2), (0.3, 0), (0.3, 0), (0.3, 0), (0.99, 0)]
    assert _drive(trace) == [20, 20, 10, 10, 5, 5, 7, 9, 11, 5]


def test_c_min_equal_to_c_max_pins_the_limit():
    assert _drive([(0.99, 9), (0.0, 0)], concurrency_min=8, concurrency_max=8) == [8, 8, 8]


def test_backing_off_is_logged(caplog):
    rule = AIMDConcurrency(S3RConfig(**RULE))
    with caplog.at_level(logging.INFO, logger="s3r_hf.engine.concurrency"):
        rule.update(0.5, 0)
        assert not caplog.records
        rule.update(0.95, 0)
    assert len(caplog.records) == 1 and "20 -> 10" in caplog.records[0].getMessage()


def test_stats_keep_the_limit_where_it_changed():
    stats = S3RStats()
    assert (stats.concurrency_limit_min, stats.concurrency_limit_max, stats.concurrency_limit_final) == (0, 0, 0)
    stats.record_concurrency_limit(0, 20)
    for step, (previous, limit) in enumerate([(20, 20), (20, 10), (10, 10), (10, 12), (12, 6)], start=1):
        stats.record_concurrency_limit(step, limit, previous)
    assert stats.concurrency_trace == [(0, 20), (2, 10), (4, 12), (5, 6)]
    assert stats.concurrency_backoffs == 2
    assert (stats.concurrency_limit_min, stats.concurrency_limit_max, stats.concurrency_limit_final) == (6, 20, 6)
    summary = json.loads(json.dumps(stats.to_dict()))
    assert summary["concurrency_trace"] == [[0, 20], [2, 10], [4, 12], [5, 6]]
    assert summary["concurrency_backoffs"] == 2 and summary["concurrency_limit_final"] == 6


# ---------------------------------------------------------------- in the engine
# Ten requests, room for about three at full length, a limit between 2 and 8 that backs off when the pool is more
# than 60% used or any paused request waits, and grows again below 50%. Admissions take whatever fits now
# (`admission_sigmas=None`), so that requests are paused and restored.
MOVING = dict(draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, num_pages=40, concurrency_min=2,
              concurrency_max=8, concurrency_step=1, concurrency_backoff=0.5, utilization_low=0.5,
              utilization_high=0.6, restore_backlog_threshold=0, admission_sigmas=None)


def _moving_run(model, do_sample: bool, **config):
    input_ids, attention_mask = left_padded_batch([5, 17, 9, 23, 12, 30, 7, 19, 14, 26], seed=32)
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    kwargs = dict(attention_mask=attention_mask, do_sample=do_sample, max_new_tokens=36, pad_token_id=0)
    out = model.generate(input_ids, s3r_config=S3RConfig(**{**MOVING, **config}), return_dict_in_generate=True,
                         **kwargs)
    return input_ids, kwargs, out


def _assert_the_limit_moved(stats):
    trace = stats.concurrency_trace
    limits = [limit for _, limit in trace]
    assert limits[0] == MOVING["concurrency_max"]
    assert stats.concurrency_limit_min < MOVING["concurrency_max"], trace
    assert any(later > earlier for earlier, later in zip(limits, limits[1:])), f"the limit never grew back: {trace}"
    assert stats.concurrency_backoffs > 0 and stats.concurrency_limit_final == limits[-1]
    assert all(MOVING["concurrency_min"] <= limit <= MOVING["concurrency_max"] for limit in limits)


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_equals_dense_while_the_limit_moves(adaptive):
    model = s3r_hf.enable(tiny_model("llama", seed=31).to(DEVICE))
    input_ids, kwargs, out = _moving_run(model, do_sample=False, adaptive=adaptive)
    dense = model.generate(input_ids, **kwargs)
    assert torch.equal(out.sequences, dense)  # no request lost, cut short or changed
    _assert_the_limit_moved(out.s3r_stats)
    stats = out.s3r_stats
    assert stats.offload_episodes > 0 and stats.peak_kv_pages <= MOVING["num_pages"]
    # Every paused request came back: what went to host memory returned, and was there at some point.
    assert stats.pages_restored == stats.pages_offloaded > 0 and stats.peak_host_kv_pages > 0
    assert stats.pages_moved_per_1k_tokens == pytest.approx(2000 * stats.pages_offloaded / stats.committed)


def test_sampled_output_follows_the_dense_distribution_while_the_limit_moves(monkeypatch):
    """The G-test of test_exactness_sampling.py with a limit that backs off and grows again while 10,000 sampled
    requests queue for a pool that holds a few hundred at a time (requests are paused and restored too). The same
    run with `s3r_mode="unverified"` rejects at p < 1e-12, so the test has power here too. Requests admitted while
    others run copy the prompt from a running donor (`PromptChunks.take`), so that path is tested here as well."""
    copied = []
    take = PromptChunks.take.__func__

    def counting_take(cls, *args, **kwargs):
        chunks = take(cls, *args, **kwargs)
        copied.append(chunks.copied_tokens if chunks is not None else 0)
        return chunks

    monkeypatch.setattr(PromptChunks, "take", classmethod(counting_take))
    model = s3r_hf.enable(tiny_enumerable_model(VOCAB, seed=0, attention_gain=8.0, output_gain=8.0))
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(100))
    probs, _ = exact_continuation_distribution(model, prompt, NEW_TOKENS, sampling_warpers(temperature=1.0))
    config = dict(adaptive=False, draft_len=2, budget_ratio=0.05, min_budget=1, page_size=4, num_pages=1024,
                  concurrency_min=32, concurrency_max=512, concurrency_step=32, concurrency_backoff=0.5,
                  utilization_low=0.9, utilization_high=0.95, restore_backlog_threshold=0, admission_sigmas=None)
    sequences, moved = [], []
    for seed in (11, 12):
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                             max_new_tokens=NEW_TOKENS, num_return_sequences=5_000, return_dict_in_generate=True,
                             s3r_config=S3RConfig(**config, seed=seed))
        sequences.append(out.sequences)
        limits = [limit for _, limit in out.s3r_stats.concurrency_trace]
        moved.append(min(limits) < 512 and any(b > a for a, b in zip(limits, limits[1:])))
        assert out.s3r_stats.offload_episodes > 0
    assert all(moved) and sum(copied) > 0
    counts = count_continuations(torch.cat(sequences), PROMPT_LEN, VOCAB, NEW_TOKENS)
    for counted, expected in ((counts, probs), (counts.sum(dim=-1), probs.sum(dim=-1))):
        result = g_test(counted, expected)
        assert result["impossible"] == 0 and result["p_value"] > 1e-3, result
