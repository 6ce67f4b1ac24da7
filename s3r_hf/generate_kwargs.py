"""`generate` arguments that transformers does not pass to a callable `custom_generate`, and how S3R gets them.

transformers 5.x calls a callable `custom_generate` with the arguments of its own sampling loop and the
callable's extra keywords only; `streamer`, `synced_gpus` and `tokenizer` are dropped on the way
(`GenerationMixin._extract_generation_mode_kwargs`). S3R recovers them as follows:

- `streamer` and `synced_gpus` are still arguments of transformers' `generate` frame, which is on the stack when
  it calls S3R: `dropped_generate_arguments` reads them there (transformers has already streamed the prompt).
- `tokenizer` is gone by then, and transformers needs it earlier, to build `StopStringCriteria` for
  `stop_strings`. `s3r_hf.enable`'s `generate` builds that criterion itself before calling transformers
  (`stop_strings_as_criterion`). With `custom_generate=s3r_hf.generate` and no `enable`, `stop_strings` is refused
  by transformers itself ("could not locate a tokenizer").
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.generation.utils import GenerationMixin
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module

from s3r_hf.model_session import check_not_nested
from s3r_hf.sharding import is_gathered
from s3r_hf.validation import (
    check_checkpointing_keeps_the_cache,
    check_generation_config,
    check_logits_processors,
    check_model_inputs,
    check_model_supported,
    check_no_active_dropout,
)

# The code object of transformers' own `generate` (under its decorators), to find its frame on the stack.
_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__
_MAX_FRAMES = 16  # S3R's `generate` is called by transformers' directly; a few wrappers in between at most


def check_generate_call(
    model: PreTrainedModel,
    generation_config: GenerationConfig,
    logits_processor: LogitsProcessorList,
    model_kwargs: dict[str, Any],
    streamer: Any,
    synced_gpus: bool,
) -> Any:
    """The checks both S3R decoding methods run before anything else (not nested in another S3R call on the model,
    model, generation options, inputs, training mode, logits processors, `synced_gpus`); returns the streamer, the
    one transformers dropped included. A refusal ends that streamer (`streamer_ended_on_error`)."""
    dropped = dropped_generate_arguments()  # transformers 5.x does not pass these to a callable custom_generate
    streamer = streamer if streamer is not None else dropped.get("streamer")
    with streamer_ended_on_error(streamer):
        check_not_nested(model)
        check_model_supported(model)
        check_generation_config(generation_config)
        check_not_synced(model, synced_gpus or dropped.get("synced_gpus"))
        check_model_inputs(model_kwargs)
        check_no_active_dropout(model)
        check_checkpointing_keeps_the_cache(model)
        check_logits_processors(logits_processor)
    return streamer


@contextlib.contextmanager
def streamer_ended_on_error(streamer: Any) -> Iterator[None]:
    """End `streamer` if the block raises. transformers has fed it the prompt before S3R runs, so a call that S3R
    refuses must end it, or a consumer in another thread (`TextIteratorStreamer`) waits forever."""
    try:
        yield
    except BaseException:
        if streamer is not None:
            streamer.end()
        raise


def dropped_generate_arguments() -> dict[str, Any]:
    """`streamer` and `synced_gpus` of the transformers `generate` call that is calling S3R ({} if none is)."""
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        if frame.f_code is _GENERATE_CODE:
            arguments = frame.f_locals
            return {name: arguments.get(name) for name in ("streamer", "synced_gpus")}
        frame = frame.f_back
    return {}


def check_not_synced(model: PreTrainedModel, synced_gpus: bool | None) -> None:
    """Refuse `synced_gpus` (set, or implied as transformers implies it: DeepSpeed ZeRO-3 or FSDP over several
    processes), where every process must keep running forwards until all are done."""
    if is_gathered(model):  # full parameters for the whole call: no forward runs a collective
        return
    if synced_gpus is None:
        synced_gpus = (is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)) and _world_size() > 1
    if synced_gpus:
        raise ValueError(
            "S3R does not support synced_gpus=True (DeepSpeed ZeRO-3 / FSDP generation, where every process must "
            "keep running forwards until all have finished); for an FSDP2 model, generate inside "
            "`with s3r_hf.gathered_parameters(model):`, or without s3r_config, or on an unsharded model"
        )


def _world_size() -> int:
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1


def arguments_by_name(generate: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call `generate(*args, **kwargs)` (transformers' bound `generate`) as keywords, so that one
    passed by position (`model.generate(input_ids, generation_config)`) is seen where it is looked up by name."""
    positional = [
        parameter.name
        for parameter in inspect.signature(generate).parameters.values()
        if parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(args) > len(positional):
        raise TypeError(f"generate takes at most {len(positional)} positional arguments, got {len(args)}")
    named = dict(zip(positional, args))
    twice = sorted(named.keys() & kwargs.keys())
    if twice:
        raise TypeError(f"generate got multiple values for argument {twice[0]!r}")
    return {**named, **kwargs}


def requested_option(model: PreTrainedModel, kwargs: dict[str, Any], name: str) -> Any:
    """The value of generation option `name` that `generate` would use: the call's keyword (also as an explicit
    None, as in transformers' `generate`), else the passed `generation_config`'s, else the model's."""
    if name in kwargs:
        return kwargs[name]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def check_no_token_healing(model: PreTrainedModel, kwargs: dict[str, Any]) -> None:
    """For `enable`'s `generate`: refuse `token_healing` by name. transformers drops the tokenizer it needs on the
    way to S3R and would ask for a tokenizer the caller passed."""
    if requested_option(model, kwargs, "token_healing"):
        raise ValueError(
            "token_healing=True is not supported with s3r_config: heal the prompts first with "
            "model.heal_tokens(input_ids, tokenizer) and generate from the healed ids"
        )


def stop_strings_as_criterion(model: PreTrainedModel, kwargs: dict[str, Any]) -> dict[str, Any]:
    """For `enable`'s `generate`: turn `stop_strings` (from the call, its `generation_config` or the model's) and
    `tokenizer` into a `StopStringCriteria` in `stopping_criteria`, which does reach S3R. Returns the new kwargs;
    without a tokenizer they are unchanged (and transformers refuses stop strings as dense generate does)."""
    tokenizer = kwargs.get("tokenizer")
    if tokenizer is None:
        return kwargs
    stop_strings = requested_option(model, kwargs, "stop_strings")
    if not stop_strings:
        return kwargs
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    # `stop_strings=None` outranks the generation configs, so transformers does not build (and fail on) its own.
    overrides = {"stop_strings": None}
    config = kwargs.get("generation_config")
    model_stop_strings = getattr(getattr(model, "generation_config", None), "stop_strings", None)
    if config is not None and "stop_strings" not in kwargs and model_stop_strings is None:
        # The same inside the caller's config, where transformers does not warn of generation arguments passed beside
        # it (it would fill a None back from the model's config, hence only when that has none).
        config = copy.deepcopy(config)
        config.stop_strings = None
        overrides = {"generation_config": config}
    return {**kwargs, "stopping_criteria": criteria, **overrides}
