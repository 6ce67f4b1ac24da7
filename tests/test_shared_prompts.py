"""Identical prompts prefilled once (`S3RConfig.share_prompts`): a request whose prompt another request is prefilling
waits for it, then copies its K/V pages and index views and samples its first token from its logits. Greedy outputs
equal dense `generate` in every arrangement (lockstep and mixed steps, KV pressure, prompts longer than a chunk,
whose copies wait for them, groups split by the concurrency limit); the sampled G-tests of test_exactness_sampling.py
run with shared prompts too (5,000 rows of one prompt)."""

from __future__ import annotations

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.cache.s3r_cache import S3RCache
from tests.conftest import left_padded_batch, tiny_model

BASE = dict(draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4)
GROUPS = [9, 17, 5, 30]  # prompt lengths; each prompt four times in a row, as GRPO asks for its generations


def _grouped_batch(lengths: list[int], copies: int = 4):
    input_ids, attention_mask = left_padded_batch(lengths, seed=1)
    return input_ids.repeat_interleave(copies, 0), attention_mask.repeat_interleave(copies, 0)


def _run(model, input_ids, attention_mask, **config):
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    dense = model.generate(input_ids, **kwargs)
    out = model.generate(input_ids, s3r_config=S3RConfig(**{**BASE, **config}), return_dict_in_generate=True,
                         **kwargs)
    return dense, out


@pytest.mark.parametrize("mixed_steps", [False, True])
@pytest.mark.parametrize("num_pages", [None, 30])  # 30 pages of 4 tokens: requests are paused and restored
def test_greedy_equals_dense_with_shared_prompts(mixed_steps, num_pages):
    model = s3r_hf.enable(tiny_model("llama", seed=3))
    input_ids, attention_mask = _grouped_batch(GROUPS)
    dense, out = _run(model, input_ids, attention_mask, mixed_steps=mixed_steps, num_pages=num_pages,
                      concurrency_min=6, concurrency_max=6, admission_sigmas=None)  # pauses wanted
    assert torch.equal(out.sequences, dense)
    stats = out.s3r_stats
    assert stats.shared_prompt_tokens > 0
    assert stats.prefill_tokens + stats.shared_prompt_tokens == 4 * sum(GROUPS)
    if num_pages is not None:
        assert stats.offload_episodes > 0


def test_without_sharing_every_prompt_is_computed_and_the_output_is_the_same():
    model = s3r_hf.enable(tiny_model("llama", seed=3))
    input_ids, attention_mask = _grouped_batch(GROUPS)
    dense, shared = _run(model, input_ids, attention_mask)
    _, computed = _run(model, input_ids, attention_mask, share_prompts=False)
    assert torch.equal(shared.sequences, dense) and torch.equal(computed.sequences, dense)
    assert computed.s3r_stats.shared_prompt_tokens == 0 and computed.s3r_stats.prefill_tokens == 4 * sum(GROUPS)
    # All sixteen requests run at once: one per prompt is computed.
    assert shared.s3r_stats.prefill_tokens == sum(GROUPS)


@pytest.mark.parametrize("mixed_steps", [False, True])
def test_followers_wait_for_a_leader_that_prefills_over_several_steps(mixed_steps):
    """The 30-token prompt takes four chunks of 8; its three copies wait, then copy it in the step that ends it."""
    model = s3r_hf.enable(tiny_model("llama", seed=3))
    input_ids, attention_mask = _grouped_batch([30, 6])
    dense, out = _run(model, input_ids, attention_mask, prefill_chunk_size=8, mixed_steps=mixed_steps)
    assert torch.equal(out.sequences, dense)
    assert out.s3r_stats.prefill_tokens == 30 + 6
    assert out.s3r_stats.shared_prompt_tokens == 3 * 30 + 3 * 6


def test_a_group_split_by_the_concurrency_limit_shares_within_each_step():
    model = s3r_hf.enable(tiny_model("llama", seed=3))
    input_ids, attention_mask = _grouped_batch([12], copies=5)
    # A limit of 2: the five requests run two, two and one at a time; each admission prefills its prompt once.
    dense, out = _run(model, input_ids, attention_mask, concurrency_min=2, concurrency_max=2)
    assert torch.equal(out.sequences, dense)
    assert out.s3r_stats.prefill_tokens + out.s3r_stats.shared_prompt_tokens == 5 * 12
    assert 0 < out.s3r_stats.shared_prompt_tokens < 4 * 12


def test_copy_prefix_copies_whole_pages_and_sets_lengths():
    config = tiny_model("llama").config
    cache = S3RCache(config, num_pages=16, page_size=4, max_requests=3)
    for layer in cache.layers:
        layer.keys.copy_(torch.randn(layer.keys.shape))
        layer.values.copy_(torch.randn(layer.values.shape))
    source, target, short = cache.add_request(), cache.add_request(), cache.add_request()
    cache.reserve(source, 10)
    cache.set_length(source, 10)
    cache.reserve(target, 12)
    cache.copy_prefix([(source, target)], 10)
    assert cache.lengths[target] == 10
    for layer in cache.layers:
        for pool in (layer.keys, layer.values):
            assert torch.equal(pool[cache.page_lists[target][:3]], pool[cache.page_lists[source][:3]])
    cache.reserve(short, 4)
    with pytest.raises(ValueError, match=r"slot 2: 1 pages reserved, 3 needed"):
        cache.copy_prefix([(source, short)], 10)


@pytest.mark.parametrize("mixed_steps", [False, True])
def test_a_request_admitted_later_copies_a_running_donors_prompt(mixed_steps):
    """Prompts X, Z, X under a limit of two: Z ends early at EOS, and the second X, admitted then, copies the first
    X's prompt (still running) but its last token, which it prefills alone."""
    model = s3r_hf.enable(tiny_model("llama", seed=3))
    pair_ids, pair_mask = left_padded_batch([14, 9], seed=4)
    free = model.generate(pair_ids, attention_mask=pair_mask, do_sample=False, max_new_tokens=24, pad_token_id=0)
    x_run, z_run = free[0, 14:].tolist(), free[1, 14:].tolist()
    eos = next(t for t in z_run[2:8] if t not in x_run)  # Z stops within its first tokens, X never
    input_ids, attention_mask = pair_ids[[0, 1, 0]], pair_mask[[0, 1, 0]]
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=24, pad_token_id=0, eos_token_id=eos)
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(**BASE, concurrency_min=2, concurrency_max=2, mixed_steps=mixed_steps)
    out = model.generate(input_ids, s3r_config=config, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, dense)
    assert out.s3r_stats.prefill_tokens == 14 + 9 + 1 and out.s3r_stats.shared_prompt_tokens == 13
