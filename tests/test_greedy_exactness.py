"""Greedy S3R must be token-identical to dense `model.generate` (CPU, fp32)."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TemperatureLogitsWarper

import s3r_hf
from s3r_hf import KVCapacityError, S3RConfig
from s3r_hf.cache.s3r_cache import page_bytes
from s3r_hf.engine.prompt_chunks import PromptChunks
from s3r_hf.engine.view_updates import IndexViewUpdates
from tests.conftest import left_padded_batch, tiny_model

# Budgets small enough that drafts really get rejected: 10% of the context, at least 2 positions.
SMALL_BUDGET = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, seed=0)


def test_greedy_matches_dense_generate_on_ragged_batch(model_kind):
    model = s3r_hf.enable(tiny_model(model_kind))
    input_ids, attention_mask = left_padded_batch([5, 17, 33, 48, 9])
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=48)
    out = model.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=48,
        s3r_config=SMALL_BUDGET, return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, dense)
    stats = out.s3r_stats
    assert stats.drafted > 0
    assert stats.accepted < stats.drafted, "budgets this small must reject some drafts"
    assert 1.0 <= stats.mean_acceptance_length <= SMALL_BUDGET.draft_len + 1


def test_greedy_with_custom_generate_hook_and_chunked_prefill():
    model = tiny_model("qwen3", seed=1)
    input_ids, attention_mask = left_padded_batch([40, 7, 26, 12], seed=3)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.05, min_budget=3, page_size=8, prefill_chunk_size=16)
    out = model.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30,
        custom_generate=s3r_hf.generate, s3r_config=config,
    )
    assert torch.equal(out, dense)
    assert out.s3r_stats.drafted > out.s3r_stats.accepted


def test_plain_generate_unchanged_after_enable():
    model = tiny_model("llama", seed=2)
    input_ids, attention_mask = left_padded_batch([6, 11], seed=4)
    before = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    s3r_hf.enable(model)
    s3r_hf.enable(model)  # idempotent
    after = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    assert torch.equal(before, after)
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(after, "s3r_stats")


def test_a_copy_of_an_enabled_model_generates_with_its_own_weights():
    """`copy.deepcopy` of an enabled model (a frozen reference copy, say): its `generate`, with S3R or without, runs
    the copy, not the model it was copied from."""
    import copy

    model = s3r_hf.enable(tiny_model("qwen3", seed=7))
    input_ids, attention_mask = left_padded_batch([6, 11], seed=8)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=8)
    original = model.generate(input_ids, **kwargs)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.copy_(torch.randn_like(parameter))
    own = type(clone).generate(clone, input_ids, **kwargs)  # the class's own dense generate
    assert not torch.equal(own, original)
    assert torch.equal(clone.generate(input_ids, **kwargs), own)
    assert torch.equal(clone.generate(input_ids, s3r_config=S3RConfig(draft_len=3, page_size=4), **kwargs), own)
    assert torch.equal(model.generate(input_ids, **kwargs), original)


def test_eos_and_max_new_tokens_per_request():
    model = s3r_hf.enable(tiny_model("qwen3", seed=5))
    input_ids, attention_mask = left_padded_batch([8, 20, 31, 14], seed=6)
    free_run = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    # Pick as EOS a token that the dense run emits mid-way in some rows but not all: requests end at
    # different rounds, some inside an accepted draft block.
    generated = free_run[:, input_ids.shape[1] :]
    eos = int(generated[0, 10])
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    dense = model.generate(input_ids, **kwargs)
    out = model.generate(input_ids, s3r_config=SMALL_BUDGET, **kwargs)
    assert torch.equal(out, dense)
    assert (dense[:, input_ids.shape[1] :] == eos).any(dim=1).any()


def test_num_return_sequences_and_history_dependent_processors():
    # Sampling with top_k=1 is deterministic, so the sampled path (ratio test, residual) must also reproduce
    # dense decoding token for token; `generate` allows num_return_sequences only when sampling.
    model = s3r_hf.enable(tiny_model("llama", seed=7))
    input_ids, attention_mask = left_padded_batch([12, 25], seed=8)
    kwargs = dict(
        attention_mask=attention_mask, do_sample=True, top_k=1, max_new_tokens=24, num_return_sequences=2,
        repetition_penalty=1.3, min_new_tokens=5, no_repeat_ngram_size=3,
    )
    dense = model.generate(input_ids, **kwargs)
    out = model.generate(input_ids, s3r_config=SMALL_BUDGET, **kwargs)
    assert out.shape[0] == 4
    assert torch.equal(out, dense)


class TemperatureWithoutRepeats(TemperatureLogitsWarper):
    """A user's subclass of a history-free warper that reads the history: bans repeating the last token."""

    def __call__(self, input_ids, scores):
        return super().__call__(input_ids, scores).scatter(1, input_ids[:, -1:], -float("inf"))


