"""Checks that a model, a generation setup and the inputs are something S3R can run exactly."""

from __future__ import annotations

import torch
import transformers
from packaging import version
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import logging

from s3r_hf.errors import ContextWindowError

logger = logging.get_logger(__name__)

_DROPOUT_MODULES = (
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


class UnsupportedModelError(ValueError):
    """The model's architecture or attention cannot run under S3R."""


def text_config(model: PreTrainedModel):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# Attention layers that reach `AttentionInterface` with other keys or values than the ones they cached. S3R's kernels
# read the cached K/V from its pool, so it would compute other attention than theirs without a word.
_ATTENTION_S3R_CANNOT_READ = {
    "diffllama": "differential attention calls the attention function on halves of the cached values, while S3R "
    "reads whole cached values from its KV pool",
    "hrm_text": "its decoder layers run again in every recurrent cycle of a forward, each cycle caching under other "
    "layer indices, while S3R's engine runs each cached layer once per forward",
}
_LATENT_ATTENTION = ("multi-head latent attention (kv_lora_rank) caches keys and values of other widths than "
                     "head_dim, which S3R's KV pool does not hold")


def check_model_supported(model: PreTrainedModel) -> None:
    """Raise `UnsupportedModelError` for models S3R cannot serve exactly.

    S3R needs a decoder-only model whose every layer is full causal attention reached through `cache.update`
    and transformers' `AttentionInterface` (Llama, Qwen2/3, Mistral without sliding window, SmolLM, ...).
    """
    name = type(model).__name__
    config = text_config(model)
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model; S3R supports decoder-only causal LMs")
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} (model_type={config.model_type!r}) does not route attention through transformers' "
            "AttentionInterface, so S3R cannot replace its attention"
        )
    layer_types = getattr(config, "layer_types", None) or []
    for idx, layer_type in enumerate(layer_types):
        if layer_type != "full_attention":
            raise UnsupportedModelError(
                f"{name}: layer {idx} is {layer_type!r}; S3R supports only full-attention layers "
                "(sliding-window, chunked and linear-attention layers are not supported)"
            )
    sliding = getattr(config, "sliding_window", None)
    if sliding is not None and getattr(config, "use_sliding_window", True) and not layer_types:
        raise UnsupportedModelError(
            f"{name}: sliding-window attention (sliding_window={sliding}) is not supported by S3R"
        )
    for attribute in ("attention_chunk_size", "sliding_window_pattern"):
        if getattr(config, attribute, None):
            raise UnsupportedModelError(f"{name}: {attribute} attention is not supported by S3R")
    reason = _ATTENTION_S3R_CANNOT_READ.get(config.model_type)
    if reason is None and getattr(config, "kv_lora_rank", None) is not None:
        reason = _LATENT_ATTENTION
    if reason is not None:
        raise UnsupportedModelError(f"{name} (model_type={config.model_type!r}): {reason}")
    check_attention_implementation(model)


# Where transformers' attention functions that compute full softmax attention live (what S3R's kernels compute). A
# function registered from anywhere else (a user's own, a hub kernel's own entry point, transformers' block-sparse
# `msa_attention`) may compute something else.
_DENSE_ATTENTION_MODULES = tuple(
    f"transformers.integrations.{name}"
    for name in ("sdpa_attention", "flash_attention", "flex_attention", "eager_paged", "sdpa_paged", "flash_paged")
)


