"""Mixed-stage steps (`S3RConfig.mixed_steps`, paper §B.2): prompt chunks of requests admitted or restored while
others decode run in the decoding requests' verify forward. Greedy outputs equal dense `generate` and the lockstep
engine's; sampled outputs follow the dense distribution (G-test), and the same test rejects the unverified drafter.

Every test counts the mixed steps that packed prompt chunks, so none passes without exercising them."""

from __future__ import annotations

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.draft_policy import ScriptedDraftLength
from s3r_hf.engine.mixed_step import MixedStep
from s3r_hf.engine.scheduler import Scheduler
from tests.conftest import left_padded_batch, tiny_model
from tests.exact_distribution import (
    count_continuations,
    exact_continuation_distribution,
    g_test,
    sampling_warpers,
    tiny_enumerable_model,
)


@pytest.fixture
def mixed_steps(monkeypatch) -> dict[str, int]:
    """Mixed steps that packed prompt chunks, summed over the calls of a test."""
    counted = {"steps": 0}
    run = MixedStep.run

    def counting(step, *args):
        before = step.steps
        run(step, *args)
        counted["steps"] += step.steps - before

    monkeypatch.setattr(MixedStep, "run", counting)
    return counted


# Ten prompts of different lengths queue for three slots; chunks of 16 tokens spread the longer prompts over several
# steps, so prompts are prefilled while the others decode. Tokens 28 and 152 end several rows early (EOS).
PROMPTS = [5, 17, 9, 23, 12, 30, 7, 19, 14, 26]
QUEUE = dict(draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, concurrency_min=3, concurrency_max=3,
             prefill_chunk_size=16, admission_sigmas=None)
# Pages of 4 tokens: fewer than three requests at full length, and admissions take whatever fits now (`QUEUE`), so
# requests are paused and restored.
SMALL_POOL = 20


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("num_pages", [None, SMALL_POOL])
@pytest.mark.parametrize("refresh_interval", [1, 2])
def test_greedy_equals_dense_and_lockstep_with_arrivals(adaptive, num_pages, refresh_interval, mixed_steps,
                                                        view_checks):
    model = s3r_hf.enable(tiny_model("llama", seed=31))
    input_ids, attention_mask = left_padded_batch(PROMPTS, seed=32)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30, pad_token_id=0,
                  eos_token_id=[28, 152])
    dense = model.generate(input_ids, **kwargs)
    config = dict(QUEUE, adaptive=adaptive, num_pages=num_pages, refresh_interval=refresh_interval)
    mixed = model.generate(input_ids, s3r_config=S3RConfig(**config, mixed_steps=True), return_dict_in_generate=True,
                           **kwargs)
    packed = mixed_steps["steps"]
    assert packed > 0
    lockstep = model.generate(input_ids, s3r_config=S3RConfig(**config), **kwargs)
    assert mixed_steps["steps"] == packed  # the lockstep engine (the default) ran no mixed step
    assert torch.equal(mixed.sequences, dense)
    assert torch.equal(mixed.sequences, lockstep)
    generated = dense[:, input_ids.shape[1]:]
    ended = [(row == 28) | (row == 152) for row in generated]
    assert 2 <= sum(bool(e.any()) for e in ended) < len(PROMPTS), "EOS should end some rows early, not all"
    if num_pages == SMALL_POOL:
        assert mixed.s3r_stats.offload_episodes > 0


def test_greedy_equals_dense_when_dense_steps_precede_mixed_steps(mixed_steps):
    """Draft lengths that vary by script: dense steps (whose successor is launched early, then run again inside a
    mixed step), refresh steps and drafting rounds all meet arriving prompts."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=5))
    input_ids, attention_mask = left_padded_batch(PROMPTS, seed=6)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    dense = model.generate(input_ids, **kwargs)
    policy = ScriptedDraftLength([0, 0, 3, 1, 0, 2])
    out = model.generate(input_ids, s3r_config=S3RConfig(**QUEUE, num_pages=SMALL_POOL, mixed_steps=True),
                         s3r_draft_policy=policy, **kwargs)
    assert torch.equal(out, dense)
    assert mixed_steps["steps"] > 0 and policy.rounds >= 12


@pytest.mark.parametrize("mode, policy, num_pages", [("ar", None, None), ("ar", None, SMALL_POOL),
                                                     ("s3r", [0, 0, 0, 0, 0, 2], None)])
def test_prompts_run_beside_a_dense_step_launched_early(mode, policy, num_pages, mixed_steps):
    """In the dense regime the step's dense forward was launched behind the step before; a mixed step then runs it
    and the prompt chunks in a forward of their own, instead of packing them into a forward that decodes every row
    again. Both kinds of mixed step run, and the output equals dense decoding and the lockstep engine's."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=5))
    input_ids, attention_mask = left_padded_batch(PROMPTS, seed=6)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=24, pad_token_id=0, s3r_mode=mode)
    dense = model.generate(input_ids, **{k: v for k, v in kwargs.items() if k != "s3r_mode"})
    config = dict(QUEUE, num_pages=num_pages)

    def run(**extra):
        scripted = {"s3r_draft_policy": ScriptedDraftLength(policy)} if policy else {}
        return model.generate(input_ids, s3r_config=S3RConfig(**config, **extra), return_dict_in_generate=True,
                              **scripted, **kwargs)

    mixed, lockstep = run(mixed_steps=True), run()
    stats = mixed.s3r_stats
    assert stats.mixed_steps_beside_queued > 0 and stats.mixed_steps_packed > 0
    assert stats.mixed_steps_beside_queued + stats.mixed_steps_packed == mixed_steps["steps"]
    assert torch.equal(mixed.sequences, dense)
    assert torch.equal(lockstep.sequences, dense)


