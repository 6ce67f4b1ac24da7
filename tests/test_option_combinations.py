"""Greedy S3R against dense `generate` over seeded random combinations of options.

The other tests vary one option at a time; here each case draws a model, a batch of prompts (some repeated, as GRPO
asks for several generations of a prompt) and a combination of `S3RConfig` and generation options: fixed or
adaptive `k`, draft lengths, view budgets, page sizes, prefill chunks, mixed stages, shared prompts, a capped
concurrency, a KV pool barely larger than a request, fused layers (their torch reference on a CPU), int8 draft
weights, EOS tokens, minimum lengths, penalties and banned words. Greedy decoding and point-mass sampling (`top_k=1`
or a tiny `top_p`, which sample the argmax through the sampling path) must give dense decoding's tokens in every
case."""

from __future__ import annotations

import random

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from tests.conftest import left_padded_batch, tiny_model

CASES = 48


def _case(index: int) -> tuple[str, int, list[int], dict, dict, dict]:
    rng = random.Random(index)
    kind, seed = rng.choice(["llama", "qwen3"]), rng.randrange(1000)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
    if rng.random() < 0.3:
        lengths = lengths[:1] * rng.randint(2, 4) + lengths[1:]
    page_size, draft_len, max_new = rng.choice([1, 2, 4, 8, 16]), rng.randint(1, 7), rng.randint(1, 30)
    config = dict(
        adaptive=rng.random() < 0.5, draft_len=draft_len, budget_ratio=rng.choice([0.05, 0.1, 0.3, 1.0]),
        min_budget=rng.choice([1, 2, 4, 16]), page_size=page_size, seed=rng.randrange(100),
        mixed_steps=rng.random() < 0.3, share_prompts=rng.random() < 0.7,
        prefill_chunk_size=rng.choice([2048, 16, 8, 5]), fused_layers=rng.random() < 0.3,
    )
    if not config["adaptive"] and rng.random() < 0.4:
        config["refresh_interval"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        config["concurrency_min"] = config["concurrency_max"] = rng.randint(1, 3)
    if rng.random() < 0.3:  # a pool that holds the longest request and little more: requests wait and are offloaded
        need = max(lengths) + max_new + draft_len + 1
        config["num_pages"] = -(-need // page_size) + rng.randint(0, 4)
    options = dict(max_new_tokens=max_new)
    if rng.random() < 0.5:
        options["eos_token_id"] = rng.sample(range(3, 256), rng.randint(1, 4))
    if rng.random() < 0.3:
        options["min_new_tokens"] = rng.randint(0, 10)
    if rng.random() < 0.3:
        options["repetition_penalty"] = rng.choice([1.1, 1.5])
    if rng.random() < 0.2:
        options["no_repeat_ngram_size"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        options["bad_words_ids"] = [[rng.randrange(3, 256)] for _ in range(3)]
    point_mass = rng.choice([dict(do_sample=False), dict(do_sample=True, top_k=1, temperature=rng.choice([0.7, 1.3])),
                             dict(do_sample=True, top_k=0, top_p=1e-6)])
    # Drawn last, so the draws above stay as they were; the fused layers read the model's linears and refuse it.
    if not config["fused_layers"] and rng.random() < 0.3:
        config["draft_weights"] = "int8"
    return kind, seed, lengths, config, options, point_mass


@pytest.mark.parametrize("index", range(CASES))
def test_a_random_combination_of_options_gives_dense_tokens(index):
    kind, seed, lengths, config, options, point_mass = _case(index)
    fusable = dict(head_dim=32) if config["fused_layers"] else {}  # the fused kernels need 32, 64 or 128
    model = s3r_hf.enable(tiny_model(kind, seed=seed, **fusable))
    input_ids, attention_mask = left_padded_batch(lengths, seed=seed)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, **options)
    out = model.generate(input_ids, attention_mask=attention_mask, s3r_config=S3RConfig(**config), **options,
                         **point_mass)
    assert torch.equal(out, dense), (kind, seed, lengths, config, options, point_mass)
    s3r_hf.release(model)


ASSISTED_CASES = 16
ASSISTED_OPTIONS = ("adaptive", "draft_len", "budget_ratio", "min_budget", "page_size", "seed")  # what the loop uses


@pytest.mark.parametrize("index", range(ASSISTED_CASES))
def test_a_random_combination_through_transformers_assisted_loop_gives_dense_tokens(index):
    """The same draws through `custom_generate=s3r_hf.assisted_generate` (one prompt, greedy): transformers' own
    assisted loop with S3R's drafts."""
    kind, seed, lengths, config, options, _ = _case(CASES + index)
    model = tiny_model(kind, seed=seed)
    input_ids, _ = left_padded_batch(lengths[:1], seed=seed)
    dense = model.generate(input_ids, do_sample=False, **options)
    config = S3RConfig(**{key: config[key] for key in ASSISTED_OPTIONS})
    out = model.generate(input_ids, do_sample=False, custom_generate=s3r_hf.assisted_generate, s3r_config=config,
                         **options)
    assert torch.equal(out, dense), (kind, seed, lengths[:1], config, options)
