"""Adaptive draft lengths keep greedy S3R token-identical to dense decoding, whatever `k` each round takes.

Rounds of `k = 0` are dense steps that leave the index views stale; the next round that drafts runs a refresh
step first, and early launches (the next dense step, the next draft phase) are queued across every kind of switch.
Scripted policies force those switches at chosen rounds; the adaptive policy itself runs on measured CPU costs.
The sampled counterpart (the G-test with a varying `k`) is in test_exactness_sampling.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.draft_policy import AdaptiveDraftLength, ScriptedDraftLength
from s3r_hf.runtime_state import adaptive_policy
from tests.conftest import left_padded_batch, tiny_model

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
PATTERNS = {
    "dense-then-draft": [0, 0, 3],
    "draft-then-dense": [3, 3, 0],
    "mixed": [2, 0, 0, 3, 1, 0],
    "alternating": [0, 3],
}


def _config(**overrides) -> S3RConfig:
    values = dict(draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, cuda_graphs=DEVICE.type == "cuda")
    return S3RConfig(**{**values, **overrides})


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_greedy_matches_dense_when_the_draft_length_varies(pattern, view_checks):
    model = s3r_hf.enable(tiny_model("qwen3", seed=21).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([7, 31, 18, 44, 12], seed=22))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=37)
    dense = model.generate(input_ids, **kwargs)
    policy = ScriptedDraftLength(PATTERNS[pattern])
    out = model.generate(input_ids, s3r_config=_config(), s3r_draft_policy=policy, return_dict_in_generate=True,
                         **kwargs)
    assert torch.equal(out.sequences, dense)
    assert out.s3r_stats.drafted > 0 and policy.rounds > len(PATTERNS[pattern])


@pytest.mark.parametrize("refreshes", [[True], [False, False, True]])
def test_varying_draft_lengths_under_kv_pressure_with_a_queue_and_eos(refreshes, view_checks):
    """Switches between dense steps and drafting, over views refreshed every round or extended in between, while
    requests finish on EOS, newcomers arrive from the queue, and requests are paused and restored when the pool
    runs short."""
    model = s3r_hf.enable(tiny_model("llama", seed=23).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 26, 14, 5, 21, 17], seed=24))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40, pad_token_id=0)
    free = model.generate(input_ids, eos_token_id=None, **kwargs)[:, input_ids.shape[1]:]
    kwargs["eos_token_id"] = [int(free[0, 25]), int(free[3, 33])]
    dense = model.generate(input_ids, **kwargs)
    config = _config(num_pages=30, concurrency_min=4, concurrency_max=4, admission_sigmas=None)  # pauses wanted
    policy = ScriptedDraftLength([0, 2, 3, 0, 0, 1], refreshes=refreshes)
    out = model.generate(input_ids, s3r_config=config, s3r_draft_policy=policy, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, dense)
    assert out.s3r_stats.offload_episodes > 0, "the pool was meant to run short"
    assert (view_checks["extend"] > 0) == (False in refreshes)


def test_history_reading_processors_with_varying_draft_lengths():
    """Host-driven draft passes (a processor reads the history) across dense steps and refresh steps."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=25).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([11, 29, 6], seed=26))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30,
                  logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=1.3)]))
    dense = model.generate(input_ids, **kwargs)
    out = model.generate(input_ids, s3r_config=_config(), s3r_draft_policy=ScriptedDraftLength([0, 3, 2, 0]),
                         **kwargs)
    assert torch.equal(out, dense)


class CheapDrafts(AdaptiveDraftLength):
    """The adaptive rule told that drafting rounds cost a tenth of their measured time, so that it drafts on any
    device (also `tests/test_exactness_long.py`). On a GPU a tiny model's draft passes cost what its dense steps cost:
    the true rule decodes densely there, and its probes of drafting refresh every round, so no view would ever be
    extended."""

    def observe_cost(self, shape, draft_len, seconds, refreshes=True, follows_refresh=True):
        super().observe_cost(shape, draft_len, seconds / 10 if draft_len else seconds, refreshes, follows_refresh)


