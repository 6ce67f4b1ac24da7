"""`generate` options and inputs S3R cannot serve exactly are refused with errors that name them, the rest behave as
documented (issue 20, items 4-7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import s3r_hf
import s3r_hf.validation
from s3r_hf import S3RConfig
from s3r_hf.validation import prompt_rows
from tests.conftest import TINY, left_padded_batch, tiny_model

CONFIG = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.1, min_budget=2, page_size=4, seed=0)


def _model_and_batch(seed: int, kind: str = "llama", **overrides):
    model = s3r_hf.enable(tiny_model(kind, seed=seed, **overrides))
    input_ids, attention_mask = left_padded_batch([6, 11], seed=seed + 1)
    return model, input_ids, attention_mask


# ---------------------------------------------------------------- item 4: processors that run a model or keep state
def test_classifier_free_guidance_is_refused():
    model, input_ids, attention_mask = _model_and_batch(70)
    with pytest.raises(ValueError, match="guidance_scale"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, guidance_scale=1.5,
                       s3r_config=CONFIG)


@pytest.mark.parametrize("option", [
    dict(dola_layers="high"), dict(dola_layers=[0, 1]), dict(penalty_alpha=0.6, top_k=4), dict(assistant_early_exit=1),
    dict(use_mtp=True), dict(prompt_lookup_num_tokens=3),
], ids=lambda option: next(iter(option)))
def test_decoding_methods_s3r_does_not_run_are_refused_by_name(option):
    model, input_ids, attention_mask = _model_and_batch(71)
    with pytest.raises(ValueError, match=next(iter(option))):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False, s3r_config=CONFIG,
                       **option)


@pytest.mark.parametrize("option", [
    dict(penalty_alpha=0.6, top_k=None), dict(penalty_alpha=0.0, top_k=4), dict(penalty_alpha=0.6, top_k=4,
                                                                                do_sample=True),
], ids=["top_k-None", "alpha-0", "sampled"])
def test_penalty_alpha_without_contrastive_search_decodes_as_dense_does(option):
    """transformers runs contrastive search only for greedy decoding with penalty_alpha > 0 and top_k > 1; otherwise
    the option changes nothing, and S3R accepts it as dense decoding does."""
    model, input_ids, attention_mask = _model_and_batch(72)
    kwargs = {"attention_mask": attention_mask, "max_new_tokens": 6, "do_sample": False, **option}
    if kwargs["do_sample"]:
        kwargs["top_k"] = 1  # a point mass: exactness means token identity
    dense = model.generate(input_ids, **kwargs)
    assert torch.equal(model.generate(input_ids, s3r_config=CONFIG, **kwargs), dense)


class SideModelProcessor(LogitsProcessor):
    """Adds the scores of a model of its own (as classifier-free guidance does)."""

    def __init__(self, model) -> None:
        self.side_model = model

    def __call__(self, input_ids, scores):
        return scores + self.side_model(input_ids).logits[:, -1]


def test_a_processor_holding_a_model_is_refused_by_name():
    model, input_ids, attention_mask = _model_and_batch(72)
    processors = LogitsProcessorList([SideModelProcessor(tiny_model("llama", seed=73))])
    with pytest.raises(ValueError, match="SideModelProcessor"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, logits_processor=processors,
                       s3r_config=CONFIG)


class BansTheLastToken(LogitsProcessor):
    """A row-wise processor that reads the history: it bans each row's last token."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))


def test_a_users_own_processor_gets_one_warning_of_what_s3r_asks_of_it():
    """No check can see whether a processor reads across rows or keeps state across calls, so S3R says once what it
    asks of a processor of the user's own (transformers' processors get no warning), and a row-wise one is exact."""
    model, input_ids, attention_mask = _model_and_batch(78)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False, repetition_penalty=1.3)
    logger = logging.get_logger("s3r_hf.validation")
    with CaptureLogger(logger) as captured:
        model.generate(input_ids, s3r_config=CONFIG, **kwargs)
    assert "logits processor" not in captured.out
    processors = LogitsProcessorList([BansTheLastToken()])
    with CaptureLogger(logger) as captured:
        out = model.generate(input_ids, s3r_config=CONFIG, logits_processor=processors, **kwargs)
        model.generate(input_ids, s3r_config=CONFIG, logits_processor=processors, **kwargs)
    assert captured.out.count("logits processor BansTheLastToken") == 1
    assert "each row from that row's input_ids and scores alone" in captured.out
    assert torch.equal(out, model.generate(input_ids, logits_processor=processors, **kwargs))


