"""`S3REngine`: prefill, sparse drafting, dense verification and exact sampling over many requests.

Stages run in lockstep (all running requests draft, then all verify); every forward packs the requests'
tokens into one varlen batch described by a `StepPlan`, so mixed-stage steps can come later without a rewrite.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import PreTrainedModel, StoppingCriteriaList
from transformers.utils import logging

from s3r_hf.attention import s3r_attention
from s3r_hf.cache.page_allocator import KVCapacityError
from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.compiled_layers import compile_counters, compiled_decoder_layers, fused_projections_for
from s3r_hf.config import S3RConfig
from s3r_hf.cuda_graphs import DecodeGraphs
from s3r_hf.draft_phase import DraftInputs, DraftOutputs, DraftPhase
from s3r_hf.draft_policy import DraftLengthPolicy, FixedDraftLength, RoundShape, adaptive_for
from s3r_hf.kernels import get_backend
from s3r_hf.logits import RaggedLogitsProcessor
from s3r_hf.request import Request, RequestStatus
from s3r_hf.runtime_state import ModelRuntime
from s3r_hf.sampler import draw_noise, sample_from_scores, speculative_accept
from s3r_hf.scheduler import AIMDConcurrency
from s3r_hf.staging import start_host_copy, to_device
from s3r_hf.stats import S3RStats
from s3r_hf.step_plan import DenseSegments, SparseQueries, StepPlan
from s3r_hf.stopping import BatchStopping

logger = logging.get_logger(__name__)


@dataclass
class SamplingSetup:
    """How tokens are chosen and when a response stops, as prepared by `generate`."""

    logits_processor: RaggedLogitsProcessor
    greedy: bool
    eos_token_ids: set[int]
    stopping_criteria: StoppingCriteriaList | BatchStopping  # criteria other than max length and EOS, fed whole steps
    generator: torch.Generator | None
    output_scores: bool = False
    output_logits: bool = False


@dataclass
class _PrelaunchedDrafts:
    """A round's draft phase, launched before the host read the decision of the round before it
    (`S3REngine._prelaunch`). `draft_counts` are the host's copy of what the device computed, set once the host
    has read that decision."""

    requests: list[Request]
    tables: torch.Tensor
    drafts: DraftOutputs
    draft_counts: list[int] | None = None


class _Verified(NamedTuple):
    """A verify forward's plan, logits `[N, V]`, block starts (`N` offsets per request, then the end) and
    processed target scores `[R, k + 1, V]`."""

    plan: StepPlan
    logits: torch.Tensor
    block_starts: list[int]
    target_scores: torch.Tensor


@dataclass
class _PrelaunchedStep:
    """The next dense step's forward, launched before the host read this step's tokens
    (`S3REngine._prelaunch_dense_step`); `scored` when it records the scores of an index-view refresh."""

    requests: list[Request]
    verified: _Verified
    scored: bool = False


def _launched_rows(launched: list[Request], requests: list[Request]) -> list[int | None]:
    """Row of each of `requests` in work launched early for `launched` (None for a request it did not cover)."""
    index = {id(request): row for row, request in enumerate(launched)}
    return [index.get(id(request)) for request in requests]


class S3REngine:
    """Runs a batch of `Request`s to completion with S3R.

    Args:
        model: the causal LM (its own modules do everything but attention).
        config: the S3R configuration.
        sampling: logits processors, greedy/sample, stop rules, random generator.
        cache: the `S3RCache` to use (sized by the caller).
        mode: `"s3r"` (exact speculative rounds); `"ar"` (dense autoregressive decoding in the same engine, the
            baseline S3R is measured against); `"unverified"` (diagnostic, NOT exact: commit the sparse
            drafter's tokens without the acceptance test, what a plain sparse rollout samples; it exists to show
            that the exactness tests have power).
        forced_acceptance: benchmark-only, NOT exact: accept each draft with this probability instead of the
            ratio test, so random-weight models can time the cost side of a given acceptance pattern.
        timing: synchronize the device around prefill and decoding and record their wall time in the stats;
            `"stages"` also times each stage of a round (`S3RStats.stage_seconds`; adds synchronizations).
        draft_policy: chooses each round's draft length (`draft_policy.py`); by default `AdaptiveDraftLength` when
            `config.adaptive`, else the fixed `config.draft_len` (`0` in mode `"ar"`).
        runtime: the model's runtime that holds `cache` (`runtime_state.py`): its CUDA graphs and fused weights are
            reused and kept for later calls. By default one made for this engine alone.
    """

    MODES = ("s3r", "ar", "unverified")

    def __init__(
        self,
        model: PreTrainedModel,
        config: S3RConfig,
        sampling: SamplingSetup,
        cache: S3RCache,
        mode: str = "s3r",
        forced_acceptance: float | None = None,
        timing: bool | str = False,
        draft_policy: DraftLengthPolicy | None = None,
        runtime: ModelRuntime | None = None,
    ) -> None:
        if mode not in self.MODES:
            raise ValueError(f"engine mode must be one of {self.MODES}, got {mode!r}")
        if timing not in (True, False, "stages"):
            raise ValueError(f"timing must be True, False or 'stages', got {timing!r}")
        if forced_acceptance is not None and not 0.0 <= forced_acceptance <= 1.0:
            raise ValueError(f"forced_acceptance must be in [0, 1], got {forced_acceptance}")
        self.model = model
        self.config = config
        self.sampling = sampling
        self.cache = cache
        self.mode = mode
        self.forced_acceptance = forced_acceptance
        self.timing = timing
        self.device = cache.device
        self.stats = S3RStats()
        self.concurrency = AIMDConcurrency(config)
        self.num_layers = cache.num_layers
        if runtime is None:
            runtime = ModelRuntime()
            runtime.adopt_cache(cache, model, cache.num_pages)
        elif runtime.cache is not cache:
            raise ValueError("the engine's cache must be its runtime's pool (ModelRuntime.adopt_cache)")
        self.runtime = runtime
        # Held by the draft phase and the graphs too; it does not point back at the engine (see model_forward.py).
        self._model_logits = runtime.forward
        self.graphs: DecodeGraphs | None = None
        # The next round's draft phase, when it could be launched before this round's host commit.
        self._prelaunched: _PrelaunchedDrafts | None = None
        self._prelaunched_step: _PrelaunchedStep | None = None  # engine AR's counterpart
        self._may_prelaunch = False
        self._rounds_since_refresh = 0  # rounds whose views were only extended (`S3RConfig.refresh_interval`)
        self.policy = draft_policy if draft_policy is not None else self.default_policy(config, mode)
        self._round_k = 0  # the draft length of the round being planned or run
        self._next_k: int | None = None  # the next round's draft length, when chosen while this round ran
        # Dense steps (k = 0) neither score nor extend the index views; a round that drafts after them first runs
        # one scored dense step to rebuild the views (a refresh step).
        self._views_stale = False
        # (shape, k, start, capture seconds, whether the round before had the same k)
        self._timed_round: tuple[RoundShape, int, float, float, bool] | None = None
        self._previous_k: int | None = None  # the draft length of the previous round (a refresh step counts as 0)
        self._captured_before_stage = 0.0  # capture seconds already counted when the current stage began
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        # The round's draft passes run as one device-side program unless a logits processor reads the history
        # (then each pass goes back to the host, which writes the provisional drafts into the histories).
        self.draft_phase: DraftPhase | None = None
        if mode != "ar" and sampling.logits_processor.history_free:
            self.draft_phase = DraftPhase(
                self._model_logits, sampling.logits_processor, config.draft_len, cache.page_size,
                cache.scratch_page * cache.page_size, sampling.greedy, self.vocab_size,
            )

    # ================================================================ scheduling
    def run(self, requests: list[Request]) -> S3RStats:
        """Generate until every request finishes; requests are filled in place."""
        for request in requests:
            self._check_fits_alone(request)
        captured_before = (0, 0.0)
        if self.config.cuda_graphs and self.device.type == "cuda" and requests:
            longest = max(r.peak_kv_tokens(self.config.draft_len) for r in requests)
            self.graphs = self.runtime.graphs_for(self.cache.pages_for(longest), self.config)
            self.graphs.keep_draft_phases_of(self.draft_phase)
            captured_before = (self.graphs.captures, self.graphs.capture_seconds)
            # Index views at their largest from the start: growing them would invalidate the draft graphs. A view
            # never holds more than the context, whatever the slack between refreshes.
            max_view = min(self.graphs.max_candidates + self._extension_slack(), self.graphs.max_context)
            self.cache.index_views.ensure_capacity(max_view)
        waiting = deque(requests)
        running: list[Request] = []
        paused: deque[Request] = deque()
        compiled = contextlib.nullcontext()
        compiled_before = compile_counters() if self.config.compile_layers else (0, 0.0)
        if self.config.compile_layers:
            fused = self.runtime.fused_projections(lambda: fused_projections_for(self.model))
            compiled = compiled_decoder_layers(self.model, fused)
        # Wall time is split between prefill and decoding at the switches between them only (the device is
        # synchronized there when timing), so consecutive rounds keep overlapping as they do untimed.
        phase, phase_started = None, 0.0
        with s3r_attention(self.model, packed=True), compiled:
            while waiting or running or paused:
                self._restore_and_admit(waiting, running, paused)
                prefilling = [r for r in running if r.prefilled < r.prompt_len]
                step_kind = "prefill" if prefilling else "decode"
                if phase != step_kind:
                    phase_started, phase = self._end_phase(phase, phase_started), step_kind
                if prefilling:
                    self._prefill_step(prefilling)
                    self._timed_round = None  # the interval around a prefill step is no round's cost
                    self._previous_k = None
                else:
                    self._round_k = self._choose_draft_len(running)
                    self._make_room_for_round(running, paused)
                    # With stage timing every stage stays apart.
                    self._may_prelaunch = self.timing != "stages"
                    # A profiler marker (tools/profile_engine.py counts the kernels launched after the first one).
                    with torch.profiler.record_function("s3r_hf.decode_round"):
                        self._round(running, self._round_k)
                for request in [r for r in running if r.status is RequestStatus.FINISHED]:
                    running.remove(request)
                    self.cache.release(request.slot)
                    request.slot = None
                self.concurrency.update(self.cache.utilization, len(paused))
            self._end_phase(phase, phase_started)
        if self.config.compile_layers:
            graphs, seconds = compile_counters()
            self.stats.compiled_graphs = graphs - compiled_before[0]
            self.stats.compile_seconds = seconds - compiled_before[1]
            if self.stats.compiled_graphs:
                logger.info(f"compiled {self.stats.compiled_graphs} graphs for new shapes in "
                            f"{self.stats.compile_seconds:.1f} s")
        if self.graphs is not None:  # this call's captures (the graphs may be kept from earlier calls)
            self.stats.graph_captures = self.graphs.captures - captured_before[0]
            self.stats.graph_capture_seconds = self.graphs.capture_seconds - captured_before[1]
        return self.stats

    def _end_phase(self, phase: str | None, started: float) -> float:
        """Add the time since `started` to the `phase` ("prefill" or "decode") totals; returns the time now."""
        now = self._clock()
        if phase == "prefill":
            self.stats.prefill_seconds += now - started
        elif phase == "decode":
            self.stats.decode_seconds += now - started
        return now

    def _clock(self) -> float:
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _stage_done(self, stage: str, started: float) -> float:
        """With `timing="stages"`, add the time since `started` to `stage`, CUDA-graph captures left out (they are
        reported apart); returns the new start."""
        if self.timing != "stages":
            return started
        now = self._clock()
        captured = self._capture_seconds()
        elapsed = now - started - (captured - self._captured_before_stage)
        self._captured_before_stage = captured
        self.stats.stage_seconds[stage] = self.stats.stage_seconds.get(stage, 0.0) + elapsed
        return now

    def _capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs is not None else 0.0

    def _pages_needed(self, request: Request) -> int:
        """Pages for the request's context plus one full round."""
        return self.cache.pages_for(request.kv_tokens + self.config.draft_len + 1)

    def _check_fits_alone(self, request: Request) -> None:
        longest = request.peak_kv_tokens(self.config.draft_len)
        if self.cache.pages_for(longest) > self.cache.num_pages:
            raise KVCapacityError(
                f"KV capacity too small for one request: a prompt of {request.prompt_len} tokens with "
                f"max_new_tokens={request.max_new_tokens} needs {self.cache.pages_for(longest)} pages of "
                f"{self.cache.page_size} tokens, the cache has {self.cache.num_pages}"
            )

    def _restore_and_admit(self, waiting: deque, running: list, paused: deque) -> None:
        """Restore paused requests first, then admit new ones, under the concurrency limit and KV capacity.

        Pages a running request will still take for its prompt (prefill reserves chunk by chunk) count as taken.
        """
        promised = sum(
            max(0, self._pages_needed_for_prompt(r) - len(self.cache.page_lists[r.slot]))
            for r in running if r.prefilled < r.prompt_len
        )
        while paused and len(running) < self.concurrency.limit:
            request = paused[0]
            if self.cache.allocator.num_free - promised < self._pages_needed(request):
                break
            paused.popleft()
            self.cache.restore(request.slot, request.offloaded)
            request.offloaded = None
            request.status = RequestStatus.RUNNING
            running.append(request)
        if paused:
            return
        available = self.cache.allocator.num_free - promised
        while waiting and len(running) < self.concurrency.limit:
            request = waiting[0]
            needed = self._pages_needed_for_prompt(request)
            if running and available < needed:
                break
            available -= needed
            waiting.popleft()
            request.slot = self.cache.add_request()
            request.status = RequestStatus.RUNNING
            running.append(request)

    def _pages_needed_for_prompt(self, request: Request) -> int:
        return self.cache.pages_for(request.prompt_len + self.config.draft_len + 1)

    def _make_room_for_round(self, running: list[Request], paused: deque) -> None:
        """Reserve every running request's block; pause (offload) the smallest requests until it fits."""
        while True:
            ends = [r.committed + self._draft_count(r) + 1 for r in running]  # K/V length at the round's end
            if self._reserve_if_fits(running, ends):
                break
            if len(running) == 1:
                raise KVCapacityError("KV capacity too small for one request's next round")
            victim = min(running, key=lambda r: r.kv_tokens)
            running.remove(victim)
            self.stats.pages_offloaded += len(self.cache.page_lists[victim.slot])
            self.stats.offload_episodes += 1
            victim.offloaded = self.cache.offload(victim.slot)
            victim.status = RequestStatus.PAUSED
            paused.append(victim)
            logger.info("paused request %d (%d KV tokens) under KV pressure", victim.row, victim.kv_tokens)
        self.stats.peak_kv_pages = max(self.stats.peak_kv_pages, self.cache.allocator.num_used)

    def _reserve_if_fits(self, requests: list[Request], ends: list[int]) -> bool:
        """Reserve pages for each request's K/V up to its `ends` entry if the free pages cover all of them at once;
        returns whether it did (reserving nothing otherwise)."""
        needed = sum(
            max(0, self.cache.pages_for(end) - len(self.cache.page_lists[r.slot])) for r, end in zip(requests, ends)
        )
        if needed > self.cache.allocator.num_free:
            return False
        for request, end in zip(requests, ends):
            self.cache.reserve(request.slot, end)
        return True

    # ================================================================ forward
    def _forward(
        self, input_ids: torch.Tensor, plan: StepPlan, keep: torch.Tensor | None = None, bucket_floor: int = 0
    ) -> torch.Tensor:
        """One packed forward of `input_ids` `[N]`; float logits of the kept rows (all rows when `keep` is None).

        Decode steps replay a CUDA graph when `S3RConfig.cuda_graphs` is on (`bucket_floor`: see `DecodeGraphs`).
        """
        input_ids = input_ids.to(self.device)
        if self.graphs is not None and keep is None and self.graphs.supports(plan, input_ids.shape[0]):
            return self.graphs.run(input_ids, plan, bucket_floor=bucket_floor)
        return self._model_logits(input_ids[None], plan, keep).float()

    def _candidates(self, plan: StepPlan) -> torch.Tensor:
        """The plan's top-K history positions, selected on first use from the scores its forward recorded."""
        if plan.candidates is None:
            plan.candidates = self._select_candidates(plan)
        return plan.candidates

    def _select_candidates(self, plan: StepPlan) -> torch.Tensor:
        """Top-K history positions of every layer, `[num_layers, Sd, Hkv, K]`, from one batched selection."""
        scores = torch.stack([plan.scores[layer] for layer in range(self.num_layers)])  # [L, Sd, Hkv, ctx]
        plan.scores = {}
        layers, segments = scores.shape[:2]
        history = plan.dense.history_lens.repeat(layers)
        candidates = get_backend(scores.device).select_topk_candidates(
            scores.flatten(0, 1), history, plan.dense.num_candidates
        )
        return candidates.view(layers, segments, *candidates.shape[1:])

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, self.device)

    def _int32(self, values: list[int]) -> torch.Tensor:
        """Kernel metadata in the kernels' own index type, so no per-layer conversion is launched."""
        return to_device(values, self.device, torch.int32)

    # ================================================================ prefill
    def _prefill_step(self, requests: list[Request]) -> None:
        """Pack prompt chunks (up to `prefill_chunk_size` tokens); finished prompts sample their first token."""
        plan, finals, finished, logits = self.prefill_forward(requests)
        if not finished:
            return
        scores = self.sampling.logits_processor([r.row for r in finished], [r.history for r in finished], logits)
        sampled = sample_from_scores(scores, self.sampling.greedy, self.sampling.generator)
        logprobs = self._logprobs(scores, sampled)
        logprobs = logprobs.tolist() if logprobs is not None else None
        first_tokens = sampled.tolist()
        for row, request in enumerate(finished):
            request.committed = request.prompt_len
            logprob = logprobs[row] if logprobs is not None else None
            self._commit(request, first_tokens[row], scores, row, logits, row, logprob)
        self._stopping_step()
        self.refresh_views(plan, finals, finished, [r.prompt_len for r in finished])

    def prefill_forward(self, requests: list[Request]):
        """One packed forward over the next prompt chunks of `requests`.

        Returns the plan, the segment index and request of every prompt finished by this step, and the logits
        of those prompts' last tokens.
        """
        budget = self.config.prefill_chunk_size
        block = self.config.draft_len + 1
        pieces, write, positions, cu, scored, history, chunks = [], [], [], [0], [], [], []
        for request in requests:
            if budget == 0:
                break
            start = request.prefilled
            end = min(request.prompt_len, start + budget)
            budget -= end - start
            self.cache.reserve(request.slot, end)
            pieces.append(request.prompt_ids[start:end])
            write += self.cache.flat_indices(request.slot, range(start, end))
            positions += list(range(start, end))
            cu.append(cu[-1] + end - start)
            final = end == request.prompt_len
            # The final chunk's last `draft_len + 1` queries score the prompt for the first index view.
            first_scored = max(0, (end - start) - block) if final else -1
            scored.append(first_scored)
            history.append(start + first_scored if final else 0)
            chunks.append((request, start, end, final))
        tokens = torch.cat(pieces)
        num_candidates = max(self.config.budget(r.prompt_len) for r, *_ in chunks)
        dense = DenseSegments(
            query_index=None,
            cu_seqlens=self._int32(cu),
            positions=self._int32(positions),
            block_tables=self.cache.block_tables([r.slot for r, *_ in chunks]),
            score_starts=self._int32(scored),
            history_lens=self._tensor(history),
            num_candidates=num_candidates,
            max_query_len=max(end - start for _, start, end, _ in chunks),
            max_context=max(end for _, _, end, _ in chunks),
            max_scored_queries=max((end - start - first for (_, start, end, _), first in zip(chunks, scored)
                                    if first >= 0), default=0),
        )
        plan = StepPlan(write_index=self._tensor(write), position_ids=dense.positions.long()[None], dense=dense)
        finals = [i for i, (_, _, _, final) in enumerate(chunks) if final]
        keep = self._tensor([cu[i + 1] - 1 for i in finals])
        logits = self._forward(tokens, plan, keep=keep)
        for request, _, end, _ in chunks:
            request.prefilled = end
            self.cache.set_length(request.slot, end)
        self.stats.prefill_tokens += len(tokens)
        return plan, finals, [chunks[i][0] for i in finals], logits

    # ================================================================ one S3R round
    @staticmethod
    def default_policy(config: S3RConfig, mode: str) -> DraftLengthPolicy:
        """The draft-length rule of `mode`: dense decoding never drafts, the unverified drafter always drafts
        `draft_len` (it commits drafts only), exact S3R adapts unless `config.adaptive` is off."""
        if mode == "ar":
            return FixedDraftLength(0)
        if mode == "s3r" and config.adaptive:
            return adaptive_for(config.draft_len)
        return FixedDraftLength(config.draft_len)

    def _shape(self, requests: list[Request]) -> RoundShape:
        return RoundShape(rows=len(requests), context=sum(r.committed for r in requests) // max(len(requests), 1))

    def _choose_draft_len(self, requests: list[Request]) -> int:
        """This round's draft length: the one chosen while the previous round ran (its drafts may already be on the
        device), else the policy's choice now. The time since the previous round began is that round's cost."""
        now = time.perf_counter()
        if self._timed_round is not None:
            shape, k, started, captured, steady = self._timed_round
            # Neither an interval with a CUDA-graph capture in it nor the first round after a switch of `k` (it ran
            # launches the round before would have overlapped) is what a run of such rounds costs.
            if steady and captured == self._capture_seconds():
                self.policy.observe_cost(shape, k, now - started)
        self._timed_round = None
        k, self._next_k = self._next_k, None
        return self.policy.choose(self._shape(requests)) if k is None else k

    def _draft_count(self, request: Request) -> int:
        """Drafts this round: `max_new_tokens` shortens the last block (the round adds drafts + 1 tokens)."""
        return self._draft_count_for(request.remaining, self._round_k)

    def _draft_count_for(self, remaining: int | torch.Tensor, most: int) -> int | torch.Tensor:
        """Drafts of a round of draft length `most` that starts with `remaining` tokens left to generate (an int on
        the host, or a tensor of them on the device: the same rule either way). A round adds its drafts plus one
        token, so S3R drafts at most `remaining - 1`; the unverified drafter commits its drafts only."""
        limit = remaining if self.mode == "unverified" else remaining - 1
        if isinstance(limit, torch.Tensor):
            return limit.clamp(min=0, max=most)
        return max(0, min(most, limit))

    def _round(self, requests: list[Request], k: int) -> None:
        """One round of draft length `k` for every running request: draft, verify, accept, refresh, commit. `k = 0`
        is a dense step; if the views went stale in dense steps, a `k > 0` round runs as a refresh step first (a
        scored dense step that rebuilds them) and drafts `k` in the round after it."""
        if not requests:
            return
        refresh_step = k > 0 and self._views_stale and self.mode != "ar"
        if refresh_step:
            self._next_k, k = k, 0
        self._round_k = k
        steady = self._previous_k == k
        self._previous_k = k
        self._timed_round = None if refresh_step else (self._shape(requests), k, time.perf_counter(),
                                                       self._capture_seconds(), steady)
        started = 0.0
        if self.timing == "stages":
            started = self._clock()
            self._captured_before_stage = self._capture_seconds()
        draft_counts = [self._draft_count(r) for r in requests]
        # The views are refreshed from this verify's scores, extended by its committed tokens, or left as they are.
        refresh = refresh_step or (k > 0 and self._rounds_since_refresh + 1 >= self.config.refresh_interval)
        extend = k > 0 and not refresh
        prelaunched = self._take_prelaunched(requests, draft_counts)
        if prelaunched is not None:  # drafted while the host read and committed the previous round
            draft_counts, tables, draft_tokens, draft_scores = prelaunched
        else:
            # Pages for the whole round were reserved before it: one block table serves every forward of the round.
            tables = self.cache.block_tables([r.slot for r in requests])
            draft_tokens, draft_scores = self._draft(requests, draft_counts, tables)
        max_drafts = max(draft_counts, default=0)
        started = self._stage_done("draft", started)
        verified = self._take_prelaunched_step(requests, scored=refresh)
        if verified is None or k > 0:
            verified = self._verify(requests, draft_counts, draft_tokens, tables, scored=refresh)
        plan, logits, block_starts, target_scores = verified
        started = self._stage_done("verify", started)
        num_drafts = self._tensor(draft_counts)
        if self.mode == "unverified":
            num_accepted = (num_drafts - 1).clamp(min=0)
            next_tokens = draft_tokens[torch.arange(len(requests)), num_accepted]
        elif self.forced_acceptance is not None:
            num_accepted, next_tokens = self._forced_accept(draft_tokens, target_scores, num_drafts)
        else:
            result = speculative_accept(
                draft_tokens[:, :max_drafts], draft_scores[:, :max_drafts], target_scores, num_drafts,
                self.sampling.greedy, self.sampling.generator,
            )
            num_accepted, next_tokens = result.num_accepted, result.next_tokens
        # The accept decision is the one device-to-host read a round needs (plus log-probs when asked for). Its
        # copy is queued first; everything the next round's draft phase needs follows on the device (the top-K
        # selection, the index-view rebuild from the new committed lengths, and with `_may_prelaunch` the draft
        # phase itself), so the device keeps working while the host reads the decision and commits.
        decision = torch.cat([num_accepted[:, None], next_tokens[:, None], draft_tokens[:, :max_drafts]], dim=1)
        read_decision = start_host_copy(decision)
        started = self._stage_done("accept", started)
        if refresh or extend:
            committed, remaining = self._tensor([[r.committed for r in requests], [r.remaining for r in requests]])
            contexts = committed + num_accepted + 1  # K/V of the pending token and the accepted drafts are valid
            # Views of requests that finish this round are rebuilt too (harmless: their slots are released after it).
            if refresh:
                self._rebuild_views(plan, list(range(len(requests))), requests, contexts, plan.dense.num_candidates)
                next_view_width = plan.dense.num_candidates
            else:
                next_view_width = self._extend_views(requests, committed, contexts, max_drafts + 1)
            self._rounds_since_refresh = 0 if refresh else self._rounds_since_refresh + 1
            self._views_stale = False
        else:  # a dense step: the views miss its token until the next refresh
            self._views_stale = True
        logprobs = None
        if self.config.return_logprobs:  # queued before an early draft phase overwrites the draft buffers
            # Token committed at each block offset: the accepted drafts, then the correction/bonus token.
            spare = torch.zeros(len(requests), 1, dtype=torch.long, device=self.device)
            proposed = torch.cat([draft_tokens, spare], dim=1)[:, : target_scores.shape[1]]
            proposed[torch.arange(len(requests), device=self.device), num_accepted] = next_tokens
            logprobs = self._logprobs(target_scores, proposed)
        if self._may_prelaunch:
            # The next round's draft length, chosen now from what the rounds before this one cost, so its work can be
            # queued behind this round's before the host reads the decision.
            if self._next_k is None:
                self._next_k = self.policy.choose(self._shape(requests))
            drafts_next = self._next_k > 0 and not self._views_stale
            if drafts_next and self.draft_phase is not None:
                left = remaining - (num_accepted + 1)
                self._prelaunch(requests, draft_counts, next_tokens, contexts, left, next_view_width, self._next_k)
            elif not drafts_next and k == 0 and self.sampling.logits_processor.history_free:
                # A dense step after a dense step (its lengths are known on the host), scored when it is the refresh
                # step before drafting resumes.
                self._prelaunch_dense_step(requests, next_tokens, draft_tokens, scored=self._next_k > 0)
        started = self._stage_done("refresh", started)
        decision = read_decision().tolist()
        accepted_list = [row[0] for row in decision]
        next_list = [row[1] for row in decision]
        draft_list = [row[2:] for row in decision]
        if self._prelaunched is not None:  # the counts the device computed, as the host computes them
            self._prelaunched.draft_counts = [
                self._draft_count_for(r.remaining - (a + 1), self._next_k) for r, a in zip(requests, accepted_list)
            ]
        for request, accepted in zip(requests, accepted_list):
            request.committed += accepted + 1
            # Pages past the new length stay reserved: an early draft phase may be writing into them.
            self.cache.set_length(request.slot, request.committed, release_pages=False)
            if refresh:  # the host's copy of what the device's rebuild or extension set
                request.view_len = self.config.budget(request.committed)
            elif extend:
                request.view_len += accepted + 1
        if max_drafts > 0 and self.mode == "s3r":  # a forced acceptance pattern is what its rounds accept, too
            self.policy.observe_acceptance(draft_counts, accepted_list)
        logprobs = logprobs.tolist() if logprobs is not None else None
        # Scores and logits are read token by token; without them a row's block is committed in one go, which at
        # B=64 saves a few hundred Python calls per round while the device waits.
        per_token = self.sampling.output_scores or self.sampling.output_logits
        committed_counts = []
        for row, request in enumerate(requests):
            proposals = draft_list[row][: accepted_list[row]] + [next_list[row]]
            row_logprobs = logprobs[row] if logprobs is not None else None
            if per_token:
                count = 0
                row_scores = target_scores[row]
                for offset, token in enumerate(proposals):
                    count += 1
                    logprob = row_logprobs[offset] if row_logprobs is not None else None
                    if self._commit(request, token, row_scores, offset, logits, block_starts[row] + offset, logprob):
                        break
            else:
                count = self._commit_block(request, proposals, row_logprobs)
            committed_counts.append(count)
        self._stopping_step()
        self.stats.steps += 1
        self.stats.record_round(draft_counts, accepted_list, committed_counts)
        self._stage_done("commit", started)

    def _draft(
        self, requests: list[Request], draft_counts: list[int], tables: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens `[R, k]` and their scores `[R, k, V]` of this round: the on-device draft phase, or one
        host-driven pass per position when a logits processor reads the token history."""
        max_drafts = max(draft_counts, default=0)
        if max_drafts > 0 and self.draft_phase is not None:
            pending, committed, counts = self._tensor(
                [[r.pending for r in requests], [r.committed for r in requests], draft_counts]
            ).unbind(0)
            view_width = max(r.view_len for r in requests)
            drafts = self._run_draft_phase(
                requests, pending, committed, counts, tables, view_width, max_drafts, self._round_k
            )
            return drafts.tokens, drafts.scores
        draft_tokens = torch.zeros(len(requests), max(max_drafts, 1), dtype=torch.long, device=self.device)
        draft_scores = torch.zeros(len(requests), max(max_drafts, 1), self.vocab_size, device=self.device)
        for step in range(max_drafts):
            rows = [i for i, k in enumerate(draft_counts) if k > step]
            self.draft_pass(step, [requests[i] for i in rows], rows, draft_tokens, draft_scores,
                            tables if len(rows) == len(requests) else tables[self._tensor(rows)], len(requests))
        return draft_tokens, draft_scores

    def _prelaunch(
        self,
        requests: list[Request],
        draft_counts: list[int],
        next_tokens: torch.Tensor,
        contexts: torch.Tensor,
        remaining: torch.Tensor,
        view_width: int,
        next_k: int,
    ) -> None:
        """Queue the next round's draft phase (draft length `next_k`) before the host reads this round's decision:
        its pending tokens (`next_tokens`), committed lengths (`contexts`) and draft counts (from `remaining`, the
        tokens each request has left after this round) are device tensors, and its pages are reserved here for the
        longest round the decision could lead to. `view_width` bounds the rebuilt index views (the top-K of this
        round's verify).

        Requests that finish in this round (EOS, `max_new_tokens`, a stopping criterion) are drafted for too and
        dropped from the outputs in the next round (`_take_prelaunched`); their writes go to their own reserved
        pages or the scratch row. Skipped when those pages do not fit without pausing someone.
        """
        # A request that accepts no draft has the most tokens left, so the most drafts next round.
        most_drafts = [self._draft_count_for(r.remaining - 1, next_k) for r in requests]
        if max(most_drafts, default=0) == 0:
            return
        ends = [
            min(r.peak_kv_tokens(self.config.draft_len), r.committed + count + 1 + most + 1)
            for r, count, most in zip(requests, draft_counts, most_drafts)
        ]
        if not self._reserve_if_fits(requests, ends):
            return
        tables = self.cache.block_tables([r.slot for r in requests])
        counts = self._draft_count_for(remaining, next_k)
        drafts = self._run_draft_phase(
            requests, next_tokens, contexts, counts, tables, view_width, max(most_drafts), next_k
        )
        self._prelaunched = _PrelaunchedDrafts(list(requests), tables, drafts)  # `requests` is mutated later

    def _take_prelaunched(self, requests: list[Request], draft_counts: list[int]):
        """`(draft counts, block tables, draft tokens, draft scores)` of this round from the prelaunched draft phase,
        or None when there is none or it covers fewer than half of `requests` (then the round drafts afresh).

        Requests it covers take their rows (those that finished in the previous round are dropped). Requests it
        does not cover, admitted or restored since it was launched, draft nothing this round: they take one dense
        token, and draft with the others from the next round on.
        """
        launched, self._prelaunched = self._prelaunched, None
        if launched is None:
            return None
        rows = _launched_rows(launched.requests, requests)
        covered = [row is not None and launched.draft_counts[row] == count for row, count in zip(rows, draft_counts)]
        if 2 * sum(covered) < len(requests):
            return None
        tokens, scores = launched.drafts.tokens, launched.drafts.scores
        if all(covered) and rows == list(range(len(launched.requests))):
            return draft_counts, launched.tables, tokens, scores
        counts = [count if ok else 0 for count, ok in zip(draft_counts, covered)]
        gather = self._tensor([row if ok else 0 for row, ok in zip(rows, covered)])  # uncovered rows: ignored
        return counts, self.cache.block_tables([r.slot for r in requests]), tokens[gather], scores[gather]

    def _prelaunch_dense_step(
        self, requests: list[Request], next_tokens: torch.Tensor, zeros: torch.Tensor, scored: bool
    ) -> None:
        """Queue the next dense step's forward (`scored`: a refresh step's) before the host reads this step's
        tokens. Every request
        commits exactly one token per step, so the next step's lengths and pages are known on the host, and its
        input tokens are `next_tokens` on the device; the host reads and commits while the device runs it (the
        same overlap the S3R draft phase gets from `_prelaunch`, so the baseline is not held back by host time).
        `zeros` are the step's (empty) draft tokens. Requests that finish now get a row too, dropped next step."""
        if all(r.remaining <= 1 for r in requests):
            return
        if not self._reserve_if_fits(requests, [r.committed + 2 for r in requests]):
            return
        tables = self.cache.block_tables([r.slot for r in requests])
        committed = [r.committed + 1 for r in requests]
        verified = self._verify(
            requests, [0] * len(requests), zeros, tables, committed=committed, pending=next_tokens, scored=scored
        )
        self._prelaunched_step = _PrelaunchedStep(list(requests), verified, scored)  # `requests` is mutated later

    def _take_prelaunched_step(self, requests: list[Request], scored: bool) -> _Verified | None:
        """This step's forward from `_prelaunch_dense_step`, for the rows of `requests`; None when there is none,
        it is not the kind of step this one is (`scored`), or a request joined since (then the step runs again)."""
        launched, self._prelaunched_step = self._prelaunched_step, None
        if launched is None or launched.scored != scored:
            return None
        rows = _launched_rows(launched.requests, requests)
        if None in rows:
            return None
        if rows == list(range(len(launched.requests))):
            return launched.verified
        if scored:  # its scores are laid out by the launched rows; the refresh would read other requests' segments
            return None
        keep = self._tensor(rows)  # one query per request, so a request's row is its logits row too
        plan, logits, _, target_scores = launched.verified
        return _Verified(plan, logits[keep], list(range(len(rows) + 1)), target_scores[keep])

    def _run_draft_phase(
        self,
        requests: list[Request],
        pending: torch.Tensor,
        committed: torch.Tensor,
        counts: torch.Tensor,
        tables: torch.Tensor,
        view_width: int,
        passes: int,
        round_k: int,
    ) -> DraftOutputs:
        """Every draft pass of the round on the device, from device tensors of its pending tokens, committed
        lengths and draft counts: one graph replay (the round's draft length `round_k` passes, so the last rounds
        of a request replay the graph of the others), or the same program run eagerly (`passes` passes over index
        views at most `view_width` long)."""
        slots = self._tensor([r.slot for r in requests])
        inputs = DraftInputs(pending, committed, counts, slots, tables, noise=None)
        if self.graphs is not None and self.graphs.supports_draft_phase(len(requests)):
            return self.graphs.run_draft_phase(self.draft_phase, inputs, self.sampling.generator, passes=round_k)
        noise = self.draft_phase.noise_buffer(len(requests), self.device)
        inputs.noise = None if noise is None else draw_noise(noise, self.sampling.generator)
        return self.draft_phase(inputs, view_width, passes=passes)

    def _forced_accept(self, draft_tokens, target_scores, num_drafts):
        """Benchmark-only acceptance pattern (NOT exact): each draft passes with probability `forced_acceptance`."""
        rows = torch.arange(draft_tokens.shape[0], device=self.device)
        coins = torch.rand(draft_tokens.shape, device=self.device, generator=self.sampling.generator)
        drafted = torch.arange(draft_tokens.shape[1], device=self.device)[None, :] < num_drafts[:, None]
        passed = (coins < self.forced_acceptance) & drafted
        num_accepted = torch.cumprod(passed.int(), dim=-1).sum(dim=-1)
        next_tokens = sample_from_scores(target_scores[rows, num_accepted], True, None)
        return num_accepted, next_tokens

    def draft_pass(
        self,
        step: int,
        requests: list[Request],
        rows: list[int],
        draft_tokens: torch.Tensor,
        draft_scores: torch.Tensor,
        block_tables: torch.Tensor | None = None,
        round_size: int = 0,
    ) -> None:
        """Draft token `step + 1` for each request with sparse attention over its index view.

        `block_tables` (rows of `requests`) may come from the round; `round_size` keeps late passes, which have
        fewer requests, in the round's CUDA-graph bucket instead of capturing smaller ones.
        """
        write, positions = [], []
        for request in requests:
            position = request.committed + step
            write += self.cache.flat_indices(request.slot, [position])
            positions.append(position)
        index = self._tensor(rows)
        if block_tables is None:
            block_tables = self.cache.block_tables([r.slot for r in requests])
        # Input tokens stay on the device: the pending token, then the previous pass's drafts.
        tokens = self._tensor([r.pending for r in requests]) if step == 0 else draft_tokens[index, step - 1]
        sparse = SparseQueries(
            query_index=None,
            slots=self._tensor([r.slot for r in requests]),
            block_tables=block_tables,
            tail_starts=self._int32([r.committed for r in requests]),
            positions=self._int32(positions),
            view_width=max(r.view_len for r in requests),
            max_keys=max(r.view_len for r in requests) + step + 1,
        )
        plan = StepPlan(write_index=self._tensor(write), position_ids=sparse.positions.long()[None], sparse=sparse)
        logits = self._forward(tokens, plan, bucket_floor=round_size)
        history_free = self.sampling.logits_processor.history_free
        histories = [] if history_free else [r.tokens[: r.length + step] for r in requests]
        scores = self.sampling.logits_processor([r.row for r in requests], histories, logits)
        drafts = sample_from_scores(scores, self.sampling.greedy, self.sampling.generator)
        draft_tokens[index, step] = drafts
        draft_scores[index, step] = scores
        if not history_free:
            # Provisional: logits processors of later positions must see the drafted prefix.
            for request, token in zip(requests, drafts.tolist()):
                request.tokens[request.length + step] = token

    def _verify(
        self,
        requests: list[Request],
        draft_counts: list[int],
        draft_tokens: torch.Tensor,
        tables: torch.Tensor,
        committed: list[int] | None = None,
        pending: torch.Tensor | None = None,
        scored: bool = True,
    ) -> _Verified:
        """Dense forward over `[pending, d_1..d_k]` of every request; overwrites the drafts' provisional K/V.

        `committed` lengths and `pending` tokens (a device tensor) default to the requests' own. With `scored`
        (and outside engine AR) each layer also leaves the attention scores an index-view refresh selects from.
        """
        scored = scored and self.mode != "ar"
        committed = committed if committed is not None else [r.committed for r in requests]
        pending = pending if pending is not None else self._tensor([r.pending for r in requests])
        write, positions, cu, history, block_rows, block_offsets = [], [], [0], [], [], []
        for row, (request, context, count) in enumerate(zip(requests, committed, draft_counts)):
            write += self.cache.flat_indices(request.slot, range(context, context + count + 1))
            positions += list(range(context, context + count + 1))
            cu.append(cu[-1] + count + 1)
            history.append(context)
            block_rows += [row] * (count + 1)
            block_offsets += list(range(count + 1))
        # `[pending, d_1..d_k]` of every request, gathered on the device.
        blocks = torch.cat([pending[:, None], draft_tokens], dim=1)
        tokens = blocks[self._tensor(block_rows), self._tensor(block_offsets)]
        num_candidates = max(self.config.budget(c + k + 1) for c, k in zip(committed, draft_counts)) if scored else 0
        dense = DenseSegments(
            query_index=None,
            cu_seqlens=self._int32(cu),
            positions=self._int32(positions),
            block_tables=tables,
            score_starts=self._int32([0] * len(requests)) if scored else None,
            history_lens=self._tensor(history),
            num_candidates=num_candidates,
            # The round's length, not its longest block: rounds whose requests all draft fewer (`max_new_tokens` is
            # near) replay the round's CUDA graph instead of capturing one per shorter width.
            max_query_len=max(max(draft_counts), self._round_k) + 1,
            max_context=max(c + k + 1 for c, k in zip(committed, draft_counts)),
            max_scored_queries=max(draft_counts) + 1 if scored else 0,
        )
        plan = StepPlan(write_index=self._tensor(write), position_ids=dense.positions.long()[None], dense=dense)
        logits = self._forward(tokens, plan)
        rows, histories = [], []
        if not self.sampling.logits_processor.history_free:
            histories = [
                r.tokens[: r.length + offset] for r, count in zip(requests, draft_counts) for offset in range(count + 1)
            ]
            rows = [r.row for r, count in zip(requests, draft_counts) for _ in range(count + 1)]
        flat_scores = self.sampling.logits_processor(rows, histories, logits)
        width = max(draft_counts) + 1
        if len(block_rows) == width * len(requests):  # every block is full: the rows are already in place
            return _Verified(plan, logits, cu, flat_scores.reshape(len(requests), width, -1))
        target_scores = torch.zeros(len(requests), width, flat_scores.shape[-1], device=self.device)
        target_scores[self._tensor(block_rows), self._tensor(block_offsets)] = flat_scores
        return _Verified(plan, logits, cu, target_scores)

    # ================================================================ commit and refresh
    def _logprobs(self, scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """Log-probabilities of `tokens` under `softmax(scores)` (any leading shape), on the device."""
        if not self.config.return_logprobs:
            return None
        log_probs = torch.log_softmax(scores.float(), dim=-1)
        return log_probs.gather(-1, tokens.to(scores.device)[..., None]).squeeze(-1)

    def _commit(
        self,
        request: Request,
        token: int,
        scores: torch.Tensor,
        scores_row: int,
        logits: torch.Tensor,
        logits_row: int,
        logprob: float | None,
    ) -> bool:
        """Append one generated token; returns True when the request stops on it (EOS or `max_new_tokens`; the
        stopping criteria see the whole batch after the commit, `_stopping_step`).

        The token's processed scores are `scores[scores_row]` and its raw logits `logits[logits_row]`; they are
        indexed only when an output reads them, since a tensor index per committed token is host time the round
        otherwise does not spend.
        """
        request.append(token)
        request.pending = token
        if self.sampling.output_scores:
            request.scores.append(scores[scores_row].detach().clone())
        if self.sampling.output_logits:
            request.raw_logits.append(logits[logits_row].detach().clone())
        if logprob is not None:
            request.logprobs.append(logprob)
        stop = self._reached_end(request, token)
        if stop:
            request.status = RequestStatus.FINISHED
        return stop

    def _commit_block(self, request: Request, proposals: list[int], logprobs: list[float] | None) -> int:
        """Append a round's block of tokens at once, stopping where `_commit` token by token would: after the first
        EOS, or at `max_new_tokens`. Only for rounds without per-token consumers (scores, logits). Returns how many
        tokens were committed."""
        eos_token_ids = self.sampling.eos_token_ids
        block = proposals[: max(1, request.remaining)]  # `_commit` appends a token before it checks the limit
        if not eos_token_ids.isdisjoint(block):
            first_eos = next(offset for offset, token in enumerate(block) if token in eos_token_ids)
            block = block[: first_eos + 1]  # the EOS token itself is committed
        request.extend(block)
        request.pending = block[-1]
        if logprobs is not None:
            request.logprobs.extend(logprobs[: len(block)])
        if self._reached_end(request, block[-1]):
            request.status = RequestStatus.FINISHED
        return len(block)

    def _reached_end(self, request: Request, last_token: int) -> bool:
        """The stop rule both commit paths share: EOS was committed, or `max_new_tokens` is used up."""
        return last_token in self.sampling.eos_token_ids or request.remaining <= 0

    def _stopping_step(self) -> None:
        """After a commit: the stopping criteria and the streamer get every step all unfinished rows have reached,
        with the whole batch, as dense `generate` calls them (`BatchStopping`; it may cut rows back and end them)."""
        if isinstance(self.sampling.stopping_criteria, BatchStopping):
            self.sampling.stopping_criteria.advance()

    def refresh_views(self, plan: StepPlan, segments: list[int], requests: list[Request], contexts: list[int]):
        """New index views `R ∪ TopK` (the recent positions plus the top-scored ones) from the scores the dense forward
        recorded, for requests whose committed lengths after the refresh are `contexts`."""
        if not requests:
            return
        for request, context in zip(requests, contexts):
            request.view_len = self.config.budget(context)
        width = max(r.view_len for r in requests)
        self._rebuild_views(plan, segments, requests, self._tensor(contexts), width)

    def _extension_slack(self) -> int:
        """How far views may outgrow their budget: each round between refreshes adds up to `draft_len + 1`."""
        return (self.config.refresh_interval - 1) * (self.config.draft_len + 1)

    def _extend_views(
        self, requests: list[Request], committed: torch.Tensor, contexts: torch.Tensor, max_new: int
    ) -> int:
        """Queue the append of the round's committed positions `[committed, contexts)` (device tensors) to the
        requests' views, for a round without a refresh; returns a host bound on the new view lengths."""
        width = max(r.view_len for r in requests) + max_new
        self.cache.index_views.ensure_capacity(width)
        slots = self._tensor([r.slot for r in requests])
        self.cache.index_views.extend(slots, committed, contexts, max_new)
        return width

    def _rebuild_views(
        self, plan: StepPlan, segments: list[int], requests: list[Request], contexts: torch.Tensor, width: int
    ) -> None:
        """Queue the index-view rebuild of `requests` (plan segments `segments`) at committed lengths `contexts`
        (a device tensor), so it needs no host read; `width` bounds the views' budgets (a host int). The caller
        keeps `Request.view_len` in step."""
        seg_index = self._tensor(segments)
        slots = self._tensor([r.slot for r in requests])
        history = plan.dense.history_lens[seg_index]
        candidates = self._candidates(plan)[:, seg_index]
        budgets = self.config.budgets(contexts)
        self.cache.index_views.build(None, slots, candidates, history, contexts, budgets, width=width)
