"""Sampled S3R over long generations keeps dense sampling's token statistics (two-sample tests against dense).

`test_exactness_sampling.py` enumerates the exact distribution of 4-token continuations, which a round or two of
drafting produce. A rollout's response runs for hundreds of rounds: index views refreshed, extended between
refreshes and aged, draft lengths switched by the rule, pages crossed. No distribution of 160 tokens can be
enumerated, so this compares samples with samples: dense `generate` draws 1,000 continuations of a prompt and
S3R draws 1,000 more, and for every token and every pair of consecutive tokens the per-row frequency over
positions 40-159 is compared between the two (Welch's t-test per statistic over independent rows, Bonferroni over
the 8 + 64 statistics). S3R must not differ (p > 0.001); the sparse drafter's own tokens (`s3r_mode="unverified"`)
must (p < 1e-6), so the tests can tell the drafter from the model over long generations.

The model is the G-test's tiny Llama with peaky attention (8 tokens, no EOS), views of 5% of the context (2-8
positions), so the drafter is strongly biased. Seeds are fixed, so the outcome is deterministic. On a GPU machine
(`S3R_HF_TEST_DEVICE=cuda`) both sides sample on CUDA, S3R with CUDA graphs.
"""

from __future__ import annotations

import os

import pytest
import torch
from scipy import stats

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.draft_policy import AdaptiveDraftLength, ScriptedDraftLength
from tests.exact_distribution import tiny_enumerable_model

VOCAB = 8
PROMPT_LEN = 24
NEW_TOKENS = 160
FIRST = 40  # statistics over positions FIRST.. of the continuation, well past the first refreshes
ROWS = 1_000
DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
VIEWS = dict(budget_ratio=0.05, min_budget=2, page_size=4, cuda_graphs=DEVICE.type == "cuda")


CASES = {
    # The paper's fixed k, views refreshed every third round and extended in between.
    "fixed-k4-refresh3": dict(config=dict(adaptive=False, draft_len=4, refresh_interval=3)),
    # The adaptive rule with a middle length and refresh intervals of its own choosing, fed fixed costs (for this tiny
    # model the true rule would mostly decode densely): it switches between dense steps, probes and drafting rounds of
    # both lengths, and refreshes the views every round or less often.
    "adaptive-0-2-4": dict(
        config=dict(draft_len=4, adaptive_draft_lengths=(0, 2, 4)),
        policy=lambda: FixedCosts(
            4, lengths=(0, 2, 4), min_probe_gap=4, probe_budget=1.0, refresh_intervals=(1, 2, 3)
        ),
    ),
}


class FixedCosts(AdaptiveDraftLength):
    """The adaptive rule fed fixed costs instead of measured ones, so that the lengths and refresh intervals it chooses
    (which the test checks it went through) do not depend on how busy the machine is: a dense step 1 ms, a drafting
    round of `k` tokens 0.1 ms x (1 + 2k), a refresh 0.05 ms more."""

    def observe_cost(self, shape, draft_len, seconds, refreshes=True, follows_refresh=True):
        fixed = 1e-3 if draft_len == 0 else 1e-4 * (1 + 2 * draft_len) + (5e-5 if refreshes else 0.0)
        super().observe_cost(shape, draft_len, fixed, refreshes, follows_refresh)


@pytest.fixture(scope="module")
def setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 64-wide matrices: more threads buy nothing on a busy CI machine
    model = s3r_hf.enable(tiny_enumerable_model(VOCAB, seed=0, attention_gain=8.0, output_gain=4.0).to(DEVICE))
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(100)).to(DEVICE)
    dense = _generate(model, prompt, seed=1)
    yield model, prompt, dense
    torch.set_num_threads(threads)


def _generate(model, prompt, seed: int, config: dict | None = None, mode: str = "s3r", policy=None):
    """`ROWS` sampled continuations (`[ROWS, NEW_TOKENS]`): dense `generate` without `config`, else S3R; with S3R
    also the call's stats."""
    torch.manual_seed(seed)
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=NEW_TOKENS,
                  num_return_sequences=ROWS)
    if config is None:
        return model.generate(prompt, **kwargs)[:, PROMPT_LEN:].cpu()
    out = model.generate(prompt, s3r_config=S3RConfig(**VIEWS, **config, seed=seed), s3r_mode=mode,
                         s3r_draft_policy=policy, return_dict_in_generate=True, **kwargs)
    return out.sequences[:, PROMPT_LEN:].cpu(), out.s3r_stats


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    """Per row, the frequency of each token and of each pair of consecutive tokens over positions `FIRST..`:
    `[rows, V + V * V]`."""
    late = tokens[:, FIRST:]
    pairs = late[:, :-1] * VOCAB + late[:, 1:]
    unigrams = torch.stack([(late == v).float().mean(1) for v in range(VOCAB)], 1)
    bigrams = torch.stack([(pairs == v).float().mean(1) for v in range(VOCAB * VOCAB)], 1)
    return torch.cat([unigrams, bigrams], 1)