@pytest.mark.parametrize("do_sample", [False, True])
def test_prefix_allowed_tokens_fn_is_called_with_real_histories_only(do_sample):
    """A constraint function that knows only its row's real histories (a trie returns no token for others, and
    transformers then raises) works as in dense `generate`: S3R hands it each entry's own history and batch row, not
    the zero-filled rows of its grouped calls. Greedy decoding matches dense; sampled tokens keep the constraint."""
    model, input_ids, attention_mask = _model_and_batch(76)
    width = input_ids.shape[1]

    def allowed_for(length: int) -> list[int]:
        return list(range(3, 40)) if length % 2 else list(range(30, 90))

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        return allowed_for(sent.shape[0]) if torch.equal(sent[:width], input_ids[batch_id]) else []

    options = dict(max_new_tokens=12, do_sample=do_sample, prefix_allowed_tokens_fn=allowed)
    out = model.generate(input_ids, attention_mask=attention_mask, s3r_config=CONFIG, **options)
    if not do_sample:
        assert torch.equal(out, model.generate(input_ids, attention_mask=attention_mask, **options))
    for position in range(width, out.shape[1]):
        assert all(token in allowed_for(position) for token in out[:, position].tolist())


@pytest.mark.parametrize("top_k", [1, 0], ids=["point-mass", "sampled"])
def test_prefix_allowed_tokens_fn_with_several_sequences_per_prompt_gets_denses_batch_ids(top_k):
    """With `num_return_sequences` > 1 dense `generate` calls the function with the prompt's index (row // sequences
    per prompt; transformers 5.24 and later) or with the row's (earlier releases), as the processor it builds says;
    S3R calls it with the same ids. The function here allows tokens by batch id, so another id shows in the tokens."""
    model, input_ids, attention_mask = _model_and_batch(77)
    prompts, sequences = input_ids.shape[0], 3
    seen: dict[str, set[int]] = {"dense": set(), "s3r": set()}

    def allowed_by(method: str):
        def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
            seen[method].add(batch_id)
            return list(range(10 + 40 * batch_id, 40 + 40 * batch_id))

        return allowed

    options = dict(max_new_tokens=8, do_sample=True, top_k=top_k, num_return_sequences=sequences)
    dense = model.generate(input_ids, attention_mask=attention_mask, prefix_allowed_tokens_fn=allowed_by("dense"),
                           **options)
    out = model.generate(input_ids, attention_mask=attention_mask, s3r_config=CONFIG,
                         prefix_allowed_tokens_fn=allowed_by("s3r"), **options)
    by_prompt = seen["dense"] == set(range(prompts))
    assert by_prompt or seen["dense"] == set(range(prompts * sequences))
    assert seen["s3r"] == seen["dense"]
    rows_id = torch.arange(out.shape[0]) // (sequences if by_prompt else 1)
    new = out[:, input_ids.shape[1]:]
    assert ((new >= 10 + 40 * rows_id[:, None]) & (new < 40 + 40 * rows_id[:, None])).all()
    if top_k == 1:  # a point mass: exactness means token identity
        assert torch.equal(out, dense)


# ---------------------------------------------------------------- item 5: training mode
def test_training_mode_with_attention_dropout_is_refused_naming_eval():
    model, input_ids, attention_mask = _model_and_batch(74, attention_dropout=0.1)
    model.train()
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, s3r_config=CONFIG)
    model.eval()  # the same model in eval mode applies no dropout: S3R runs and equals dense
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    assert torch.equal(model.generate(input_ids, s3r_config=CONFIG, **kwargs), model.generate(input_ids, **kwargs))


def test_training_mode_with_a_dropout_module_is_refused():
    model, input_ids, attention_mask = _model_and_batch(76)
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.2))
    model.train()
    with pytest.raises(ValueError, match=r"dropout.*model\.eval\(\)"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, s3r_config=CONFIG)


def test_training_mode_without_dropout_generates_as_dense():
    """TRL generates with the policy in training mode; models without dropout (SmolLM2, Qwen) keep working."""
    model, input_ids, attention_mask = _model_and_batch(78)
    model.train()
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    assert torch.equal(model.generate(input_ids, s3r_config=CONFIG, **kwargs), model.generate(input_ids, **kwargs))


