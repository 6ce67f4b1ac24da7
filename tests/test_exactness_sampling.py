"""Sampled S3R continuations follow the exact dense distribution (G-test against full enumeration).

A tiny random model with an 8-token vocabulary lets us enumerate every 4-token continuation of a prompt and
compute its exact probability under dense sampling (temperature / top-k / top-p applied by transformers' own
warpers, in `generate`'s order). S3R then draws 10,000 samples, and a G-test compares their counts with the
exact distribution; it must not reject (p > 0.001).

What the samples exercise: the first generated token comes from the dense prefill; with `max_new_tokens=4`
and `draft_len=2`, the first round drafts tokens 2 and 3 with sparse attention and takes token 4 as the
bonus, so chained acceptance (draft 2 judged only after draft 1 was accepted), residual sampling at both
draft positions, the bonus token and, after an early rejection, a second round drafting over a refreshed index
view all contribute. Attention is made peaky and the index view holds 1–2 of ~25 positions, so the sparse
drafter really differs from the dense model: drafts are rejected often (acceptance ~0.5–0.65).

Power: the same test applied to the sparse drafter's own tokens (`s3r_mode="unverified"`, what a plain
sparse rollout samples) must reject (p < 1e-6), so a bug that lets drafter bias through would be caught.
Fixed seeds make the outcome deterministic. Calibration (not run here): 12 seeds x 5,000 samples per case gave
per-seed p-values spread over (0.01, 0.99) and pooled 60,000-sample p-values of 0.16-0.69, i.e. no bias
visible at six times this test's sample size.

Each test also runs with 8-bit draft weights (`S3RConfig.draft_weights`, a scale per output feature and per group),
which change only the proposals.

On a GPU machine, `S3R_HF_TEST_DEVICE=cuda python -m pytest tests/test_exactness_sampling.py` samples on CUDA
with the Triton kernels, eagerly, with CUDA graphs (the graphed draft phase samples from pre-drawn noise), and
with graphs of compiled decoder layers (`compile_layers`), with the model's own and with 8-bit draft weights;
the exact distribution is still enumerated on the CPU.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.draft_policy import ScriptedDraftLength
from tests.exact_distribution import (
    count_continuations,
    exact_continuation_distribution,
    g_test,
    most_common,
    sampling_warpers,
    tiny_enumerable_model,
)

VOCAB = 8
PROMPT_LEN = 24
NEW_TOKENS = 4  # tested: the joint of all 4 tokens, and the 3-token marginal of the first three
S3R_SAMPLES = 10_000
CHUNK = 5_000  # num_return_sequences per generate call
# The drafter's bias is large: at 2,500 samples its G statistics are ~1,000–7,700 against a p = 1e-6 threshold
# near G ~ 180, so fewer samples than for S3R suffice (and fewer samples only make the power check harder).
UNVERIFIED_SAMPLES = 2_500
# Budget ~5% of the context, at least one position: 1–2 positions per (layer, KV head) for a ~25-token context.
S3R = dict(adaptive=False, draft_len=2, budget_ratio=0.05, min_budget=1, page_size=4)

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
# How the engine runs its forwards: eagerly; replaying CUDA graphs; replaying graphs of compiled decoder layers.
RUNTIMES = {
    "eager": {},
    "graphs": {"cuda_graphs": True},
    # float32 draft passes in full float32, and on TF32 tensor cores (the default, which the two runtimes above
    # use too on CUDA): the proposal changes, the verify stays float32.
    "graphs+compile": {"cuda_graphs": True, "compile_layers": True, "draft_matmul_precision": "highest"},
    "graphs+compile+tf32-drafts": {"cuda_graphs": True, "compile_layers": True, "draft_matmul_precision": "high"},
    # 8-bit copies of the layers' weights in the draft passes (`S3RConfig.draft_weights`): again the proposal changes
    "int8-drafts": {"draft_weights": "int8"},
    "int8-g64-drafts": {"draft_weights": "int8-g64"},  # a scale per 64 weights along a row
    "graphs+compile+int8-drafts": {"cuda_graphs": True, "compile_layers": True, "draft_weights": "int8"},
    "graphs+compile+int8-g64-drafts": {"cuda_graphs": True, "compile_layers": True, "draft_weights": "int8-g64"},
}
GRAPHS = list(RUNTIMES) if DEVICE.type == "cuda" else ["eager", "int8-drafts", "int8-g64-drafts"]

CASES = {
    "t1.0": dict(temperature=1.0, top_k=None, top_p=None),
    "t0.7-k5-p0.9": dict(temperature=0.7, top_k=5, top_p=0.9),
}


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """One intra-op thread: this model's matrices are 64 wide, so more threads buy nothing, while OpenMP threads
    on a busy CI machine (other pytest workers) spin against each other and slow the module down ~10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    """The model (on the CPU, where the exact distribution is enumerated), its copy on `DEVICE`, the prompt."""
    model = s3r_hf.enable(tiny_enumerable_model(VOCAB, seed=0, attention_gain=8.0, output_gain=8.0))
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(100))
    sampler = model if DEVICE.type == "cpu" else s3r_hf.enable(copy.deepcopy(model).to(DEVICE))
    return model, sampler, prompt