def _p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Bonferroni-corrected smallest p-value of Welch's t-tests of each statistic between two sets of rows."""
    fa, fb = _frequencies(a).double().numpy(), _frequencies(b).double().numpy()
    tested = [j for j in range(fa.shape[1]) if fa[:, j].std() + fb[:, j].std() > 0]
    p_values = [stats.ttest_ind(fa[:, j], fb[:, j], equal_var=False).pvalue for j in tested]
    return min(1.0, min(p_values) * len(tested))


@pytest.mark.parametrize("case", list(CASES))
def test_long_s3r_generations_keep_the_dense_token_statistics(setup, case):
    model, prompt, dense = setup
    policy = CASES[case].get("policy", lambda: None)()
    tokens, stats_ = _generate(model, prompt, seed=3, config=CASES[case]["config"], policy=policy)
    p_value = _p_value(dense, tokens)
    print(f"\n[{case}] p = {p_value:.3g}, drafted {stats_.drafted}, accepted {stats_.accepted}")
    assert p_value > 1e-3, f"S3R's long generations differ from dense sampling (p = {p_value:.3g})"
    # The generations drafted throughout: many rounds per row, drafts rejected often enough to matter.
    assert stats_.drafted > 20 * ROWS and 0 < stats_.accepted < stats_.drafted
    if policy is not None:
        assert {0, 2, 4} <= set(policy.choices) and set(policy.interval_choices) - {1}


def test_the_unverified_drafter_over_long_generations_is_rejected(setup):
    """Power check: the same test tells the sparse drafter's own long generations from dense ones."""
    model, prompt, dense = setup
    tokens, _ = _generate(model, prompt, seed=4, config=dict(adaptive=False, draft_len=4), mode="unverified")
    p_value = _p_value(dense, tokens)
    assert p_value < 1e-6, f"the test cannot tell the drafter from the model (p = {p_value:.3g})"


# ---------------------------------------------------------------- response lengths: the EOS path under sampling
# The tests above (and the G-tests) have no EOS. An RL rollout's responses end on EOS, and a round can end a response
# anywhere in its block: an accepted EOS draft, a correction or bonus token that is EOS, or a rejection just before
# one. Any error there shows as a different length distribution. The model here has 64 tokens, token 5 as EOS (about
# 1.2% a position, so responses average ~84 tokens and a fifth reach the cap); the drafter's EOS rate differs enough
# that its responses average ~72 tokens.
EOS_VOCAB, EOS_TOKEN, EOS_ROWS = 64, 5, 2_000


@pytest.fixture(scope="module")
def eos_setup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = s3r_hf.enable(tiny_enumerable_model(EOS_VOCAB, seed=0, attention_gain=8.0, output_gain=2.0).to(DEVICE))
    prompt = torch.randint(0, EOS_VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(100)).to(DEVICE)
    yield model, prompt, _lengths(model, prompt, seed=1)[0]
    torch.set_num_threads(threads)


def _lengths(model, prompt, seed: int, config: dict | None = None, mode: str = "s3r", policy=None):
    """Response lengths (EOS included) of `EOS_ROWS` sampled responses, and the call's `S3RStats` (None for dense
    `generate`, which runs without `config`)."""
    torch.manual_seed(seed)
    kwargs = dict(attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=NEW_TOKENS,
                  num_return_sequences=EOS_ROWS, eos_token_id=EOS_TOKEN, pad_token_id=EOS_TOKEN,
                  return_dict_in_generate=True)
    if config is not None:
        kwargs.update(s3r_config=S3RConfig(**VIEWS, **config, seed=seed), s3r_mode=mode, s3r_draft_policy=policy)
    out = model.generate(prompt, **kwargs)
    responses = out.sequences[:, PROMPT_LEN:].cpu()
    ended = responses == EOS_TOKEN  # the pad is EOS too: the first EOS ends a response
    first_eos = ended.float().argmax(1) + 1
    lengths = torch.where(ended.any(1), first_eos, torch.full_like(first_eos, responses.shape[1]))
    return lengths.double().numpy(), getattr(out, "s3r_stats", None)