@pytest.mark.parametrize("config", [SMALL_BUDGET, S3RConfig()], ids=["fixed", "adaptive"])
def test_a_subclass_of_a_history_free_warper_sees_the_history(config):
    model = s3r_hf.enable(tiny_model("llama", seed=1))
    input_ids, attention_mask = left_padded_batch([5, 8], seed=2)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=10)
    processors = LogitsProcessorList([TemperatureWithoutRepeats(1.0)])
    dense = model.generate(input_ids, **kwargs, logits_processor=processors)
    out = model.generate(input_ids, **kwargs, logits_processor=processors, s3r_config=config)
    assert torch.equal(out, dense)


class StopAfterToken(StoppingCriteria):
    """Stops a row once `token` appears among its last two tokens."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, -2:] == self.token).any(dim=1)


def test_custom_stopping_criteria():
    model = s3r_hf.enable(tiny_model("qwen3", seed=9))
    input_ids, attention_mask = left_padded_batch([10, 30, 18], seed=10)
    free_run = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=30)
    token = int(free_run[1, input_ids.shape[1] + 12])
    criteria = StoppingCriteriaList([StopAfterToken(token)])
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30, stopping_criteria=criteria)
    dense = model.generate(input_ids, **kwargs)
    out = model.generate(input_ids, s3r_config=SMALL_BUDGET, **kwargs)
    assert torch.equal(out, dense)


def test_outputs_scores_and_logprobs_match_dense():
    model = s3r_hf.enable(tiny_model("qwen3", seed=11))
    input_ids, attention_mask = left_padded_batch([9, 21], seed=12)
    kwargs = dict(
        attention_mask=attention_mask, do_sample=False, max_new_tokens=16, return_dict_in_generate=True,
        output_scores=True, output_logits=True,
    )
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.1, min_budget=2, page_size=4, return_logprobs=True)
    out = model.generate(input_ids, s3r_config=config, **kwargs)
    assert isinstance(out, s3r_hf.S3RGenerateOutput)
    assert torch.equal(out.sequences, dense.sequences)
    assert len(out.scores) == len(dense.scores)
    generated = dense.sequences[:, input_ids.shape[1] :]
    # Rows still generating at each step (after EOS `generate` keeps computing scores, S3R holds zeros).
    ended = (generated == model.generation_config.eos_token_id).int().cumsum(dim=1)
    active = (ended - (generated == model.generation_config.eos_token_id).int()) == 0
    for step, (mine, theirs) in enumerate(zip(out.logits, dense.logits)):
        rows = active[:, step]
        torch.testing.assert_close(mine[rows], theirs[rows], atol=1e-4, rtol=1e-4)
    expected = torch.stack([torch.log_softmax(s, -1) for s in dense.scores], 1).gather(-1, generated[..., None])
    expected = expected.squeeze(-1).masked_fill(~active, 0.0)
    torch.testing.assert_close(out.logprobs, expected, atol=1e-4, rtol=1e-4)


# refresh_interval 3: views extended between refreshes must survive a pause (offload) and resume too.
@pytest.mark.parametrize("refresh_interval", [1, 3])
def test_kv_pressure_pauses_and_resumes_requests(refresh_interval, view_checks):
    model = s3r_hf.enable(tiny_model("llama", seed=13))
    input_ids, attention_mask = left_padded_batch([20, 22, 24, 26], seed=14)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    # Room for about two requests at full length: the others wait or are paused (offloaded) and resumed. Admissions
    # take whatever fits now (`admission_sigmas=None`), so that requests are paused.
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, num_pages=36,
                       refresh_interval=refresh_interval, admission_sigmas=None)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert out.s3r_stats.offload_episodes > 0, "the pool is too small for all four: some must be paused"
    assert out.s3r_stats.peak_kv_pages <= 36
    assert (view_checks["extend"] > 0) == (refresh_interval > 1)


def test_admission_counts_prompt_pages_that_chunked_prefill_has_not_reserved_yet():
    """Prefill reserves a prompt's pages chunk by chunk; a request admitted on the pages still free after the
    first chunks would leave a later chunk without room. Admission counts the pages promised to prompts."""
    model = s3r_hf.enable(tiny_model("llama", seed=13))
    input_ids, attention_mask = left_padded_batch([40, 40, 40, 40], seed=15)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    # About three prompts fit (12 pages each with one round); two chunks of 8 tokens per prefill step.
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, num_pages=36,
                       prefill_chunk_size=8)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert out.s3r_stats.peak_kv_pages <= 36


def test_default_pool_is_capped_by_free_device_memory(monkeypatch):
    """With `num_pages` unset the pool holds every request only while `kv_memory_fraction` of the free device
    memory allows; a smaller pool runs the requests that fit and nothing is lost."""
    generate_module = importlib.import_module("s3r_hf.generate")  # the package exports a function of that name
    model = s3r_hf.enable(tiny_model("llama", seed=13))
    input_ids, attention_mask = left_padded_batch([20, 22, 24, 26], seed=14)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, kv_memory_fraction=0.5)
    size = page_bytes(model.config, config.page_size, model.dtype)
    # Free memory whose half holds 36 pages plus the scratch page: about two of the four requests.
    monkeypatch.setattr(generate_module, "_free_device_memory", lambda device: 2 * 37 * size)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert 0 < out.s3r_stats.peak_kv_pages <= 36
    # Too little for the longest request alone: the error names the knob. (Released first: a kept pool would be
    # reused without looking at the free memory again.)
    s3r_hf.release(model)
    monkeypatch.setattr(generate_module, "_free_device_memory", lambda device: 2 * 10 * size)
    with pytest.raises(KVCapacityError, match="kv_memory_fraction=0.5"):
        model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
                       s3r_config=config)


def test_engine_dense_mode_matches_generate_and_forced_acceptance_runs():
    model = s3r_hf.enable(tiny_model("qwen3", seed=15))
    input_ids, attention_mask = left_padded_batch([7, 19, 12], seed=16)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    dense = model.generate(input_ids, **kwargs)
    ar = model.generate(input_ids, s3r_config=SMALL_BUDGET, s3r_mode="ar", s3r_timing=True, **kwargs)
    assert torch.equal(ar, dense)
    assert ar.s3r_stats.drafted == 0 and ar.s3r_stats.mean_acceptance_length == 1.0
    assert ar.s3r_stats.decode_seconds > 0 and ar.s3r_stats.prefill_seconds > 0
    # Benchmark-only acceptance pattern: with probability 1 every draft is kept.
    forced = model.generate(input_ids, s3r_config=SMALL_BUDGET, s3r_forced_acceptance=1.0, **kwargs)
    assert forced.s3r_stats.accepted == forced.s3r_stats.drafted > 0
    with pytest.raises(ValueError, match="engine mode"):
        model.generate(input_ids, s3r_config=SMALL_BUDGET, s3r_mode="fast", **kwargs)


def test_engine_dense_mode_scores_no_prompt_and_builds_no_views(monkeypatch):
    """Engine AR never drafts: its prompts (past `min_budget` here) are prefilled unscored and no index view is
    built, where S3R scores them and builds the views; both equal `generate`."""
    refreshed, scored = [], []
    refresh, take = IndexViewUpdates.refresh, PromptChunks.take.__func__

    def spy_take(cls, *args, **kwargs):
        chunks = take(cls, *args, **kwargs)
        scored.append(chunks is not None and chunks.scored)
        return chunks

    monkeypatch.setattr(IndexViewUpdates, "refresh", lambda self, *a: refreshed.append(1) or refresh(self, *a))
    monkeypatch.setattr(PromptChunks, "take", classmethod(spy_take))
    model = s3r_hf.enable(tiny_model("llama", seed=17))
    input_ids, attention_mask = left_padded_batch([7, 19, 12], seed=18)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    dense = model.generate(input_ids, **kwargs)
    assert torch.equal(model.generate(input_ids, s3r_config=SMALL_BUDGET, **kwargs), dense)
    assert refreshed and any(scored)
    refreshed.clear()
    scored.clear()
    assert torch.equal(model.generate(input_ids, s3r_config=SMALL_BUDGET, s3r_mode="ar", **kwargs), dense)
    assert scored and not any(scored) and not refreshed