def test_the_adaptive_policy_is_the_default_and_stays_exact():
    model = s3r_hf.enable(tiny_model("qwen3", seed=27).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([13, 40, 22, 8], seed=28))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=60)
    dense = model.generate(input_ids, **kwargs)
    assert S3RConfig().adaptive
    policy = CheapDrafts(3, min_probe_gap=2, refresh_intervals=(1, 2, 3))
    out = model.generate(input_ids, s3r_config=_config(), s3r_draft_policy=policy, return_dict_in_generate=True,
                         **kwargs)
    assert torch.equal(out.sequences, dense)
    # It measured both sides: dense steps and full-length rounds, and views refreshed every round and less often.
    assert policy.choices.get(0, 0) > 0 and policy.choices.get(3, 0) > 0
    assert policy.interval_choices.get(1, 0) > 0 and set(policy.interval_choices) - {1}
    # Without a policy given, the engine builds the adaptive one from the config.
    again = model.generate(input_ids, s3r_config=_config(), **kwargs)
    assert torch.equal(again, dense)


def test_the_configured_draft_lengths_reach_the_rule_and_stay_exact():
    """`S3RConfig.adaptive_draft_lengths`: the engine's rule chooses among them, and rounds of the lengths in between
    (probed next to the choice) decode what dense decoding does."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=31).to(DEVICE))
    # Contexts of 130-230 tokens and no EOS: every round in one (rows, context) bucket of the rule.
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([130, 141, 135, 150], seed=32))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=80)
    dense = model.generate(input_ids, **kwargs)
    config = _config(adaptive_draft_lengths=(0, 1, 3))
    assert torch.equal(model.generate(input_ids, s3r_config=config, **kwargs), dense)
    assert adaptive_policy(model, config).lengths == (0, 1, 3)
    policy = _OneDraftPays(3, lengths=(0, 1, 3), min_probe_gap=2, probe_budget=1.0, refresh_intervals=(1, 2))
    out = model.generate(input_ids, s3r_config=config, s3r_draft_policy=policy, **kwargs)
    assert torch.equal(out, dense)
    assert policy.choices.get(1, 0) > policy.choices.get(3, 0) > 0 and policy.choices.get(0, 0) > 0
    s3r_hf.release(model)


class _OneDraftPays(AdaptiveDraftLength):
    """The adaptive rule told that a dense step costs 1 ms, a round of one draft 0.9 ms and a round of three 5 ms,
    whatever the device measured: the length in between is the one to choose, on any device."""

    def observe_cost(self, shape, draft_len, seconds, refreshes=True, follows_refresh=True):
        scaled = {0: 1.0, 1: 0.9, 3: 5.0}[draft_len] * 1e-3
        super().observe_cost(shape, draft_len, scaled, refreshes, follows_refresh)


def test_what_the_policy_learned_is_kept_across_calls_until_released():
    model = s3r_hf.enable(tiny_model("qwen3", seed=29).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 17], seed=30))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=20, s3r_config=_config())
    model.generate(input_ids, **kwargs)
    kept = adaptive_policy(model, _config())
    rounds = sum(bucket.rounds for bucket in kept.buckets.values())
    assert rounds > 0
    model.generate(input_ids, **kwargs)
    assert adaptive_policy(model, _config()) is kept  # the second call continued from the first one's measurements
    assert sum(bucket.rounds for bucket in kept.buckets.values()) > rounds
    s3r_hf.release(model)
    assert adaptive_policy(model, _config()) is not kept


class _RecordingScript(ScriptedDraftLength):
    """A scripted policy that keeps the draft lengths whose round costs the engine reported."""

    def __init__(self, draft_lens: list[int]) -> None:
        super().__init__(draft_lens)
        self.costed: list[int] = []

    def observe_cost(self, shape, draft_len, seconds, refreshes=True, follows_refresh=True):
        assert seconds > 0
        self.costed.append(draft_len)


def test_only_rounds_that_follow_a_round_of_the_same_length_are_costed():
    """The first round after a switch of `k` ran launches its predecessor would have overlapped (and a refresh step
    is no round of either kind): reporting them would bias the rule against whichever length it probes."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=57).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 23, 15], seed=58))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40, s3r_config=_config())
    switching = _RecordingScript([0, 3])  # rounds: dense, refresh step, draft, dense, refresh step, draft, ...
    model.generate(input_ids, s3r_draft_policy=switching, **kwargs)
    assert switching.rounds > 4 and switching.costed == []
    runs = _RecordingScript([0, 0, 0, 3, 3, 3])
    model.generate(input_ids, s3r_draft_policy=runs, **kwargs)
    assert set(runs.costed) == {0, 3}
    s3r_hf.release(model)