def test_greedy_equals_dense_when_a_request_is_paused_mid_prompt(mixed_steps, monkeypatch):
    """Long prompts in chunks of 8 tokens and a pool of 24 pages: a round needs room while a prompt is half
    prefilled, so that request is paused (offloaded) and restored, and prefills on from where it stopped."""
    paused_mid_prompt = []
    make_room = Scheduler.make_room_for_round

    def watching(scheduler, requests, draft_count):
        prefilling = [r for r in scheduler.running if r.prefilled < r.prompt_len]
        make_room(scheduler, requests, draft_count)
        paused_mid_prompt.extend(r for r in prefilling if r.offloaded is not None)

    monkeypatch.setattr(Scheduler, "make_room_for_round", watching)
    model = s3r_hf.enable(tiny_model("llama", seed=31))
    input_ids, attention_mask = left_padded_batch([40, 8, 50, 12, 45, 9, 38, 10], seed=7)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30, pad_token_id=0)
    dense = model.generate(input_ids, **kwargs)
    # Admissions take whatever fits now (`admission_sigmas=None`), so that the prompts outgrow the pool.
    config = dict(QUEUE, concurrency_min=4, concurrency_max=4, prefill_chunk_size=8, num_pages=24, adaptive=False,
                  utilization_low=1.0, utilization_high=1.0)
    out = model.generate(input_ids, s3r_config=S3RConfig(**config, mixed_steps=True), **kwargs)
    assert torch.equal(out, dense)
    assert mixed_steps["steps"] > 0 and paused_mid_prompt


# The sampled test of test_exactness_sampling.py, with arrivals: 5,000 requests per call queue for 256 slots and a
# pool of 1,024 pages, and 32 prompts are prefilled per step (768 tokens), so most prompts run in mixed steps next to
# decoding requests. One call computes each identical prompt once (`share_prompts`), the other prefills every one:
# then an admission wave spreads over several steps, and its responses end in different rounds even when every draft
# is committed (the unverified drafter), so later arrivals meet decoding requests in that mode too.
VOCAB, PROMPT_LEN, NEW_TOKENS = 8, 24, 4
ARRIVALS = dict(adaptive=False, draft_len=2, budget_ratio=0.05, min_budget=1, page_size=4, num_pages=1024,
                concurrency_min=256, concurrency_max=256, prefill_chunk_size=32 * PROMPT_LEN, mixed_steps=True)


@pytest.fixture(scope="module")
def enumerable():
    model = s3r_hf.enable(tiny_enumerable_model(VOCAB, seed=0, attention_gain=8.0, output_gain=8.0))
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(100))
    probs, _ = exact_continuation_distribution(model, prompt, NEW_TOKENS, sampling_warpers(temperature=1.0))
    return model, prompt, probs


def _sample_with_arrivals(
    model, prompt, calls: tuple[tuple[int, bool], ...], rows: int, mode: str
) -> torch.Tensor:
    """`rows` samples per call, each call a `(seed, share_prompts)`."""
    sequences = []
    for seed, share_prompts in calls:
        config = S3RConfig(**ARRIVALS, share_prompts=share_prompts, seed=seed)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0,
                             max_new_tokens=NEW_TOKENS, num_return_sequences=rows, return_dict_in_generate=True,
                             s3r_config=config, s3r_mode=mode)
        sequences.append(out.sequences)
    return torch.cat(sequences)


def _g_tests(sequences: torch.Tensor, probs: torch.Tensor) -> dict[str, dict]:
    counts = count_continuations(sequences, PROMPT_LEN, VOCAB, NEW_TOKENS)
    return {"joint4": g_test(counts, probs), "first3": g_test(counts.sum(dim=-1), probs.sum(dim=-1))}


def test_sampled_output_follows_the_dense_distribution_with_arrivals(enumerable, mixed_steps):
    model, prompt, probs = enumerable
    sequences = _sample_with_arrivals(model, prompt, calls=((21, True), (22, False)), rows=5_000, mode="s3r")
    assert mixed_steps["steps"] >= 100
    results = _g_tests(sequences, probs)
    p_values = ", ".join(f"{name} p={result['p_value']:.3g}" for name, result in results.items())
    print(f"\nmixed steps {mixed_steps['steps']}: {p_values}")
    for result in results.values():
        assert result["impossible"] == 0 and result["dof"] >= 40, result
        assert result["p_value"] > 1e-3, result


def test_unverified_drafts_are_rejected_with_arrivals(enumerable, mixed_steps):
    """Power check: the same test tells the sparse drafter's own distribution from the dense one. Prompts are not
    shared here: with shared prompts an admission wave prefills in one step, and since the unverified drafter commits
    every draft all of its responses end in the same round, so no arrival would meet a decoding request."""
    model, prompt, probs = enumerable
    sequences = _sample_with_arrivals(model, prompt, calls=((21, False),), rows=2_500, mode="unverified")
    assert mixed_steps["steps"] > 0
    results = _g_tests(sequences, probs)
    print("\nunverified: " + ", ".join(f"{n} p={r['p_value']:.3g}" for n, r in results.items()))
    for result in results.values():
        assert result["p_value"] < 1e-6, result