def _sample(
    model, prompt, sampling: dict, samples: int, seed: int, unverified: bool = False, graphs: str = "eager",
    refresh_interval: int = 1, policy=None,
):
    """`samples` continuations drawn in chunks of `CHUNK` rows; returns (sequences, drafted, accepted, per-position)."""
    prompt = prompt.to(model.device)
    sequences, drafted, accepted = [], 0, 0
    position_drafted, position_accepted = [0] * S3R["draft_len"], [0] * S3R["draft_len"]
    for chunk, start in enumerate(range(0, samples, CHUNK)):
        rows = min(CHUNK, samples - start)
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            max_new_tokens=NEW_TOKENS,
            num_return_sequences=rows,
            return_dict_in_generate=True,
            s3r_config=S3RConfig(**S3R, seed=seed + chunk, refresh_interval=refresh_interval, **RUNTIMES[graphs]),
            s3r_mode="unverified" if unverified else "s3r",
            s3r_draft_policy=policy,
            **sampling,
        )
        sequences.append(out.sequences.cpu())
        stats = out.s3r_stats
        # Every row has the same prompt: all but one per prefill step copy it (`S3RConfig.share_prompts`), so the
        # distribution tested is the one with shared prompts.
        assert stats.shared_prompt_tokens > 0
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
        for i, (d, a) in enumerate(zip(stats.position_drafted, stats.position_accepted)):
            position_drafted[i] += d
            position_accepted[i] += a
    return torch.cat(sequences), drafted, accepted, position_drafted, position_accepted


def _tests(sequences, probs):
    """G-tests of the full 4-token joint and of the 3-token marginal (first three generated tokens)."""
    counts = count_continuations(sequences, PROMPT_LEN, VOCAB, NEW_TOKENS)
    return {
        "joint4": g_test(counts, probs),
        "first3": g_test(counts.sum(dim=-1), probs.sum(dim=-1)),
    }, counts


