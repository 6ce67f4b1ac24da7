"""`SparseSelfDraftCandidateGenerator`: S3R drafting inside transformers' own assisted-decoding loop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin

from s3r_hf.attention import s3r_attention
from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.cache.score_recorder import VerifyScoreRecorder
from s3r_hf.config import S3RConfig
from s3r_hf.engine import S3REngine, SamplingSetup
from s3r_hf.generate_kwargs import check_generate_call, streamer_ended_on_error
from s3r_hf.logits import RaggedLogitsProcessor
from s3r_hf.model_session import on_device
from s3r_hf.request import Request, RequestStatus
from s3r_hf.runtime_state import call_seed
from s3r_hf.sampler import call_generators
from s3r_hf.validation import check_rope_frequencies, prompt_rows

_SLOT = 0  # transformers' assisted loop runs batch size 1: one request in slot 0


class SparseSelfDraftCandidateGenerator(CandidateGenerator):
    """Drafts candidates with the target model itself under sparse attention over the shared `S3RCache`.

    In transformers' assisted loop the target model verifies the candidates with a plain dense forward over
    the same `S3RCache` (which it then crops to the accepted prefix); the S3R attention function records the
    verify block's attention scores during that forward, and `update_candidate_strategy` turns them into the
    next index views. Candidate logits are the processed proposal scores the drafts were sampled from, so
    transformers' speculative sampling stays exact.

    Args:
        model: the target model (also the drafter).
        cache: the `S3RCache` the assisted loop passes to the target model.
        s3r_config: draft length and sparse budget.
        generation_config: the call's generation config (sampling vs greedy, max length).
        logits_processor: the call's prepared logits processors (the same ones verify scores go through).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: S3RCache,
        s3r_config: S3RConfig,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
    ) -> None:
        self.model = model
        self.cache = cache
        self.config = s3r_config
        self.generation_config = generation_config
        generator, draft_generator = call_generators(call_seed(model, s3r_config), cache.device)
        sampling = SamplingSetup(
            logits_processor=RaggedLogitsProcessor(logits_processor, batch_size=1),
            greedy=not generation_config.do_sample,
            eos_token_ids=set(),
            stopping_criteria=StoppingCriteriaList(),
            generator=generator,
            draft_generator=draft_generator,
        )
        self.engine = S3REngine(model, s3r_config, sampling, cache)
        self.recorder = VerifyScoreRecorder(block_queries=s3r_config.draft_len + 1)
        self.cache.score_recorder = self.recorder

    @property
    def num_drafting_tokens(self) -> int:
        """Most tokens drafted per iteration (transformers' assisted loop reads it since 5.25, to size what its cache
        records for rollback)."""
        return self.config.draft_len

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft up to `draft_len` tokens after `input_ids` (`[1, L]`); the cache holds K/V of all but the last."""
        if input_ids.shape[0] != 1:
            raise ValueError("transformers' assisted decoding runs batch size 1")
        length = input_ids.shape[1]
        draft_len = min(self.config.draft_len, self.generation_config.max_length - length - 1)
        if draft_len <= 0:
            # No room for a draft: transformers' loop still runs the target forward, which then records nothing.
            self.recorder.num_candidates = 0
            return input_ids, None
        if _SLOT not in self.cache.lengths:
            self.cache.add_request()
        request = self._request(input_ids, draft_len)
        entry_length = self.cache.lengths[_SLOT]
        with s3r_attention(self.model, packed=True):
            if self.cache.lengths[_SLOT] < length - 1:
                self._prefill(request, length - 1)
            self.cache.reserve(_SLOT, length + draft_len)
            vocab = self.model.get_output_embeddings().weight.shape[0]
            draft_tokens = torch.zeros(1, draft_len, dtype=torch.long, device=self.cache.device)
            draft_scores = torch.zeros(1, draft_len, vocab, device=self.cache.device)
            for step in range(draft_len):
                self.engine.draft_pass(step, [request], [0], draft_tokens, draft_scores)
        # Drafts' provisional K/V are dropped; the target's dense forward rewrites those positions. On the first
        # call the target forward also recomputes the prompt (transformers' loop prefills it), so the cache goes
        # back to the length it had on entry.
        self.cache.set_length(_SLOT, entry_length)
        self.recorder.num_candidates = self.config.budget(length + draft_len)
        candidates = torch.cat([input_ids, draft_tokens.to(input_ids.device)], dim=1)
        return candidates, draft_scores.to(input_ids.device)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Refresh the index views from the verify scores the target forward just recorded."""
        recorded = self.recorder.take()
        if not recorded:
            return
        context = self.cache.lengths[_SLOT]
        history = min(self.recorder.history_len, context)
        slots = torch.tensor([_SLOT], device=self.cache.device)
        as_tensor = lambda value: torch.tensor([value], device=self.cache.device)  # noqa: E731
        for layer, candidates in recorded.items():
            self.cache.index_views.build(
                layer, slots, candidates, as_tensor(history), as_tensor(context), as_tensor(self.config.budget(context))
            )

    def _request(self, input_ids: torch.LongTensor, draft_len: int) -> Request:
        """The sequence as an engine request: committed K/V for all but the last token, which is pending."""
        length = input_ids.shape[1]
        tokens = torch.empty(length + draft_len + 1, dtype=torch.long)
        tokens[:length] = input_ids[0].cpu()
        request = Request(
            row=0, prompt_ids=tokens[: length - 1], tokens=tokens, length=length, max_new_tokens=draft_len + 1,
            status=RequestStatus.RUNNING, slot=_SLOT,
        )
        request.committed = length - 1
        request.pending = int(input_ids[0, -1])
        request.view_len = int(self.cache.index_views.lengths[_SLOT])
        return request

    def _prefill(self, request: Request, length: int) -> None:
        """First call: dense prefill of everything but the last token, and the first index views."""
        request.prefilled = self.cache.lengths[_SLOT]
        if request.prefilled >= length:
            return
        while request.prefilled < length:
            plan, finals, finished, _ = self.engine.prefill_forward([request])
        self.engine.refresh_views(plan, finals, finished, [length])


