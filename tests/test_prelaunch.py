"""The next round's draft phase launched before the host commits a round: same tokens as without it."""

from __future__ import annotations

import os

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.engine.early_launch import EarlyLaunches
from s3r_hf.engine.model_runner import ModelRunner
from tests.conftest import left_padded_batch, tiny_model

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))


@pytest.fixture
def prelaunch_uses(monkeypatch):
    """Early draft phases launched, and rounds that used one: for all their requests, or for some (the survivors of
    a round in which some finished, next to newcomers that draft nothing in their first round)."""
    uses = {"launched": 0, "whole": 0, "survivors": 0, "newcomers": 0}
    take, launch = EarlyLaunches.take_drafts, EarlyLaunches.launch_drafts

    def counting_launches(early, *args):
        before = early.drafts
        launch(early, *args)
        uses["launched"] += early.drafts is not before

    def counting(early, requests, draft_counts):
        launched = early.drafts
        result = take(early, requests, draft_counts)
        if result is not None:
            uses["whole" if len(requests) == len(launched.requests) else "survivors"] += 1
            uses["newcomers"] += sum(id(r) not in {id(old) for old in launched.requests} for r in requests)
        return result

    monkeypatch.setattr(EarlyLaunches, "take_drafts", counting)
    monkeypatch.setattr(EarlyLaunches, "launch_drafts", counting_launches)
    return uses


@pytest.fixture
def call_order(monkeypatch):
    """`(events, record)`: every read of a decision copy appends "read" to `events`; `record(name, label)` makes
    `ModelRunner.<name>` append `label` each time it is called."""
    from s3r_hf.engine import round as round_module

    events = []
    copy = round_module.start_host_copy

    def recording_copy(tensor):
        wait = copy(tensor)

        def read():
            events.append("read")
            return wait()

        return read

    def record(name: str, label: str) -> None:
        method = getattr(ModelRunner, name)

        def recording(runner, *args, **kwargs):
            events.append(label)
            return method(runner, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, name, recording)

    monkeypatch.setattr(round_module, "start_host_copy", recording_copy)
    return events, record


def _generate_early_and_apart(model, input_ids, attention_mask, uses, seed: int = 3, **kwargs):
    """The same call with the early draft launch and with stage timing, which keeps every stage of a round apart
    (no early launch)."""
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.2, min_budget=2, page_size=4, seed=seed,
                       cuda_graphs=DEVICE.type == "cuda")
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=40, eos_token_id=[7, 11], pad_token_id=0,
                  s3r_config=config) | kwargs
    early = model.generate(input_ids, **kwargs)
    launched = uses["launched"]
    s3r_hf.release(model)  # the next call with the seed draws the same stream again
    apart = model.generate(input_ids, s3r_timing="stages", **kwargs)
    assert uses["launched"] == launched, "stage timing must not launch early"
    return early, apart


def test_prelaunched_rounds_commit_the_same_greedy_tokens(prelaunch_uses):
    """EOS inside blocks makes requests finish at different rounds, so later rounds use the survivors' rows of a
    draft phase launched for all."""
    model = s3r_hf.enable(tiny_model("llama", seed=41).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([7, 19, 30, 12, 25], seed=42))
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
                           eos_token_id=[7, 11], pad_token_id=0)
    early, apart = _generate_early_and_apart(model, input_ids, attention_mask, prelaunch_uses,
                                             do_sample=False)
    assert prelaunch_uses["whole"] > 0 and prelaunch_uses["survivors"] > 0, prelaunch_uses
    assert torch.equal(early, apart)
    assert torch.equal(early, dense)
    # The same drafts, not only the same tokens: greedy output stays exact even if early drafts were corrupted (a
    # wrong draft is merely rejected), so compare what was accepted. (On CUDA, graphs sharing one memory pool once
    # let a verify replay overwrite early drafts: greedy outputs stayed right, acceptance fell.)
    assert (early.s3r_stats.rounds, early.s3r_stats.accepted) == (apart.s3r_stats.rounds, apart.s3r_stats.accepted)
    lengths = (early[:, input_ids.shape[1]:] != 0).sum(dim=1)
    assert len(set(lengths.tolist())) > 1, "requests should finish at different rounds"


@pytest.mark.parametrize("seed, max_new_tokens", [(3, 40), (1, 42), (3, 41), (4, 40), (6, 41)])
def test_prelaunched_rounds_draw_the_same_random_numbers(prelaunch_uses, seed, max_new_tokens):
    """Seeded sampling of one request: the early launch draws its draft noise where the next round would have, so
    the samples are the very same. That includes a last round left with one token, which drafts nothing: the early
    phase launched for it drew noise that nothing reads, and the verification's draws come from a stream of their
    own (`sampler.call_generators`), so the last token is the same too. (On CPU the four later cases end that way;
    with one stream for both they gave another last token.) With several requests the early phase also draws noise
    for the rows that finish, which shifts the drafts' stream; the G-tests check that the distribution stays
    exact."""
    model = s3r_hf.enable(tiny_model("llama", seed=45).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([23], seed=46))
    # No EOS: where the random stream would stop the request is device-dependent, and this test needs rounds.
    early, apart = _generate_early_and_apart(model, input_ids, attention_mask, prelaunch_uses, seed=seed,
                                             do_sample=True, eos_token_id=None, max_new_tokens=max_new_tokens)
    assert prelaunch_uses["whole"] > 0
    assert torch.equal(early, apart)


