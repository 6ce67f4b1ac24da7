"""Exact continuation distributions of tiny models, and a G-test of sampled continuations against them.

The exactness claim of S3R is distributional: every sampled response must follow the dense model's processed
distribution. With a vocabulary small enough to enumerate, the distribution of a short continuation can be
computed exactly (one dense forward per prefix) and the samples S3R draws can be tested against it.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.conftest import TINY


def tiny_enumerable_model(
    vocab_size: int = 8, seed: int = 0, attention_gain: float = 4.0, output_gain: float = 1.0, **overrides
) -> LlamaForCausalLM:
    """A random fp32 Llama small enough to enumerate continuations, with peaky attention.

    `attention_gain` multiplies the query and key projections (attention logits scale with its square), so each
    query concentrates on a few positions and a sparse index view of 1–2 positions really changes the
    drafter's output. `output_gain` multiplies the LM head (sharper next-token distributions). There is no EOS
    token: every row runs to `max_new_tokens`, so the continuation space is exactly `vocab_size ** length`.
    `overrides` change the config (the fused-layer tests need `head_dim=32`).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        **{
            **TINY,
            "vocab_size": vocab_size,
            "max_position_embeddings": 256,
            "bos_token_id": None,
            "eos_token_id": None,
            "tie_word_embeddings": False,
            **overrides,
        }
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(attention_gain)
            layer.self_attn.k_proj.weight.mul_(attention_gain)
        model.lm_head.weight.mul_(output_gain)
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def sampling_warpers(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """The warpers `generate(do_sample=True, ...)` builds, in transformers' order.

    `GenerationMixin._get_logits_processor` appends, for sampling: temperature (if != 1), top-k (if set and != 0),
    top-p (if < 1), each with `min_tokens_to_keep=1` for one beam.
    """
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


@torch.no_grad()
def exact_continuation_distribution(
    model: torch.nn.Module, prompt: torch.Tensor, length: int, warpers: LogitsProcessorList
) -> tuple[torch.Tensor, float]:
    """Exact probability of every `length`-token continuation of `prompt` under dense sampling.

    Returns `probs` of shape `[V] * length` (float64; `probs[a, b, c]` is P(continuation = a b c)) and the
    smallest relative margin by which any top-p cutoff decision cleared its threshold (`inf` without top-p), so
    callers can check that the result does not hinge on float rounding of logits. Each step runs one dense
    forward of the plain model over all `V ** step` prefixes; scores are the float32 logits passed through
    `warpers` (as `generate` does), then softmax.
    """
    prompt = prompt.reshape(-1)
    vocab = model.config.vocab_size
    probs = torch.ones(1, dtype=torch.float64)
    margin = math.inf
    top_p = next((w.top_p for w in warpers if isinstance(w, TopPLogitsWarper)), None)
    for step in range(length):
        prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=step)), dtype=torch.long)
        prefixes = prefixes.reshape(vocab**step, step)
        input_ids = torch.cat([prompt[None].expand(prefixes.shape[0], -1), prefixes], dim=1)
        logits = model(input_ids=input_ids).logits[:, -1].float()
        scores = warpers(input_ids, logits)
        if top_p is not None:
            margin = min(margin, _top_p_margin(warpers, input_ids, logits, top_p))
        next_probs = torch.softmax(scores.double(), dim=-1)  # [V**step, V]
        probs = (probs[:, None] * next_probs).reshape(-1)
    return probs.reshape([vocab] * length), margin


def _top_p_margin(warpers: LogitsProcessorList, input_ids, logits, top_p: float) -> float:
    """Smallest |cumulative mass - (1 - top_p)| at which TopPLogitsWarper decides (on its float32 input)."""
    before = LogitsProcessorList(w for w in warpers if not isinstance(w, TopPLogitsWarper))
    scores = before(input_ids, logits) if len(before) else logits
    sorted_logits, _ = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    finite = torch.isfinite(sorted_logits)
    gap = (cumulative - (1 - top_p)).abs().masked_fill(~finite, math.inf)
    return float(gap.min())


def count_continuations(sequences: torch.Tensor, prompt_len: int, vocab: int, length: int) -> torch.Tensor:
    """Counts `[V] * length` of the continuations in `sequences[:, prompt_len:prompt_len + length]`."""
    continuations = sequences[:, prompt_len : prompt_len + length]
    if continuations.shape[1] != length:
        raise AssertionError(f"expected {length} generated tokens per row, got {continuations.shape[1]}")
    flat = torch.zeros((), dtype=torch.long)
    for column in range(length):
        flat = flat * vocab + continuations[:, column]
    return torch.bincount(flat, minlength=vocab**length).reshape([vocab] * length)


def g_test(
    counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0, exclude_impossible: bool = False
) -> dict:
    """Likelihood-ratio (G) goodness-of-fit test of `counts` against the exact `probs`.

    Cells with an expected count below `min_expected` are pooled into one cell (merged into the smallest regular
    cell if the pool itself stays below `min_expected`); degrees of freedom = cells - 1. Samples in
    zero-probability outcomes (e.g. a token top-k removed) are counted in `impossible`; callers should require
    none for an exact sampler (the p-value only sees them through the pooled cell). `exclude_impossible=True`
    drops those samples first, testing only the shape of the distribution over possible outcomes.

    Returns a dict with `statistic`, `dof`, `p_value`, `cells`, `impossible` (samples in zero-probability
    outcomes) and `total_variation` (between the empirical and the exact distribution).
    """
    observed = counts.reshape(-1).double()
    expected_probs = probs.reshape(-1).double()
    impossible = int(observed[expected_probs == 0].sum())
    if exclude_impossible:
        observed = observed.masked_fill(expected_probs == 0, 0.0)
    total = float(observed.sum())
    expected = expected_probs * total
    regular = expected >= min_expected
    obs_cells = observed[regular].tolist()
    exp_cells = expected[regular].tolist()
    pooled_obs, pooled_exp = float(observed[~regular].sum()), float(expected[~regular].sum())
    if pooled_exp > 0 or pooled_obs > 0:
        if pooled_exp < min_expected and exp_cells:
            smallest = min(range(len(exp_cells)), key=exp_cells.__getitem__)
            obs_cells[smallest] += pooled_obs
            exp_cells[smallest] += pooled_exp
        else:
            obs_cells.append(pooled_obs)
            exp_cells.append(pooled_exp)
    statistic = 2.0 * sum(o * math.log(o / e) for o, e in zip(obs_cells, exp_cells) if o > 0)
    dof = len(obs_cells) - 1
    # Chi-square survival function: the regularized upper incomplete gamma Q(dof / 2, G / 2).
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    total_variation = 0.5 * float((observed / total - expected_probs).abs().sum())
    return {
        "statistic": statistic,
        "dof": dof,
        "p_value": p_value,
        "cells": len(obs_cells),
        "impossible": impossible,
        "total_variation": total_variation,
    }


def most_common(counts: torch.Tensor, top: int = 5) -> list[tuple[tuple[int, ...], int]]:
    """The `top` most frequent outcomes, for failure messages."""
    shape = counts.shape
    flat = Counter({i: int(c) for i, c in enumerate(counts.reshape(-1).tolist()) if c})
    return [(tuple(int(x) for x in torch.unravel_index(torch.tensor(i), shape)), c) for i, c in flat.most_common(top)]