def check_attention_implementation(model: PreTrainedModel) -> None:
    """Raise `UnsupportedModelError` if the model's attention implementation is not one of transformers' own.

    S3R replaces the attention function with its own kernels, which compute what transformers' eager, SDPA, flash
    and flex implementations compute. A function registered with `AttentionInterface` from elsewhere may compute
    something else, and S3R would bypass it without a word.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = {getattr(config, "_attn_implementation", None) for config in (model.config, text_config(model))}
    for implementation in names:
        if not isinstance(implementation, str) or implementation == "eager":
            continue
        function = ALL_ATTENTION_FUNCTIONS.get(implementation)
        function = getattr(function, "func", function)  # a hub kernel is registered as a partial of transformers'
        module = getattr(function, "__module__", None) or ""
        if module not in _DENSE_ATTENTION_MODULES and not module.startswith("s3r_hf."):
            raise UnsupportedModelError(
                f"{type(model).__name__}: attention implementation {implementation!r} "
                f"({module}.{getattr(function, '__qualname__', function)}) is not one of transformers' full-attention "
                "implementations; S3R runs attention with its own kernels and would bypass it. Use one of them, "
                "e.g. model.set_attn_implementation('sdpa')"
            )


def check_generation_config(generation_config: GenerationConfig) -> None:
    """S3R implements greedy decoding and multinomial sampling, one beam per sequence."""
    if generation_config.num_beams is not None and generation_config.num_beams > 1:
        raise ValueError(
            f"S3R does not support beam search (num_beams={generation_config.num_beams}); use num_beams=1 with "
            "greedy decoding or sampling"
        )
    if getattr(generation_config, "num_beam_groups", 1) not in (None, 1):
        raise ValueError("S3R does not support group beam search (num_beam_groups > 1)")
    # Contrastive search exactly where transformers would run it (`GenerationConfig.get_generation_mode`): otherwise
    # `penalty_alpha` has no effect on the dense decoding either.
    alpha, top_k = getattr(generation_config, "penalty_alpha", None), getattr(generation_config, "top_k", None)
    if not generation_config.do_sample and alpha is not None and alpha > 0 and top_k is not None and top_k > 1:
        raise ValueError(f"S3R does not support contrastive search (penalty_alpha={alpha} with top_k={top_k})")
    if getattr(generation_config, "dola_layers", None) is not None:
        raise ValueError(
            f"S3R does not support DoLa decoding (dola_layers={generation_config.dola_layers!r}): it contrasts the "
            "final layer's logits with earlier layers', which S3R's forwards do not compute"
        )
    for option in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(generation_config, option, None) is not None:
            raise ValueError(f"S3R drafts with the model itself; {option} cannot be combined with it")
    if getattr(generation_config, "use_mtp", False):
        raise ValueError("S3R drafts with the model itself; use_mtp cannot be combined with it")
    guidance = getattr(generation_config, "guidance_scale", None)
    if guidance is not None and guidance != 1:
        raise ValueError(
            f"S3R does not support guidance_scale={guidance} (classifier-free guidance): its logits processor runs "
            "the model on the unconditional prompt with a cache of its own, outside S3R's rounds"
        )
    if generation_config.return_dict_in_generate:
        for option in ("output_attentions", "output_hidden_states"):
            if getattr(generation_config, option, False):
                raise ValueError(
                    f"S3R does not support {option}=True: its forwards pack many requests' draft and verify tokens "
                    "into one batch, so there are no per-step attentions or hidden states of the dense loop to return"
                )


def prompt_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int | None = None
) -> list[torch.Tensor]:
    """Real tokens of each left-padded row; raise `ValueError` for empty rows or padding that is not on the left.
    `pad_token_id` (the generation config's) names the likely cause when the padding inside a row is that token."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2D (batch, sequence), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("S3R got an empty prompt: input_ids has sequence length 0")
    if attention_mask is None:
        return list(input_ids)
    check_attention_mask(input_ids, attention_mask)
    mask = attention_mask.to(torch.bool)
    rows = []
    for row, (ids, row_mask) in enumerate(zip(input_ids, mask)):
        count = int(row_mask.sum())
        if count == 0:
            raise ValueError(f"S3R got an empty prompt: row {row} of attention_mask is all zeros")
        if not bool(row_mask[-count:].all()):
            raise ValueError(
                f"row {row} of attention_mask is not left-padded; decoder-only generation needs "
                "padding_side='left' (padding only before the prompt)" + _pad_inside_prompt(ids, row_mask, pad_token_id)
            )
        rows.append(ids[-count:])
    return rows


def _pad_inside_prompt(ids: torch.Tensor, row_mask: torch.Tensor, pad_token_id: int | None) -> str:
    """The hint for a row whose padding between its tokens is all `pad_token_id`: without an attention mask,
    transformers builds one from `input_ids != pad_token_id`, so a prompt holding that token gets holes."""
    real = row_mask.nonzero().flatten()
    holes = (~row_mask[real[0] : real[-1]]).nonzero().flatten() + real[0]  # between real tokens: not right padding
    if pad_token_id is None or len(holes) == 0 or not bool((ids[holes] == pad_token_id).all()):
        return ""
    return (
        f". Its masked positions {holes.tolist()[:8]} hold pad_token_id={pad_token_id} inside the prompt: without an "
        "attention_mask, transformers masks every pad token, so pass attention_mask (ones for every prompt token) "
        "or use a pad token that prompts do not contain"
    )


def check_attention_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """The mask must say, for every entry of `input_ids`, whether it is a token (1) or padding (0)."""
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape "
            f"{tuple(input_ids.shape)}; they must match (one mask entry per prompt token, 1 = token, 0 = padding)"
        )
    if attention_mask.dtype.is_complex:
        raise ValueError(
            f"attention_mask must hold integers, booleans or 0./1. floats, got dtype {attention_mask.dtype}"
        )
    if attention_mask.device != input_ids.device:
        raise ValueError(
            f"attention_mask is on {attention_mask.device} but input_ids is on {input_ids.device}; put both on the "
            "same device"
        )
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")


