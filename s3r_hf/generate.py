"""Entry points: `generate` (a transformers `custom_generate` decoding method) and `enable(model)`."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from s3r_hf.cache.page_allocator import KVCapacityError
from s3r_hf.cache.s3r_cache import S3RCache, page_bytes
from s3r_hf.compiled_layers import check_no_hooks_in_layers
from s3r_hf.config import S3RConfig
from s3r_hf.draft_policy import DraftLengthPolicy
from s3r_hf.engine import S3REngine, SamplingSetup
from s3r_hf.fused_layers import check_fusable
from s3r_hf.generate_kwargs import (
    arguments_by_name,
    check_generate_call,
    check_no_token_healing,
    stop_strings_as_criterion,
    streamer_ended_on_error,
)
from s3r_hf.logits import RaggedLogitsProcessor
from s3r_hf.model_session import hold, on_device
from s3r_hf.request import Request
from s3r_hf.runtime_state import ModelRuntime, adaptive_policy, call_seed, runtime_for
from s3r_hf.sampler import call_generators
from s3r_hf.stats import S3RStats
from s3r_hf.stopping import BatchStopping
from s3r_hf.validation import (
    check_context_window,
    check_model_supported,
    check_rope_frequencies,
    prompt_rows,
)

logger = logging.get_logger(__name__)


@dataclass
class S3RGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus what S3R measured.

    Args:
        s3r_stats: drafted/accepted counts, acceptance rate, τ, per-position acceptance.
        logprobs: `[batch, generated]` dense log-probability of each generated token under the processed target
            distribution (what the token was sampled from); `0` after a row finished. Only with
            `S3RConfig(return_logprobs=True)`.
    """

    s3r_stats: S3RStats | None = None
    logprobs: torch.Tensor | None = None


def generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: Any = None,
    s3r_config: S3RConfig | dict | None = None,
    s3r_mode: str = "s3r",
    s3r_forced_acceptance: float | None = None,
    s3r_timing: bool | str = False,
    s3r_draft_policy: DraftLengthPolicy | None = None,
    **model_kwargs,
) -> S3RGenerateOutput | torch.LongTensor:
    """S3R decoding method for `model.generate(..., custom_generate=s3r_hf.generate, s3r_config=...)`.

    transformers prepares everything as for its own decoding methods (generation config, expanded
    `num_return_sequences` rows, logits processors, stopping criteria); this function replaces the decoding
    loop with S3R's draft–verify–exact-sample rounds. The result is distributed exactly as the dense model's
    `generate` output, and greedy results are token-identical up to floating-point ties.

    Diagnostics and benchmarks (see `S3REngine`): `s3r_mode="ar"` decodes densely in the same engine,
    `s3r_mode="unverified"` commits the sparse drafter's tokens without verification (NOT exact; it shows that the
    exactness tests can tell the difference), `s3r_forced_acceptance=p` fixes the acceptance pattern of
    random-weight models (NOT exact), `s3r_timing=True` records device-synchronized prefill and decode
    times, `s3r_timing="stages"` also the time of each stage of a round (draft, verify, accept, refresh).
    `s3r_draft_policy` replaces the rule that chooses each round's draft length (`s3r_hf.draft_policy`; tests use
    it to vary `k` from round to round).
    """
    config = S3RConfig.coerce(s3r_config)
    streamer = check_generate_call(model, generation_config, logits_processor, model_kwargs, streamer, synced_gpus)
    # Until `stopping` owns the streamer (and ends it in any case), a refusal ends it here.
    with streamer_ended_on_error(streamer):
        if config.return_logprobs and not generation_config.return_dict_in_generate:
            logger.warning_once(
                "S3RConfig(return_logprobs=True) is ignored without return_dict_in_generate=True (generate then "
                "returns the sequences tensor only, as it ignores output_scores)"
            )
        attention_mask = model_kwargs.get("attention_mask")
        prompts = prompt_rows(input_ids, attention_mask, generation_config.pad_token_id)
        padded_len = input_ids.shape[1]
        eos_ids, max_length = _native_stops(stopping_criteria, generation_config)
        max_new = max(max_length - padded_len, 1)  # dense generates one token before it asks a criterion to stop
        check_context_window(model, prompts, max_new)
        check_rope_frequencies(model, prompts, max_new, config.draft_len)
        for option in ("compile_layers", "fused_layers"):
            if getattr(config, option):
                check_no_hooks_in_layers(model, option)
        if config.fused_layers:
            check_fusable(model)  # before a KV pool is allocated or a request admitted

        device = model.device
        greedy = not generation_config.do_sample
        generator, draft_generator = call_generators(call_seed(model, config), device)
        custom_criteria = StoppingCriteriaList(
            c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))
        )
        output_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        requests = _requests(input_ids, prompts, max_new, config)
        # Criteria and streamer are fed whole-batch steps as dense generate feeds them (EOS and max length: the
        # engine).
        stopping = BatchStopping(
            custom_criteria, requests, input_ids, _pad_token_id(generation_config), streamer=streamer,
            scores=output_scores,
            # dense's test for padding finished rows, as written there
            pads_stopped_rows=any(hasattr(c, "eos_token_id") for c in stopping_criteria),
        )
    try:
        sampling = SamplingSetup(
            logits_processor=RaggedLogitsProcessor(logits_processor, batch_size=input_ids.shape[0]),
            greedy=greedy,
            eos_token_ids=eos_ids,
            stopping_criteria=stopping,
            generator=generator,
            draft_generator=draft_generator,
            output_scores=output_scores,
            output_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
        )
        # The model's kept runtime is this call's until it returns: another thread's call waits
        # (`model_session.hold`).
        with hold(model), on_device(device):
            if s3r_draft_policy is None:
                s3r_draft_policy = _kept_policy(model, config, s3r_mode)
            runtime = runtime_for(model) if config.keep_state else ModelRuntime()
            runtime.check_model(model)
            cache = _kv_pool(runtime, requests, config, model, device)
            engine = S3REngine(
                model, config, sampling, cache, mode=s3r_mode, forced_acceptance=s3r_forced_acceptance,
                timing=s3r_timing, draft_policy=s3r_draft_policy, runtime=runtime,
            )
            try:
                stats = engine.run(requests)
            except BaseException:
                # A call that failed part-way (a stopping criterion raised, memory ran out during a capture) leaves
                # nothing the next call could trust.
                runtime.drop_device_state()
                raise
    finally:
        stopping.end()  # also after a refusal or a failure, so that a streamer's consumer does not wait forever
    return _assemble(input_ids, requests, generation_config, stats, config)