def _describe(results, counts, probs) -> str:
    lines = [
        f"{name}: G={r['statistic']:.1f} dof={r['dof']} p={r['p_value']:.3g} TV={r['total_variation']:.3f} "
        f"impossible={r['impossible']}"
        for name, r in results.items()
    ]
    expected = [(o, round(float(probs[o]) * int(counts.sum()), 1)) for o, _ in most_common(counts)]
    lines.append(f"most common observed: {most_common(counts)}; expected counts there: {expected}")
    return "\n".join(lines)


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("case", list(CASES))
# refresh_interval 2: the first round verifies without scores and extends the prefill's index views with its
# tokens instead of refreshing them; a second round drafts over those extended views.
@pytest.mark.parametrize("refresh_interval", [1, 2])
def test_s3r_samples_follow_exact_dense_distribution(setup, case, graphs, refresh_interval):
    model, sampler, prompt = setup
    sampling = CASES[case]
    probs, top_p_margin = exact_continuation_distribution(model, prompt, NEW_TOKENS, sampling_warpers(**sampling))
    assert abs(float(probs.sum()) - 1.0) < 1e-9
    # Top-p cutoffs must not hinge on float rounding (S3R's paged kernels and the plain forward differ ~1e-6).
    assert top_p_margin > 1e-5, f"a top-p cutoff is within {top_p_margin:.2g} of its threshold; change the seed"

    sequences, drafted, accepted, position_drafted, position_accepted = _sample(
        sampler, prompt, sampling, S3R_SAMPLES, seed=1, graphs=graphs, refresh_interval=refresh_interval
    )
    assert sequences.shape == (S3R_SAMPLES, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(sequences[:, :PROMPT_LEN], prompt.expand(S3R_SAMPLES, -1))
    results, counts = _tests(sequences, probs)
    message = _describe(results, counts, probs)
    print(
        f"\n[{case}, {DEVICE.type}, {graphs}, refresh every {refresh_interval}] "
        f"S3R acceptance {accepted}/{drafted} = {accepted / drafted:.3f}, "
        f"per position "
        f"{[f'{a}/{d}' for a, d in zip(position_accepted, position_drafted)]}\n{message}"
    )
    for name, result in results.items():
        assert result["impossible"] == 0, f"S3R sampled outcomes the dense model cannot produce ({name})\n{message}"
        assert result["dof"] >= 40, f"too few cells for a meaningful test ({name})\n{message}"
        assert result["p_value"] > 1e-3, f"S3R samples are not distributed as dense sampling ({name})\n{message}"

    # The drafter really disagrees with the dense model: rejections and acceptances at both draft positions.
    rate = accepted / drafted
    assert 0.05 < rate < 0.95, f"acceptance rate {rate:.3f} ({accepted}/{drafted})"
    for position, (d, a) in enumerate(zip(position_drafted, position_accepted)):
        assert 0 < a < d, f"draft position {position}: {a} of {d} accepted"


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("case", list(CASES))
def test_s3r_samples_stay_exact_when_the_draft_length_varies(setup, case, graphs):
    """Adaptive speculation's claim: any draft length and refresh chosen before a round from what earlier rounds did
    keep the samples exact. The policy switches between dense steps (which leave the views stale), refresh steps,
    and rounds of one and two drafts that refresh the views or only extend them, so samples mix all of them."""
    model, sampler, prompt = setup
    sampling = CASES[case]
    probs, _ = exact_continuation_distribution(model, prompt, NEW_TOKENS, sampling_warpers(**sampling))
    policy = ScriptedDraftLength([0, 2, 1, 0, 0, 2], refreshes=[False, True, False, False, True])
    sequences, drafted, accepted, *_ = _sample(sampler, prompt, sampling, S3R_SAMPLES, seed=7, graphs=graphs,
                                               policy=policy)
    results, counts = _tests(sequences, probs)
    message = _describe(results, counts, probs)
    print(f"\n[{case}, {DEVICE.type}, {graphs}, varying k] acceptance {accepted}/{drafted}\n{message}")
    for name, result in results.items():
        assert result["impossible"] == 0, f"S3R sampled outcomes the dense model cannot produce ({name})\n{message}"
        assert result["p_value"] > 1e-3, f"S3R samples are not distributed as dense sampling ({name})\n{message}"
    assert 0 < accepted < drafted and policy.rounds >= 6


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("case", list(CASES))
def test_unverified_sparse_drafts_are_rejected(setup, case, graphs):
    """Power check: the identical test must tell the sparse drafter's own distribution from the dense one."""
    model, sampler, prompt = setup
    sampling = CASES[case]
    probs, _ = exact_continuation_distribution(model, prompt, NEW_TOKENS, sampling_warpers(**sampling))
    sequences, *_ = _sample(sampler, prompt, sampling, UNVERIFIED_SAMPLES, seed=1, unverified=True, graphs=graphs)
    results, counts = _tests(sequences, probs)
    # Power must not rest on top-k/top-p alone: the drafter also samples tokens the dense warpers remove, but the
    # test must reject even when those samples are dropped and only the shape over possible outcomes counts.
    counts = count_continuations(sequences, PROMPT_LEN, VOCAB, NEW_TOKENS)
    results["joint4-possible-only"] = g_test(counts, probs, exclude_impossible=True)
    results["first3-possible-only"] = g_test(counts.sum(dim=-1), probs.sum(dim=-1), exclude_impossible=True)
    message = _describe(results, counts, probs)
    print(f"\n[{case}] unverified drafts\n{message}")
    for name, result in results.items():
        assert result["p_value"] < 1e-6, f"the test failed to reject unverified sparse drafts ({name})\n{message}"