def check_model_inputs(model_kwargs: dict) -> None:
    """S3R generates from token ids only, and prefills all of them itself in its own paged cache."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "S3R does not support inputs_embeds: it generates from input_ids only (pass token ids, or generate "
            "without s3r_config)"
        )
    for name in ("cache", "past_key_values"):  # transformers passes an empty one of its own
        cache = model_kwargs.get(name)
        length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        if length > 0:
            raise ValueError(
                f"S3R does not continue from a filled cache: the {name} passed to generate holds {length} positions, "
                "and S3R prefills input_ids in its own paged KV cache, so it would ignore them; pass the whole "
                "sequence as input_ids without the cache, or generate without s3r_config"
            )


def check_no_active_dropout(model: PreTrainedModel) -> None:
    """Refuse a model in training mode whose forwards apply dropout.

    Dense sampling from such a model is stochastic in the dropout masks as well; S3R's forwards do not reproduce that
    law (its attention kernels apply no dropout), so its samples would silently differ. TRL's `GRPOTrainer`
    generates with the model in training mode and leaves dropout on unless `disable_dropout=True`; models without
    dropout (most LLMs ship with zero rates) generate in training mode as they do in eval mode, and are accepted.
    """
    where = model_dropout(model, training_modules_only=True) if model.training else None
    if where is not None:
        raise ValueError(
            f"S3R cannot generate with dropout active: the model is in training mode and {where}. Dense "
            "generate would sample from the dropout-perturbed model, S3R's forwards apply no dropout, so the "
            "samples would differ; call model.eval() before generate (or set the dropout rates to 0)"
        )


# transformers before 5.24 checkpoints a decoder layer whenever its gradient checkpointing is on in training mode,
# with gradients or without, and then drops the KV cache from the layer's arguments.
CHECKPOINTING_DROPS_THE_CACHE = version.parse(transformers.__version__) < version.parse("5.24")


def check_checkpointing_keeps_the_cache(model: PreTrainedModel) -> None:
    """Refuse a model whose decoder layers would run without the KV cache: gradient checkpointing on in training
    mode, where transformers drops the cache (`CHECKPOINTING_DROPS_THE_CACHE`). No key or value would reach S3R's
    pool, and every token would be sampled from a model that never sees its context. TRL's trainers turn
    gradient checkpointing off around generation, so they pass."""
    if not CHECKPOINTING_DROPS_THE_CACHE:
        return
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing and module.training:
            raise ValueError(
                f"S3R cannot generate while gradient checkpointing is on in training mode: transformers "
                f"{transformers.__version__} runs {name} without the KV cache then, even without gradients, so S3R's "
                "cache would get no keys or values; call model.gradient_checkpointing_disable() (or model.eval()) "
                "around generate, as TRL's trainers do, or upgrade transformers to 5.24 or later"
            )


def model_dropout(model: PreTrainedModel, training_modules_only: bool = False) -> str | None:
    """Where `model` applies dropout, in words (the first module with a non-zero rate), or None."""
    for name, module in model.named_modules():
        if training_modules_only and not module.training:
            continue
        if isinstance(module, _DROPOUT_MODULES):
            rate, where = module.p, f"dropout module {name!r} has p={module.p}"
        else:  # Llama-style attention modules keep their attention-dropout rate as a float
            rate = getattr(module, "attention_dropout", 0.0)
            where = f"{name}.attention_dropout is {rate}"
        if isinstance(rate, (int, float)) and rate > 0:
            return where
    return None


def context_window(model: PreTrainedModel) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)


def longrope_switch(model: PreTrainedModel) -> int | None:
    """The length past which a longrope model's rotary frequencies switch from its short factors to its long ones
    (`original_max_position_embeddings`; the smallest over layer types), or None if no layer uses longrope."""
    parameters = getattr(text_config(model), "rope_parameters", None) or {}
    per_layer_type = bool(parameters) and all(isinstance(value, dict) for value in parameters.values())
    entries = list(parameters.values()) if per_layer_type else [parameters]
    switches = [
        entry.get("original_max_position_embeddings")
        for entry in entries
        if (entry.get("rope_type") or entry.get("type")) == "longrope"
    ]
    switches = [s for s in switches if s is not None]
    return min(switches) if switches else None


def check_rope_frequencies(
    model: PreTrainedModel, prompts: list[torch.Tensor], max_new_tokens: int, lookahead: int
) -> None:
    """Refuse a call on a longrope model (Phi-3 and Phi-4-mini long-context checkpoints) whose positions can reach
    the length where its rotary frequencies switch.

    transformers picks a longrope layer's short or long factors for a whole forward from the forward's largest
    position, and rotates the keys it caches with them. Dense decoding crosses the switch at one step, with every
    row of its batch; S3R's draft and verify forwards hold other positions (up to `lookahead` ahead of the committed
    tokens, several requests packed together), so they would cross it at other steps, rotate some keys with the
    other factors, and sample something else. Below the switch every forward uses the short factors in both."""
    switch = longrope_switch(model)
    if switch is None or not prompts:
        return
    longest = max(prompt.shape[0] for prompt in prompts)
    if longest + max_new_tokens + lookahead > switch:
        room = switch - longest - lookahead
        remedy = f"ask for at most {room} new tokens" if room > 0 else "shorten the prompt"
        raise ContextWindowError(
            f"{type(model).__name__} uses longrope rotary embeddings, whose frequencies switch to the long factors "
            f"once a forward holds a position past original_max_position_embeddings={switch}; S3R's draft and verify "
            f"forwards would cross it at other steps than dense decoding (the {longest}-token prompt, "
            f"max_new_tokens={max_new_tokens} and draft_len={lookahead} reach {longest + max_new_tokens + lookahead}) "
            f"and would not sample what dense generate samples: {remedy}, or generate without s3r_config"
        )


# Logits processors whose output depends on more than the current scores and `input_ids` rows: they run a model or
# keep state from one call to the next. S3R calls processors on draft and verify scores of the same prefix, in an
# order of its own, so these would not compute what they compute in dense generate. Named by the option behind them.
_STATEFUL_PROCESSORS = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale (classifier-free guidance runs the model on the "
    "unconditional prompt, with a cache of its own)",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale (batched classifier-free guidance mixes the scores of the "
    "two halves of the batch)",
    "DiaClassifierFreeGuidanceLogitsProcessor": "guidance_scale (classifier-free guidance mixes the scores of the two "
    "halves of the batch)",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config (SynthID keeps a watermarking state across calls)",
    "WhisperNoSpeechDetection": "the Whisper no-speech detection (it runs the model)",
}


def check_logits_processors(processors) -> None:
    """Refuse logits processors that run a model or keep state across calls, where that can be seen: the known
    transformers ones, and any processor holding a `torch.nn.Module`. Warn once per class of a user's own processor
    what S3R asks of it, which no check can see (`RaggedLogitsProcessor` calls it)."""
    for processor in processors:
        name = type(processor).__name__
        if not type(processor).__module__.startswith("transformers."):
            logger.warning_once(
                f"S3R calls the logits processor {name} on draft and verify scores, more often than dense generate "
                "and one history length at a time, with the other rows of input_ids zero-filled: its output is the "
                "dense one only if it computes each row from that row's input_ids and scores alone and keeps no "
                "state across calls"
            )
        option = _STATEFUL_PROCESSORS.get(name)
        if option is not None:
            raise ValueError(f"S3R does not support {option}; generate without s3r_config for it")
        for attribute, value in getattr(processor, "__dict__", {}).items():
            if isinstance(value, torch.nn.Module):
                raise ValueError(
                    f"S3R does not support the logits processor {name}: it holds a model ({attribute}) to run on the "
                    "side, and S3R calls processors on draft and verify scores in an order dense generate does not, "
                    "so its results would differ"
                )


def check_context_window(model: PreTrainedModel, prompts: list[torch.Tensor], max_new_tokens: int) -> None:
    """Refuse prompts that fill the model's context window, and a call whose longest prompt plus `max_new_tokens`
    goes past it. Dense `generate` would go on at positions the model was never trained on; S3R would have to stop
    the row early instead, a different result. Either way the call asks for more than the model holds, so it is an
    error (a `ContextWindowError`, a `ValueError`), with the numbers."""
    window = context_window(model)
    if window is None or not prompts:
        return
    for row, prompt in enumerate(prompts):
        if prompt.shape[0] >= window:
            raise ContextWindowError(
                f"prompt {row} has {prompt.shape[0]} tokens, which leaves no room in the model's context window "
                f"of {window} tokens (max_position_embeddings)"
            )
    row = max(range(len(prompts)), key=lambda r: prompts[r].shape[0])
    longest = prompts[row].shape[0]
    if longest + max_new_tokens > window:
        raise ContextWindowError(
            f"max_new_tokens={max_new_tokens} after the {longest}-token prompt of row {row} goes past the model's "
            f"context window of {window} tokens (max_position_embeddings); ask for at most {window - longest} new "
            "tokens, or shorten the prompt"
        )