def test_early_launch_with_requests_waiting_for_a_slot(prelaunch_uses):
    """With a queue, a finished request's slot goes to a waiting one, which the early draft phase did not cover:
    the survivors take their early drafts, the newcomer drafts nothing in its first round, and the tokens still
    match dense greedy decoding."""
    model = s3r_hf.enable(tiny_model("llama", seed=41).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([7, 19, 30, 12, 25, 16], seed=42))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40, eos_token_id=[7, 11],
                  pad_token_id=0)
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, concurrency_min=3,
                       concurrency_max=3, cuda_graphs=DEVICE.type == "cuda")
    out = model.generate(input_ids, s3r_config=config, **kwargs)
    assert torch.equal(out, dense)
    lengths = (out[:, input_ids.shape[1]:] != 0).sum(dim=1)
    assert len(set(lengths.tolist())) > 1, "requests should finish at different rounds"
    assert prelaunch_uses["whole"] > 0 and prelaunch_uses["newcomers"] > 0, prelaunch_uses


def test_next_draft_phase_is_queued_before_the_host_reads_the_decision(call_order):
    """The early draft phase needs no host read: its pending tokens, lengths and draft counts are computed on the
    device, so it is queued while the decision is still in flight, and the device never waits for the host's
    commit. Checked by the order of calls: the phase's launch comes before the read it would otherwise wait for."""
    events, record = call_order
    record("run_draft_phase", "phase")
    model = s3r_hf.enable(tiny_model("llama", seed=47).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([11, 17], seed=48))
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4,
                       cuda_graphs=DEVICE.type == "cuda")
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30,
                         s3r_config=config)
    assert torch.equal(out, dense)
    rounds = out.s3r_stats.steps
    # The first round drafts on its own; every later round's phase was launched before the previous round's read
    # (launched after it, the pattern would be phase, read, phase, read). The last rounds, with a token or two
    # left, may draft nothing.
    early = rounds - 3
    assert early > 3 and events[: 2 * early + 1] == ["phase"] + ["phase", "read"] * early, events
    assert events.count("read") == rounds


def test_engine_ar_launches_the_next_step_before_reading_this_one(call_order):
    """The engine's dense baseline overlaps host and device the same way: each step's forward is queued before
    the host reads the previous step's tokens. With EOS inside the batch (survivors' rows) and a queue
    (newcomers, for whom the step runs again), greedy output still equals `model.generate`; seeded sampling
    draws the same random numbers as with every stage apart."""
    events, record = call_order
    record("verify", "forward")
    model = s3r_hf.enable(tiny_model("llama", seed=41).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([7, 19, 30, 12, 25, 16], seed=42))
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=40, eos_token_id=[7, 11], pad_token_id=0,
                  s3r_mode="ar")
    dense = model.generate(input_ids, do_sample=False, **{k: v for k, v in kwargs.items() if k != "s3r_mode"})
    config = S3RConfig(adaptive=False, page_size=4, seed=5, cuda_graphs=DEVICE.type == "cuda")
    out = model.generate(input_ids, do_sample=False, s3r_config=config, **kwargs)
    assert torch.equal(out, dense)
    steps = out.s3r_stats.steps
    lengths = (out[:, input_ids.shape[1]:] != 0).sum(dim=1)
    assert len(set(lengths.tolist())) > 1, "requests should finish at different steps"
    assert events[:7] == ["forward", "forward", "read", "forward", "read", "forward", "read"], events
    assert events.count("read") == steps and events.count("forward") == steps
    # A queue: newcomers make a launched step run again, for everyone.
    queued = S3RConfig(adaptive=False, page_size=4, concurrency_min=3, concurrency_max=3,
                       cuda_graphs=DEVICE.type == "cuda")
    assert torch.equal(model.generate(input_ids, do_sample=False, s3r_config=queued, **kwargs), dense)
    # Seeded sampling: the same samples with the next step launched early and with every stage apart.
    s3r_hf.release(model)  # each call with the seed draws the same stream
    early = model.generate(input_ids, do_sample=True, s3r_config=config, **kwargs)
    s3r_hf.release(model)
    apart = model.generate(input_ids, do_sample=True, s3r_config=config, s3r_timing="stages", **kwargs)
    assert torch.equal(early, apart)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_early_launches_under_kv_pressure_with_a_queue_and_eos(seed, prelaunch_uses):
    """The early draft phase with everything that changes a round's membership at once: requests finishing on
    EOS, newcomers from the queue, and requests paused (offloaded) and restored when the pool runs short. Greedy
    output equals dense decoding, and early phases were used."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 30, (6,), generator=generator).tolist()
    model = s3r_hf.enable(tiny_model("llama", seed=50 + seed).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch(lengths, seed=60 + seed))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=48, pad_token_id=0)
    # EOS tokens that dense decoding reaches mid-way in some rows, so requests finish at different rounds.
    free = model.generate(input_ids, eos_token_id=None, **kwargs)[:, input_ids.shape[1]:]
    kwargs["eos_token_id"] = [int(free[0, 30]), int(free[3, 40])]
    dense = model.generate(input_ids, **kwargs)
    # Room for about one and a half requests at full length; at most four run at once, admitted whenever they fit
    # now (`admission_sigmas=None`), so that requests are paused.
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.2, min_budget=2, page_size=4, num_pages=32,
                       concurrency_min=4, concurrency_max=4, admission_sigmas=None, cuda_graphs=DEVICE.type == "cuda")
    out = model.generate(input_ids, s3r_config=config, **kwargs)
    assert torch.equal(out, dense)
    assert out.s3r_stats.peak_kv_pages <= 32 and out.s3r_stats.offload_episodes > 0
    assert prelaunch_uses["whole"] + prelaunch_uses["survivors"] > 0, prelaunch_uses
    generated = (dense[:, input_ids.shape[1]:] != 0).sum(dim=1)
    assert len(set(generated.tolist())) > 1, "requests should finish at different rounds"