def test_checkpointing_that_drops_the_cache_is_refused(monkeypatch):
    """Before transformers 5.24 a decoder layer with gradient checkpointing on in training mode runs without the KV
    cache even under no_grad: S3R's pool would get no keys or values, and every sample would come from a model that
    sees no context. Refused there, naming the remedy TRL applies; from 5.24 the layer keeps its cache."""
    model, input_ids, attention_mask = _model_and_batch(79)
    model.train()
    model.model.layers[1].gradient_checkpointing = True
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    with monkeypatch.context() as patch:
        patch.setattr(s3r_hf.validation, "CHECKPOINTING_DROPS_THE_CACHE", True)
        with pytest.raises(ValueError, match=r"model\.layers\.1 without the KV cache.*gradient_checkpointing_disable"):
            model.generate(input_ids, s3r_config=CONFIG, **kwargs)
    if not s3r_hf.validation.CHECKPOINTING_DROPS_THE_CACHE:  # the installed transformers keeps the cache
        assert torch.equal(model.generate(input_ids, s3r_config=CONFIG, **kwargs), model.generate(input_ids, **kwargs))
    model.model.layers[1].gradient_checkpointing = False  # accepted on any version
    assert torch.equal(model.generate(input_ids, s3r_config=CONFIG, **kwargs), model.generate(input_ids, **kwargs))


# ---------------------------------------------------------------- item 6: attention mask
@pytest.mark.parametrize("case", ["narrower", "other_batch"])
def test_attention_mask_of_another_shape_is_refused_up_front(case):
    model, input_ids, attention_mask = _model_and_batch(80)
    mask = attention_mask[:, 2:] if case == "narrower" else torch.cat([attention_mask, attention_mask[:1]])
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model.generate(input_ids, attention_mask=mask, max_new_tokens=5, s3r_config=CONFIG)


def test_attention_mask_dtype_values_and_device_are_checked():
    input_ids, attention_mask = left_padded_batch([3, 5], seed=82)
    assert [len(row) for row in prompt_rows(input_ids, attention_mask.bool())] == [3, 5]
    assert [len(row) for row in prompt_rows(input_ids, attention_mask.float())] == [3, 5]
    with pytest.raises(ValueError, match="dtype"):
        prompt_rows(input_ids, attention_mask.to(torch.complex64))
    with pytest.raises(ValueError, match="only 0"):
        prompt_rows(input_ids, attention_mask * 2)
    with pytest.raises(ValueError, match="device"):
        prompt_rows(input_ids, attention_mask.to("meta"))


# ---------------------------------------------------------------- item 7: smaller items
def test_inputs_embeds_are_refused_by_name():
    model, input_ids, attention_mask = _model_and_batch(84)
    embeds = model.get_input_embeddings()(input_ids)
    with pytest.raises(ValueError, match="inputs_embeds"):
        model.generate(inputs_embeds=embeds, attention_mask=attention_mask, max_new_tokens=5, s3r_config=CONFIG)