def _lengths_p_value(a, b) -> float:
    """Bonferroni over two tests of two samples of lengths: Welch's t on the mean, Mann-Whitney on the ranks."""
    p_values = (stats.ttest_ind(a, b, equal_var=False).pvalue, stats.mannwhitneyu(a, b).pvalue)
    return min(1.0, 2 * min(p_values))


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_s3r_keeps_the_dense_response_lengths(eos_setup, case):
    model, prompt, dense = eos_setup
    policy = CASES[case].get("policy", lambda: None)()
    lengths, stats_ = _lengths(model, prompt, seed=3, config=CASES[case]["config"], policy=policy)
    p_value = _lengths_p_value(dense, lengths)
    print(f"\n[{case}] mean length {lengths.mean():.1f} (dense {dense.mean():.1f}), p = {p_value:.3g}, "
          f"drafted {stats_.drafted}, accepted {stats_.accepted}")
    assert p_value > 1e-3, f"S3R's responses end at other lengths than dense sampling's (p = {p_value:.3g})"
    # Both ends of a response are exercised (EOS and the cap), and the responses were drafted throughout.
    assert 0.05 < (dense == NEW_TOKENS).mean() < 0.5
    assert stats_.drafted > 5 * EOS_ROWS and 0 < stats_.accepted < stats_.drafted
    if policy is not None:
        assert {0, 4} <= set(policy.choices)  # the rule switched between dense steps and drafting rounds


def test_the_unverified_drafter_response_lengths_are_rejected(eos_setup):
    """Power check: the same test tells the sparse drafter's response lengths from dense ones."""
    model, prompt, dense = eos_setup
    lengths, _ = _lengths(model, prompt, seed=4, config=dict(adaptive=False, draft_len=4), mode="unverified")
    p_value = _lengths_p_value(dense, lengths)
    print(f"\n[unverified] mean length {lengths.mean():.1f} (dense {dense.mean():.1f}), p = {p_value:.3g}")
    assert p_value < 1e-6, f"the test cannot tell the drafter's lengths from the model's (p = {p_value:.3g})"


# Requests arriving as others end (2,000 responses through 128 slots), mixed steps on, and a draft-length script
# that is mostly dense steps, as the adaptive rule is where drafting does not pay: arrivals then meet dense steps
# launched early, and their prompts run beside them (`engine/mixed_step.py`); others are packed into the round.
ARRIVALS = dict(adaptive=False, draft_len=4, mixed_steps=True, concurrency_min=128, concurrency_max=128)
MOSTLY_DENSE = [0, 0, 0, 4]


def test_sampled_mixed_steps_keep_the_dense_response_lengths(eos_setup):
    model, prompt, dense = eos_setup
    lengths, stats_ = _lengths(model, prompt, seed=5, config=ARRIVALS, policy=ScriptedDraftLength(MOSTLY_DENSE))
    p_value = _lengths_p_value(dense, lengths)
    print(f"\n[mixed steps] mean length {lengths.mean():.1f} (dense {dense.mean():.1f}), p = {p_value:.3g}, "
          f"packed {stats_.mixed_steps_packed}, beside a queued step {stats_.mixed_steps_beside_queued}")
    assert p_value > 1e-3, f"S3R's responses end at other lengths than dense sampling's (p = {p_value:.3g})"
    assert stats_.mixed_steps_beside_queued > 0 and stats_.mixed_steps_packed > 0
    assert stats_.drafted > 5 * EOS_ROWS and 0 < stats_.accepted < stats_.drafted


def test_the_unverified_drafter_response_lengths_are_rejected_with_mixed_steps(eos_setup):
    """Power check of the test above, in its configuration."""
    model, prompt, dense = eos_setup
    lengths, stats_ = _lengths(model, prompt, seed=6, config=ARRIVALS, policy=ScriptedDraftLength(MOSTLY_DENSE),
                               mode="unverified")
    p_value = _lengths_p_value(dense, lengths)
    print(f"\n[unverified, mixed steps] mean length {lengths.mean():.1f} (dense {dense.mean():.1f}), p = {p_value:.3g}")
    assert stats_.mixed_steps_packed > 0
    assert p_value < 1e-6, f"the test cannot tell the drafter's lengths from the model's (p = {p_value:.3g})"
