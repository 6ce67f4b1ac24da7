"""`SparseSelfDraftCandidateGenerator` inside transformers' own assisted-decoding loop."""

from __future__ import annotations

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from tests.conftest import left_padded_batch, tiny_model

CONFIG = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, seed=0)


def test_assisted_loop_greedy_matches_dense(model_kind):
    model = tiny_model(model_kind, seed=3)
    input_ids, attention_mask = left_padded_batch([30], seed=1)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    out = model.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
        custom_generate=s3r_hf.assisted_generate, s3r_config=CONFIG,
    )
    assert torch.equal(out, dense)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 6])
def test_assisted_loop_with_no_room_to_draft_matches_dense(max_new_tokens):
    # With one token left the generator drafts nothing, and transformers' loop still runs the target forward.
    model = tiny_model("llama", seed=1)
    input_ids, _ = left_padded_batch([8], seed=2)
    dense = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    out = model.generate(
        input_ids, do_sample=False, max_new_tokens=max_new_tokens, custom_generate=s3r_hf.assisted_generate,
        s3r_config=S3RConfig(adaptive=False, draft_len=3, page_size=4, seed=0),
    )
    assert torch.equal(out, dense)


def test_assisted_loop_sampling_path_with_top_k_1_matches_dense():
    # do_sample=True takes transformers' speculative-sampling branch with our candidate logits; top_k=1 makes
    # the dense distribution a point mass, so exactness means token identity.
    model = tiny_model("qwen3", seed=4)
    input_ids, attention_mask = left_padded_batch([26], seed=2)
    kwargs = dict(attention_mask=attention_mask, do_sample=True, top_k=1, max_new_tokens=32)
    dense = model.generate(input_ids, **kwargs)
    out = model.generate(input_ids, custom_generate=s3r_hf.assisted_generate, s3r_config=CONFIG, **kwargs)
    assert torch.equal(out, dense)


def test_candidates_are_sampled_from_their_logits_and_cache_is_rolled_back():
    model = tiny_model("llama", seed=5)
    input_ids, _ = left_padded_batch([20], seed=3)
    cache = s3r_hf.S3RCache(model.config, num_pages=32, page_size=4, max_requests=1)
    generation_config = model.generation_config
    generation_config.max_length = 64
    generator = s3r_hf.SparseSelfDraftCandidateGenerator(model, cache, CONFIG, generation_config, None)
    candidates, logits = generator.get_candidates(input_ids)
    assert candidates.shape == (1, 20 + CONFIG.draft_len)
    assert torch.equal(candidates[:, :20], input_ids)
    drafts = candidates[0, 20:]
    # Greedy drafting: each draft is the argmax of the logits it came from.
    assert torch.equal(logits[0].argmax(-1), drafts)
    # The provisional draft K/V is dropped; the first call leaves the cache as it found it (empty) because
    # transformers' loop prefills the prompt itself with the target forward.
    assert cache.lengths[0] == 0
