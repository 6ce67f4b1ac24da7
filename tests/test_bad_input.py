"""Every bad input gets a clear error that names the problem."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

import s3r_hf
from s3r_hf import KVCapacityError, S3RConfig, UnsupportedModelError
from tests.conftest import TINY, left_padded_batch, tiny_model


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("draft_len", 0, r"draft_len must be an integer in \[1, 64\]"),
        ("draft_len", 2.5, "draft_len"),
        ("budget_ratio", 0.0, r"budget_ratio must be a number in \(0.0, 1.0\]"),
        ("budget_ratio", 1.5, "budget_ratio"),
        ("min_budget", -1, "min_budget must be an integer >= 1"),
        ("refresh_interval", 0, "refresh_interval must be an integer >= 1"),
        ("refresh_interval", "2", "refresh_interval must be an integer >= 1"),
        ("page_size", 0, "page_size"),
        ("num_pages", 0, "num_pages"),
        ("kv_memory_fraction", 0.0, r"kv_memory_fraction must be a number in \(0.0, 1.0\]"),
        ("concurrency_backoff", 1.0, "concurrency_backoff"),
        ("utilization_high", 0.5, "utilization_high"),
        ("admission_sigmas", -1.0, r"admission_sigmas must be a number in \[0.0, 10.0\]"),
        ("admission_sigmas", "2", "admission_sigmas"),
        ("seed", -3, "seed"),
        ("return_logprobs", "yes", "return_logprobs"),
        ("draft_matmul_precision", "medium", 'draft_matmul_precision must be "highest" or "high"'),
        ("adaptive_draft_lengths", (0, 3), r"adaptive_draft_lengths must include 0 and draft_len \(6\)"),
        ("adaptive_draft_lengths", (3, 6), "adaptive_draft_lengths must include 0"),
        ("adaptive_draft_lengths", (0, 3, 6, 8), "adaptive_draft_lengths"),
        ("adaptive_draft_lengths", (0, 2.5, 6), "adaptive_draft_lengths must be a sequence of integers"),
        ("adaptive_draft_lengths", "0,3,6", "adaptive_draft_lengths must be a sequence of integers"),
        ("adaptive_draft_lengths", 6, "adaptive_draft_lengths must be a sequence of integers"),
    ],
)
def test_invalid_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        S3RConfig(**{field: value})


def test_adaptive_draft_lengths_need_the_adaptive_rule_and_are_kept_sorted():
    with pytest.raises(ValueError, match="adaptive_draft_lengths needs adaptive=True"):
        S3RConfig(adaptive=False, adaptive_draft_lengths=(0, 3, 6))
    assert S3RConfig.from_dict({"adaptive_draft_lengths": [6, 3, 0, 3]}).adaptive_draft_lengths == (0, 3, 6)


def test_unknown_config_key_from_dict():
    with pytest.raises(ValueError, match="Unknown S3RConfig field"):
        S3RConfig.from_dict({"draft_length": 4})


def test_invalid_config_passed_to_generate():
    model = s3r_hf.enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([5])
    with pytest.raises(ValueError, match="budget_ratio"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, s3r_config={"budget_ratio": 2})


def test_beam_search_is_rejected():
    model = s3r_hf.enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([5, 7])
    with pytest.raises(ValueError, match="beam search"):
        model.generate(input_ids, attention_mask=attention_mask, num_beams=3, max_new_tokens=4,
                       s3r_config=S3RConfig())


def test_sliding_window_layers_are_rejected():
    config = Qwen3Config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = Qwen3ForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="sliding"):
        s3r_hf.enable(model)


def test_mistral_sliding_window_is_rejected():
    model = MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": 16})).eval()
    with pytest.raises(UnsupportedModelError, match="sliding"):
        s3r_hf.enable(model)


def test_model_without_attention_interface_is_rejected():
    model = tiny_model()
    model._supports_attention_backend = False
    with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
        s3r_hf.enable(model)


def test_prompt_beyond_context_window():
    model = s3r_hf.enable(tiny_model(max_position_embeddings=32))
    input_ids, attention_mask = left_padded_batch([8, 40])
    with pytest.raises(ValueError, match="context window of 32"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, s3r_config=S3RConfig())


def test_max_new_tokens_past_the_context_window():
    """Dense generate would run on past the window; S3R would have had to stop early: a clear error instead."""
    model = s3r_hf.enable(tiny_model(max_position_embeddings=32))
    input_ids, attention_mask = left_padded_batch([8, 20])
    with pytest.raises(ValueError, match=r"max_new_tokens=13 after the 20-token prompt of row 1 .* window of 32 .* "
                                         r"at most 12 new tokens"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=13, s3r_config=S3RConfig())
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False,
                         s3r_config=S3RConfig(min_budget=2, page_size=4))
    assert out.shape[1] == 20 + 12


def test_empty_prompts():
    model = s3r_hf.enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([6, 4])
    attention_mask[1] = 0
    with pytest.raises(ValueError, match="empty prompt: row 1"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, s3r_config=S3RConfig())


def test_right_padding_is_rejected():
    model = s3r_hf.enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([6, 4])
    attention_mask[1] = torch.tensor([1, 1, 1, 1, 0, 0])
    with pytest.raises(ValueError, match="left"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, s3r_config=S3RConfig())


def test_a_pad_token_inside_a_prompt_without_a_mask_is_named():
    """Without an attention_mask, transformers masks every pad token, so a prompt holding one gets a hole: the error
    says so, not only that the padding is not on the left (the caller padded nothing)."""
    model = s3r_hf.enable(tiny_model())
    pad = model.generation_config.pad_token_id
    input_ids = torch.tensor([[17, 91, 233, pad, 237, 198]])
    with pytest.raises(ValueError, match=rf"masked positions \[3\] hold pad_token_id={pad} inside the prompt.*pass "
                                         "attention_mask"):
        model.generate(input_ids, max_new_tokens=4, s3r_config=S3RConfig())
    right_padded = torch.tensor([[17, 91, 233, 237, pad, pad]])
    with pytest.raises(ValueError, match="not left-padded") as refused:  # padding at the end: the plain message
        model.generate(right_padded, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]), max_new_tokens=4,
                       s3r_config=S3RConfig())
    assert "pad_token_id" not in str(refused.value)


def test_kv_capacity_too_small_for_one_request():
    model = s3r_hf.enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([30])
    config = S3RConfig(page_size=4, num_pages=5)
    with pytest.raises(KVCapacityError, match="KV capacity too small for one request"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, s3r_config=config)


def test_s3r_config_with_custom_generate_or_assistant_is_rejected():
    model = s3r_hf.enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([5])
    with pytest.raises(ValueError, match="not both"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, s3r_config=S3RConfig(),
                       custom_generate=s3r_hf.generate)
    with pytest.raises(ValueError, match="assistant_model"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, s3r_config=S3RConfig(),
                       assistant_model=model)
    # None is generate's own default for both: nothing is asked beside S3R.
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False,
                         s3r_config=S3RConfig(), custom_generate=None, assistant_model=None)
    dense = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False)
    assert torch.equal(out, dense)


@pytest.mark.parametrize("option", [{"s3r_mode": "ar"}, {"s3r_timing": True}])
def test_an_s3r_option_without_s3r_config_on_an_enabled_model_names_s3r_config(option):
    model = s3r_hf.enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([5])
    with pytest.raises(ValueError, match=rf"received \['{next(iter(option))}'\] without s3r_config; pass s3r_config="):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, **option)