@pytest.mark.parametrize("how", ["set_attn_implementation", "config"])
def test_an_attention_implementation_of_the_users_own_is_refused_by_name(how):
    """S3R runs attention with its own kernels: a function registered with `AttentionInterface` would be bypassed,
    and the output silently differ from dense. Refused by name; transformers' own implementations are not."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def scaled_sdpa(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out * 3.0 - 1.0, weights

    AttentionInterface.register("scaled_sdpa_for_test", scaled_sdpa)
    try:
        model, input_ids, attention_mask = _model_and_batch(87)
        kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        if how == "config":
            model.config._attn_implementation = "scaled_sdpa_for_test"
        else:
            model.set_attn_implementation("scaled_sdpa_for_test")
        refusal = "attention implementation 'scaled_sdpa_for_test'.*set_attn_implementation"
        with pytest.raises(ValueError, match=refusal):
            model.generate(input_ids, **kwargs, s3r_config=CONFIG)
        model.set_attn_implementation("eager")
        assert torch.equal(model.generate(input_ids, **kwargs, s3r_config=CONFIG), model.generate(input_ids, **kwargs))
    finally:
        AttentionInterface._global_mapping.pop("scaled_sdpa_for_test", None)


@pytest.mark.parametrize("route", ["enable", "assisted_generate"])
def test_a_filled_cache_is_refused_and_an_empty_one_is_not(route):
    """S3R prefills input_ids in its own cache: a `past_key_values` that already holds positions would be ignored
    (dense generate continues from it), so it is refused by name; an empty one changes nothing and is accepted."""
    model = tiny_model("llama", seed=85)
    input_ids, attention_mask = left_padded_batch([6, 11], seed=86)
    kwargs = dict(max_new_tokens=4, do_sample=False, s3r_config=CONFIG)
    if route == "enable":
        s3r_hf.enable(model)
    else:
        input_ids, attention_mask = input_ids[1:], attention_mask[1:]
        kwargs["custom_generate"] = s3r_hf.assisted_generate
    empty = DynamicCache(config=model.config)
    if route == "enable":
        dense = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
        out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=empty, **kwargs)
        assert torch.equal(out, dense)
    filled = DynamicCache(config=model.config)
    model(input_ids[:, :-1], attention_mask=attention_mask[:, :-1], past_key_values=filled)
    with pytest.raises(ValueError, match=rf"passed to generate holds {input_ids.shape[1] - 1} positions"):
        model.generate(input_ids, attention_mask=attention_mask, past_key_values=filled, **kwargs)


@pytest.mark.parametrize("option", ["output_hidden_states", "output_attentions"])
def test_per_step_hidden_states_and_attentions_are_refused(option):
    model, input_ids, attention_mask = _model_and_batch(86)
    with pytest.raises(ValueError, match=option):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, return_dict_in_generate=True,
                       s3r_config=CONFIG, **{option: True})


def test_return_logprobs_without_return_dict_warns():
    model, input_ids, attention_mask = _model_and_batch(88)
    config = S3RConfig(**{**CONFIG.to_dict(), "return_logprobs": True})
    with CaptureLogger(logging.get_logger("s3r_hf.generate")) as captured:
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, s3r_config=config)
    assert isinstance(out, torch.Tensor)
    assert "return_dict_in_generate=True" in captured.out


def test_config_takes_numpy_scalars_as_python_numbers():
    config = S3RConfig(draft_len=np.int64(4), min_budget=np.int32(8), budget_ratio=np.float32(0.25), seed=np.uint64(7))
    assert (config.draft_len, config.min_budget, config.seed) == (4, 8, 7)
    assert type(config.draft_len) is int and type(config.seed) is int and type(config.budget_ratio) is float
    with pytest.raises(ValueError, match="draft_len"):
        S3RConfig(draft_len=np.bool_(True))


def test_seed_range_is_what_torch_generators_take():
    S3RConfig(seed=2**64 - 1)
    with pytest.raises(ValueError, match="seed"):
        S3RConfig(seed=2**70)
    with pytest.raises(ValueError, match="seed"):
        S3RConfig(seed=-1)


def test_rows_that_finished_hold_zero_scores():
    """Documented difference: dense keeps scoring rows after they finish (on the pad token), S3R returns zeros."""
    model, input_ids, attention_mask = _model_and_batch(90, kind="qwen3")
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=20, return_dict_in_generate=True,
                  output_scores=True)
    dense = model.generate(input_ids, eos_token_id=None, **kwargs)
    eos = int(dense.sequences[0, input_ids.shape[1] + 4])  # row 0 ends at step 5 on this token
    out = model.generate(input_ids, eos_token_id=eos, s3r_config=CONFIG, **kwargs)
    ended = (out.sequences[:, input_ids.shape[1]:] == eos).int().cumsum(dim=1)
    finished_before = (ended - (out.sequences[:, input_ids.shape[1]:] == eos).int()) > 0
    assert finished_before.any()
    for step, scores in enumerate(out.scores):
        assert bool((scores[finished_before[:, step]] == 0).all())


# ---------------------------------------------------------------- rotary embeddings that switch with the forward
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [float(50 + 30 * i) for i in range(8)], "original_max_position_embeddings": 32}


def test_longrope_is_exact_below_its_switch_and_refused_past_it(monkeypatch):
    """A longrope model's forward rotates with its long factors once it holds a position past
    `original_max_position_embeddings`, and S3R's forwards hold other positions than dense decoding's: below the
    switch the two agree token for token, a call that can reach it is refused with the length that fits. S3R drafts
    six tokens every round (a fixed k, as `CONFIG`: the adaptive rule may decode densely on a CPU, whose forwards
    match dense ones)."""
    drafting = S3RConfig(**{**CONFIG.to_dict(), "draft_len": 6})
    model = s3r_hf.enable(tiny_model("llama", seed=91, max_position_embeddings=512, rope_parameters=LONGROPE))
    input_ids, attention_mask = left_padded_batch([6, 10], seed=92)
    greedy = dict(attention_mask=attention_mask, do_sample=False)
    dense = model.generate(input_ids, max_new_tokens=16, **greedy)
    assert torch.equal(model.generate(input_ids, max_new_tokens=16, s3r_config=drafting, **greedy), dense)
    with pytest.raises(s3r_hf.ContextWindowError, match=r"longrope.*original_max_position_embeddings=32.*at most 16"):
        model.generate(input_ids, max_new_tokens=17, s3r_config=drafting, **greedy)
    plain = tiny_model("llama", seed=91, max_position_embeddings=512, rope_parameters=LONGROPE)
    with pytest.raises(s3r_hf.ContextWindowError, match="longrope"):  # transformers' assisted loop with S3R drafts
        plain.generate(input_ids[1:], do_sample=False, max_new_tokens=17, custom_generate=s3r_hf.assisted_generate,
                       s3r_config=drafting)
    # Past the switch the two part, which is what the refusal prevents: dense decoding rotates every key from the
    # switch on with the long factors, S3R's wider forwards switch at other steps.
    monkeypatch.setattr(s3r_hf.validation, "longrope_switch", lambda model: None)
    past = dict(max_new_tokens=30, return_dict_in_generate=True, output_logits=True, **greedy)
    dense, unchecked = model.generate(input_ids, **past), model.generate(input_ids, s3r_config=drafting, **past)
    gaps = [float((d - s).abs().max()) for d, s in zip(dense.logits, unchecked.logits)]
    assert max(gaps[:16]) < 1e-4 < max(gaps)


# ---------------------------------------------------------------- attention that reads other K/V than it cached
def _diffllama():
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(93)
    return DiffLlamaForCausalLM(DiffLlamaConfig(**{**TINY, "max_position_embeddings": 512})).eval()


def _latent_attention():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(94)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
    )).eval()


def _hrm_text():
    import transformers

    if not hasattr(transformers, "HrmTextForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no HRM-Text")
    torch.manual_seed(97)
    config = transformers.HrmTextConfig(**{**TINY, "max_position_embeddings": 512, "H_cycles": 1, "L_cycles": 1})
    return transformers.HrmTextForCausalLM(config).eval()


@pytest.mark.parametrize("build, reason", [
    (_diffllama, "differential attention"), (_latent_attention, "multi-head latent attention"),
    (_hrm_text, "recurrent cycle"),
], ids=["diffllama", "latent-attention", "hrm-text"])
def test_attention_that_reads_other_kv_than_it_caches_is_refused(build, reason):
    """DiffLlama calls the attention on halves of its cached values and latent attention caches K/V of other widths
    than `head_dim`: S3R, which reads whole cached K/V from its pool, would compute something else (DiffLlama: other
    tokens from the prefill on) or fail inside a kernel; HRM-Text runs its layers several times per forward. All are
    refused by name, before the first forward."""
    model = build()
    input_ids, attention_mask = left_padded_batch([5, 9], seed=95)
    with pytest.raises(s3r_hf.UnsupportedModelError, match=reason):
        s3r_hf.enable(model)
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, s3r_config=CONFIG)


def test_a_layer_that_caches_kv_the_pool_cannot_hold_is_refused_by_its_shapes(monkeypatch):
    """Past the refusals by name, a layer whose cached K/V do not fit the pool's shape (sized from the config)
    stops the call with an error that gives both shapes, not a kernel's indexing error."""
    monkeypatch.setattr(s3r_hf.validation, "_LATENT_ATTENTION", None)
    model = s3r_hf.enable(_latent_attention())
    input_ids, attention_mask = left_padded_batch([5, 9], seed=96)
    shapes = r"layer 0 caches keys of \(heads, head dim\) \(\d+, 16\) .* holds \(4, 8\)"
    with pytest.raises(s3r_hf.UnsupportedModelError, match=shapes):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, s3r_config=CONFIG)