@contextlib.contextmanager
def _candidate_generator_override(model: PreTrainedModel, generator: CandidateGenerator) -> Iterator[None]:
    """Make `model._get_candidate_generator` return `generator` for the duration of the block."""
    model._get_candidate_generator = lambda *args, **kwargs: generator
    try:
        yield
    finally:
        del model._get_candidate_generator


def assisted_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: Any = None,
    s3r_config: S3RConfig | dict | None = None,
    **model_kwargs,
):
    """transformers' own assisted decoding loop with `SparseSelfDraftCandidateGenerator` (batch size 1).

    Use as `model.generate(input_ids, custom_generate=s3r_hf.assisted_generate, s3r_config=...)`.
    """
    config = S3RConfig.coerce(s3r_config)
    streamer = check_generate_call(model, generation_config, logits_processor, model_kwargs, streamer, synced_gpus)
    # transformers' loop ends the streamer when it finishes; until then a refusal or a failure ends it here.
    with streamer_ended_on_error(streamer):
        prompt_rows(input_ids, model_kwargs.get("attention_mask"), generation_config.pad_token_id)
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"assisted decoding runs batch size 1, got {input_ids.shape[0]} rows; use s3r_hf.generate"
            )
        if model_kwargs.get("attention_mask") is not None and not bool(model_kwargs["attention_mask"].all()):
            raise ValueError("assisted decoding with S3R takes an unpadded prompt")
        check_rope_frequencies(model, [input_ids[0]], generation_config.max_length - input_ids.shape[1],
                               config.draft_len)
        max_tokens = generation_config.max_length + config.draft_len + 1
        cache = S3RCache(
            model.config, num_pages=-(-max_tokens // config.page_size), page_size=config.page_size, max_requests=1,
            dtype=model.dtype, device=model.device,
        )
        cache_key = "cache" if "cache" in model_kwargs else "past_key_values"
        model_kwargs[cache_key] = cache
        model_kwargs.pop("position_ids", None)
        generator = SparseSelfDraftCandidateGenerator(model, cache, config, generation_config, logits_processor)
        with (
            _candidate_generator_override(model, generator),
            s3r_attention(model, packed=False),
            on_device(model.device),
        ):
            return GenerationMixin._assisted_decoding(
                model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                generation_config=generation_config, synced_gpus=False, streamer=streamer, **model_kwargs,
            )
