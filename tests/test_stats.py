"""`S3RStats`: vLLM's speculative-decoding counts, dense steps kept apart from drafts, and τ beside them."""

from __future__ import annotations

import json

import pytest

from s3r_hf.stats import S3RStats


def test_vllm_counts_and_mean_acceptance_length():
    stats = S3RStats()
    # Three requests draft 3 tokens each; they accept 3, 1 and 0 and commit accepted + 1.
    stats.record_round([3, 3, 3], [3, 1, 0], [4, 2, 1])
    stats.record_round([2], [2], [3])
    assert (stats.num_drafts, stats.dense_steps, stats.rounds) == (4, 0, 4)
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (11, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1]
    assert stats.position_drafted == [4, 4, 3]
    assert stats.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert stats.tau == pytest.approx(10 / 4)  # no dense steps and no cut: both agree
    assert stats.acceptance_rate == pytest.approx(6 / 11)


def test_rounds_without_drafts_are_dense_steps_not_drafts():
    stats = S3RStats()
    stats.record_round([4, 0, 0], [4, 0, 0], [5, 1, 1])  # two requests run a plain dense step in this round
    stats.record_round([0, 0], [0, 0], [1, 1])
    assert (stats.num_drafts, stats.dense_steps, stats.rounds) == (1, 4, 5)
    assert stats.draft_length_counts == {4: 1, 0: 4}
    # vLLM's figure describes the one draft; τ spreads the committed tokens over every request-round.
    assert stats.mean_acceptance_length == pytest.approx(5.0)
    assert stats.tau == pytest.approx(9 / 5)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 1, 1]


def test_cut_at_eos_lowers_tau_not_the_mean_acceptance_length():
    stats = S3RStats()
    stats.record_round([3], [3], [2])  # all three drafts accepted, but the response ended at the second token
    assert stats.mean_acceptance_length == 4.0
    assert stats.tau == 2.0


def test_dense_only_and_empty_runs():
    dense = S3RStats()
    dense.record_round([0, 0, 0], [0, 0, 0], [1, 1, 1])
    assert (dense.num_drafts, dense.dense_steps, dense.num_draft_tokens) == (0, 3, 0)
    assert dense.mean_acceptance_length == 1.0 and dense.tau == 1.0 and dense.acceptance_rate == 0.0
    empty = S3RStats()
    assert empty.mean_acceptance_length == 0.0 and empty.tau == 0.0 and empty.num_accepted_tokens_per_pos == []


def test_to_dict_is_json_ready_and_names_every_metric():
    stats = S3RStats()
    stats.record_round([2, 0], [1, 0], [2, 1])
    values = json.loads(json.dumps(stats.to_dict()))
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                "mean_acceptance_length", "dense_steps", "tau", "draft_length_counts", "decode_steps",
                "request_rounds"):
        assert key in values
    assert values["num_accepted_tokens_per_pos"] == [1, 0]
    assert values["draft_length_counts"] == {"0": 1, "2": 1}


def test_decode_steps_and_request_rounds_keep_their_former_names():
    stats = S3RStats()
    stats.record_round([2, 0, 1], [1, 0, 1], [2, 1, 2])
    stats.steps += 1  # the former name of decode_steps
    assert (stats.decode_steps, stats.request_rounds) == (1, 3)
    assert (stats.steps, stats.rounds) == (1, 3)
    assert {"decode_steps", "request_rounds"} <= set(stats.to_dict())


def test_decode_by_rows_buckets_steps_by_the_requests_running():
    stats = S3RStats()
    stats.record_round([0] * 64, [0] * 64, [1] * 64)
    stats.record_step_interval(64, 0.5)
    stats.record_round([6] * 3, [2] * 3, [3] * 3)
    stats.record_step_interval(3, 0.25)
    stats.record_round([0], [0], [1])
    stats.record_step_interval(1, 0.125)
    assert stats.decode_by_rows == {
        64: {"seconds": 0.5, "steps": 1, "tokens": 64},
        4: {"seconds": 0.25, "steps": 1, "tokens": 9},
        1: {"seconds": 0.125, "steps": 1, "tokens": 1},
    }
    assert json.loads(json.dumps(stats.to_dict()))["decode_by_rows"]["4"]["tokens"] == 9


def test_a_call_accounts_its_decode_time_and_tokens_by_rows():
    """Every decode step's interval and tokens land in one rows bucket: the buckets sum to the call's decoding."""
    from conftest import left_padded_batch, tiny_model

    from s3r_hf import S3RConfig, enable

    model = tiny_model("llama")
    enable(model)
    ids, mask = left_padded_batch([5, 9, 7, 12, 3])
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=True, pad_token_id=0, eos_token_id=None,
        s3r_config=S3RConfig(min_budget=8, draft_len=3, seed=1), return_dict_in_generate=True,
    )
    stats = out.s3r_stats
    by_rows = stats.decode_by_rows
    assert set(by_rows) <= {1, 2, 4, 8}
    assert sum(entry["steps"] for entry in by_rows.values()) == stats.decode_steps
    assert sum(entry["tokens"] for entry in by_rows.values()) == stats.committed
    seconds = sum(entry["seconds"] for entry in by_rows.values())
    assert 0 < seconds <= stats.decode_seconds + 1e-6 or stats.decode_seconds == 0


def test_each_requests_own_acceptance_and_its_spread():
    """Requests accept at their own rates; dense steps are no drafts of theirs, and requests that drafted too little
    are left out of the spread."""
    stats = S3RStats()
    for _ in range(10):
        stats.record_round([3, 3, 3, 0], [3, 1, 0, 0], [4, 2, 1, 1], batch_rows=[0, 1, 2, 3])
    stats.record_round([3], [0], [1], batch_rows=[4])  # drafted 3 tokens only
    assert stats.request_acceptance == {0: [30, 30], 1: [30, 10], 2: [30, 0], 4: [3, 0]}
    assert stats.acceptance_by_request() == {"requests": 3, "p10": 0.0, "p50": pytest.approx(1 / 3), "p90": 1.0}
    assert stats.acceptance_by_request(min_drafted=1)["requests"] == 4
    assert S3RStats().acceptance_by_request() == {}
    assert json.loads(json.dumps(stats.to_dict()))["acceptance_by_request"]["requests"] == 3


def test_a_call_counts_each_requests_drafts_under_its_batch_row():
    import s3r_hf
    from s3r_hf import S3RConfig
    from tests.conftest import left_padded_batch, tiny_model

    model = s3r_hf.enable(tiny_model("llama"))
    ids, mask = left_padded_batch([9, 12, 7], seed=5)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True,
                         s3r_config=S3RConfig(min_budget=4, adaptive=False, draft_len=3))
    stats = out.s3r_stats
    assert set(stats.request_acceptance) == {0, 1, 2}
    assert sum(d for d, _ in stats.request_acceptance.values()) == stats.num_draft_tokens
    assert sum(a for _, a in stats.request_acceptance.values()) == stats.num_accepted_tokens
    assert stats.acceptance_by_request(min_drafted=1)["requests"] == 3
