"""Checks that a model, a generation setup and the inputs are something S3R can run exactly."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedModel


class UnsupportedModelError(ValueError):
    """The model's architecture or attention cannot run under S3R."""


def text_config(model: PreTrainedModel):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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


def check_generation_config(generation_config: GenerationConfig) -> None:
    """S3R implements greedy decoding and multinomial sampling, one beam per sequence."""
    if generation_config.num_beams is not None and generation_config.num_beams > 1:
        raise ValueError(
            f"S3R does not support beam search (num_beams={generation_config.num_beams}); use num_beams=1 with "
            "greedy decoding or sampling"
        )
    if getattr(generation_config, "num_beam_groups", 1) not in (None, 1):
        raise ValueError("S3R does not support group beam search (num_beam_groups > 1)")
    if getattr(generation_config, "penalty_alpha", None) is not None and getattr(generation_config, "top_k", 1) > 1:
        raise ValueError("S3R does not support contrastive search (penalty_alpha)")
    if getattr(generation_config, "prompt_lookup_num_tokens", None) is not None:
        raise ValueError("S3R drafts with the model itself; prompt_lookup_num_tokens cannot be combined with it")


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Real tokens of each left-padded row; raise `ValueError` for empty rows or padding that is not on the left."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2D (batch, sequence), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError("S3R got an empty prompt: input_ids has sequence length 0")
    if attention_mask is None:
        return list(input_ids)
    mask = attention_mask.to(torch.bool)
    rows = []
    for row, (ids, row_mask) in enumerate(zip(input_ids, mask)):
        count = int(row_mask.sum())
        if count == 0:
            raise ValueError(f"S3R got an empty prompt: row {row} of attention_mask is all zeros")
        if not bool(row_mask[-count:].all()):
            raise ValueError(
                f"row {row} of attention_mask is not left-padded; decoder-only generation needs "
                "padding_side='left' (padding only before the prompt)"
            )
        rows.append(ids[-count:])
    return rows


def context_window(model: PreTrainedModel) -> int | None:
    return getattr(text_config(model), "max_position_embeddings", None)


def check_prompt_lengths(model: PreTrainedModel, prompts: list[torch.Tensor]) -> None:
    window = context_window(model)
    if window is None:
        return
    for row, prompt in enumerate(prompts):
        if prompt.shape[0] >= window:
            raise ValueError(
                f"prompt {row} has {prompt.shape[0]} tokens, which leaves no room in the model's context window "
                f"of {window} tokens (max_position_embeddings)"
            )