def _requests(
    input_ids: torch.LongTensor, prompts: list[torch.Tensor], max_new: int, config: S3RConfig
) -> list[Request]:
    """One request per row, its token buffer sized for the prompt, `max_new` tokens and a last round's drafts."""
    padded_len = input_ids.shape[1]
    requests = []
    for row, prompt in enumerate(prompts):
        tokens = torch.empty(padded_len + max_new + config.draft_len + 1, dtype=torch.long)
        tokens[:padded_len] = input_ids[row].cpu()
        requests.append(
            Request(row=row, prompt_ids=prompt.cpu(), tokens=tokens, length=padded_len, max_new_tokens=max_new)
        )
    return requests


def _kv_pool(
    runtime: ModelRuntime, requests: list[Request], config: S3RConfig, model: PreTrainedModel, device: torch.device
) -> S3RCache:
    """The runtime's kept pool when the call fits it, else a new one (the old one freed first, so its memory counts
    as free when the new one is sized)."""
    peaks = [-(-r.peak_kv_tokens(config.draft_len) // config.page_size) for r in requests]
    wanted = config.num_pages or max(1, sum(peaks))
    cache = runtime.reusable_cache(model, config, wanted, max(peaks, default=1), len(requests), device)
    if cache is not None:
        return cache
    runtime.drop_device_state()
    cache = S3RCache(
        model.config,
        num_pages=config.num_pages or _default_num_pages(peaks, config, model, device),
        page_size=config.page_size,
        max_requests=len(requests),
        dtype=model.dtype,
        device=device,
    )
    runtime.adopt_cache(cache, model, wanted)
    return cache


def _default_num_pages(peaks: list[int], config: S3RConfig, model: PreTrainedModel, device: torch.device) -> int:
    """The pool when `num_pages` is not set: every request at full length (`peaks`: each one's pages), capped on
    CUDA by `kv_memory_fraction` of the free device memory (the scheduler then runs what fits and the rest waits)."""
    wanted = max(1, sum(peaks))
    free = _free_device_memory(device)
    if free is None:
        return wanted
    size = page_bytes(model.config, config.page_size, model.dtype)
    fits = int(free * config.kv_memory_fraction) // size - 1  # the cache adds one scratch page
    if fits < max(peaks, default=1):
        raise KVCapacityError(
            f"KV capacity too small for one request: the longest needs {max(peaks)} pages of {size} bytes, and "
            f"kv_memory_fraction={config.kv_memory_fraction} of the {free / 2**30:.2f} GiB free on {device} holds "
            f"{max(fits, 0)}; raise kv_memory_fraction, shorten the request, or set num_pages"
        )
    if fits < wanted:
        logger.info(
            f"KV pool capped at {fits} of the {wanted} pages all requests would take at full length "
            f"(kv_memory_fraction={config.kv_memory_fraction} of {free / 2**30:.2f} GiB free)"
        )
    return min(wanted, fits)


def _free_device_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device, counting what torch's caching allocator holds unused (an earlier call's pools
    and graphs); None elsewhere (CPU pools are sized for every request)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _kept_policy(model: PreTrainedModel, config: S3RConfig, mode: str) -> DraftLengthPolicy | None:
    """Exact S3R with adaptive draft lengths continues from the costs and acceptance earlier calls measured on this
    model (`runtime_state.py`); other modes use the engine's own rule."""
    return adaptive_policy(model, config) if mode == "s3r" and config.adaptive else None


def _native_stops(stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig) -> tuple[set[int], int]:
    """The EOS tokens and the max length the engine stops rows on itself: those of the call's `EosTokenCriteria` and
    `MaxLengthCriteria`. transformers builds them from the generation config, and one of the same type that the
    caller passes in `stopping_criteria` replaces its own, so these, not the config, say where dense decoding stops."""
    lengths = [c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)]
    eos = [torch.as_tensor(c.eos_token_id).flatten() for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
    eos_ids = set(torch.cat(eos).tolist()) if eos else set()
    return eos_ids, min(lengths) if lengths else generation_config.max_length


def _pad_token_id(generation_config: GenerationConfig) -> int:
    pad = generation_config._pad_token_tensor
    return int(pad) if pad is not None else 0


def _assemble(input_ids, requests, generation_config, stats, config) -> S3RGenerateOutput | torch.LongTensor:
    """Pack results the way `generate` does: prompt rows, then generated tokens padded with the pad token."""
    pad_id = _pad_token_id(generation_config)
    width = max((len(r.generated) for r in requests), default=0)
    generated = torch.full((len(requests), width), pad_id, dtype=torch.long, device=input_ids.device)
    for request in requests:
        generated[request.row, : len(request.generated)] = torch.tensor(request.generated, dtype=torch.long)
    sequences = torch.cat([input_ids, generated], dim=1)
    if not generation_config.return_dict_in_generate:
        sequences.s3r_stats = stats  # type: ignore[attr-defined]  # plain tensors carry the stats too
        return sequences
    logprobs = None
    if config.return_logprobs:
        logprobs = torch.zeros(len(requests), width, dtype=torch.float32, device=input_ids.device)
        for request in requests:
            logprobs[request.row, : len(request.logprobs)] = torch.tensor(request.logprobs)
    return S3RGenerateOutput(
        sequences=sequences,
        scores=_per_step(requests, width, "scores") if generation_config.output_scores else None,
        logits=_per_step(requests, width, "raw_logits") if generation_config.output_logits else None,
        s3r_stats=stats,
        logprobs=logprobs,
    )


def _per_step(requests: list[Request], width: int, attribute: str) -> tuple[torch.Tensor, ...]:
    """`generate`'s per-step tuple of `[batch, vocab]` tensors; rows that already finished hold zeros."""
    steps = []
    for step in range(width):
        rows = [getattr(r, attribute) for r in requests]
        reference = next(values[step] for values in rows if len(values) > step)
        steps.append(
            torch.stack([values[step] if len(values) > step else torch.zeros_like(reference) for values in rows])
        )
    return tuple(steps)


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Let `model.generate(..., s3r_config=...)` run S3R; without `s3r_config`, `generate` is unchanged.

    Idempotent; returns the model. Raises `UnsupportedModelError` for models S3R cannot run.
    """
    check_model_supported(model)
    if getattr(model, "_s3r_enabled", False):
        return model

    # Methods bound to the model, not closures over it: `copy.deepcopy` rebinds a bound method to the copy, so a
    # copy of an enabled model generates with its own weights.
    @functools.wraps(model.generate)
    def generate_with_s3r(self, *args, s3r_config: S3RConfig | dict | None = None, **kwargs):
        original_generate = self._s3r_original_generate
        if s3r_config is None:
            ours = sorted(key for key, value in kwargs.items() if key.startswith("s3r_") and value is not None)
            if ours:  # transformers would refuse them with a hint to call enable, which was called
                raise ValueError(f"generate received {ours} without s3r_config; pass s3r_config=S3RConfig(...) "
                                 "(or {} for the defaults) to run S3R")
            return original_generate(*args, **kwargs)
        kwargs = arguments_by_name(original_generate, args, kwargs)
        if kwargs.pop("custom_generate", None) is not None:  # None is generate's own default: nothing asked
            raise ValueError("pass either s3r_config or custom_generate to generate, not both")
        if kwargs.get("assistant_model") is not None:
            raise ValueError("S3R drafts with the model itself; assistant_model cannot be combined with s3r_config")
        check_no_token_healing(self, kwargs)
        kwargs = stop_strings_as_criterion(self, kwargs)  # transformers would drop the tokenizer they need
        return original_generate(custom_generate=generate, s3r_config=s3r_config, **kwargs)

    model._s3r_original_generate = model.generate
    model.generate = types.MethodType(generate_with_s3r, model)
    model._s3r_enabled = True
    return model
