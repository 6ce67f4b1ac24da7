"""`S3REngine`: runs a batch of requests to completion. Schedule a step, run it (a prefill step, a round, or a mixed
step: a round whose verify forward also prefills), release what finished."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from s3r_hf.attention import s3r_attention
from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.compiled_layers import compile_counters, compiled_decoder_layers, decoder_layers, fused_projections_for
from s3r_hf.config import DRAFT_WEIGHT_FORMATS, S3RConfig
from s3r_hf.draft_phase import DraftPhase
from s3r_hf.draft_policy import DraftLengthPolicy, FixedDraftLength, adaptive_for
from s3r_hf.draft_weights import DraftWeights
from s3r_hf.engine.acceptance import acceptance_for
from s3r_hf.engine.commit import Committer
from s3r_hf.engine.early_launch import EarlyLaunches
from s3r_hf.engine.first_tokens import FirstTokens
from s3r_hf.engine.mixed_step import MixedStep
from s3r_hf.engine.model_runner import ModelRunner
from s3r_hf.engine.round import SpeculativeRound
from s3r_hf.engine.round_timing import RoundTimer
from s3r_hf.engine.sampling_setup import SamplingSetup
from s3r_hf.engine.scheduler import Scheduler
from s3r_hf.engine.view_updates import IndexViewUpdates
from s3r_hf.fused_layers import fused_decoder_layers
from s3r_hf.kernels import triton_variants
from s3r_hf.lm_head import float32_lm_head
from s3r_hf.request import Request
from s3r_hf.runtime_state import ModelRuntime
from s3r_hf.stats import S3RStats
from s3r_hf.step_plan import StepPlan

logger = logging.get_logger(__name__)


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
        self.device = cache.device
        self.stats = S3RStats()
        if runtime is None:
            runtime = ModelRuntime()
            runtime.adopt_cache(cache, model, cache.num_pages)
        elif runtime.cache is not cache:
            raise ValueError("the engine's cache must be its runtime's pool (ModelRuntime.adopt_cache)")
        self.runtime = runtime
        self.policy = draft_policy if draft_policy is not None else self.default_policy(config, mode)
        vocab_size = model.get_output_embeddings().weight.shape[0]
        # The round's draft passes run as one device-side program unless a logits processor reads the history
        # (then each pass goes back to the host, which writes the provisional drafts into the histories).
        draft_phase = None
        if mode != "ar" and sampling.logits_processor.history_free:
            draft_phase = DraftPhase(
                runtime.forward, sampling.logits_processor, config.draft_len, cache.page_size,
                cache.scratch_page * cache.page_size, sampling.greedy, vocab_size,
            )
        self.runner = ModelRunner(
            runtime.forward, cache, config, sampling, self.stats, draft_phase, scores_verify=mode != "ar",
            vocab_size=vocab_size,
        )
        self.scheduler = Scheduler(cache, config, self.stats, runtime.length_forecast(cache.page_size))
        self.views = IndexViewUpdates(cache, config, self.runner)
        self.committer = Committer(sampling, config.return_logprobs)
        self.timer = RoundTimer(timing, self.device, self.stats, self.runner.capture_seconds)
        acceptance = acceptance_for(mode, forced_acceptance, sampling.greedy, sampling.generator)
        self.round = SpeculativeRound(
            self.runner, self.views, acceptance, EarlyLaunches(self.runner, cache, config, acceptance.drafts_only),
            self.committer, self.timer, self.policy, cache, config, self.stats,
            learns_acceptance=mode == "s3r", refreshes_views=mode != "ar",
        )
        self.first_tokens = FirstTokens(sampling, self.committer, self.views if mode != "ar" else None)
        self.mixed = MixedStep(self.round, self.runner, self.scheduler, self.first_tokens, self.timer)

    @staticmethod
    def default_policy(config: S3RConfig, mode: str) -> DraftLengthPolicy:
        """The draft-length rule of `mode`: dense decoding never drafts, the unverified drafter always drafts
        `draft_len` (it commits drafts only), exact S3R adapts unless `config.adaptive` is off. The views are
        refreshed every `config.refresh_interval` rounds; when that is None, at the interval the adaptive rule
        chooses, or every round without it."""
        if mode == "ar":
            return FixedDraftLength(0)
        if mode == "s3r" and config.adaptive:
            return adaptive_for(config.draft_len, config.refresh_interval, config.adaptive_draft_lengths)
        return FixedDraftLength(config.draft_len, config.refresh_interval or 1)

    @contextlib.contextmanager
    def _quantized_draft_weights(self) -> Iterator[None]:
        """The decoder layers' linears as `QuantizedDraftLinear`s (`S3RConfig.draft_weights`), over the modules they
        run now (with compiled layers, the fused projections)."""
        dtype, group = DRAFT_WEIGHT_FORMATS[self.config.draft_weights]
        weights = self.runtime.quantized_draft_weights(
            (self.config.compile_layers, self.config.draft_weights),
            lambda: DraftWeights(decoder_layers(self.model), dtype, group),
        )
        with weights.installed():
            yield

    def run(self, requests: list[Request]) -> S3RStats:
        """Generate until every request finishes; requests are filled in place."""
        self.scheduler.add(requests)
        captured_before = self._prepare_graphs(requests)
        compiled = contextlib.nullcontext()
        compiled_before = compile_counters() if self.config.compile_layers else (0, 0.0)
        variants_before = triton_variants()
        if self.config.compile_layers:
            fused = self.runtime.fused_projections(lambda: fused_projections_for(self.model))
            compiled = compiled_decoder_layers(self.model, fused)
        # Entered after the compiled layers: prefill chunks fall back to the compiled forward.
        fused_layers = fused_decoder_layers(self.model) if self.config.fused_layers else contextlib.nullcontext()
        # Entered after the compiled layers too: with them, the 8-bit copies are of the fused projections' weights.
        quantized = self.config.draft_weights != "model"
        draft_weights = self._quantized_draft_weights() if quantized else contextlib.nullcontext()
        # Wall time is split between prefill and decoding at the switches between them only (the device is
        # synchronized there when timing), so consecutive rounds keep overlapping as they do untimed.
        phase, phase_started = None, 0.0
        with s3r_attention(self.model, packed=True), compiled, fused_layers, float32_lm_head(self.model), draft_weights:
            while self.scheduler.has_work():
                step = self.scheduler.schedule()
                step_phase = "prefill" if step.kind == "prefill" else "decode"  # a mixed step's time is decoding's
                if phase != step_phase:
                    phase_started, phase = self.timer.end_phase(phase, phase_started), step_phase
                if step.kind == "prefill":
                    self.timer.step_ended()
                    self._prefill_step(step.requests, step.donors)
                    self.timer.interrupted()  # the interval around a prefill step is no round's cost
                elif step.kind == "mixed":
                    with torch.profiler.record_function("s3r_hf.mixed_step"):
                        self.mixed.run(step.requests, step.prefilling, step.donors)
                else:
                    k = self.round.choose_draft_len(step.requests)
                    self.scheduler.make_room_for_round(step.requests, self.round.draft_count)
                    self.round.may_launch_early = not self.timer.stages  # with stage timing every stage stays apart
                    # A profiler marker (tools/profile_engine.py counts the kernels launched after the first one).
                    with torch.profiler.record_function("s3r_hf.decode_round"):
                        self.round.run(self.scheduler.running, k)
                self.scheduler.finish_step()
            self.timer.step_ended()
            self.timer.end_phase(phase, phase_started)
        self._record_compilation(compiled_before)
        built = triton_variants() - variants_before
        self.stats.kernel_variants = len(built)
        if built:  # a variant built mid-run costs about a second: which kernel, for which arguments
            logger.info("built %d Triton kernel variants: %s", len(built), sorted(built))
        if self.runner.graphs is not None:  # this call's captures (the graphs may be kept from earlier calls)
            self.stats.graph_captures = self.runner.graphs.captures - captured_before[0]
            self.stats.graph_capture_seconds = self.runner.graphs.capture_seconds - captured_before[1]
            self.stats.captured_graphs = self.runner.graphs.capture_log[captured_before[0]:]
        return self.stats

    def _prepare_graphs(self, requests: list[Request]) -> tuple[int, float]:
        """With `S3RConfig.cuda_graphs` on CUDA, take the runtime's graphs for the call's longest request and size
        the index views for them; returns the captures (count, seconds) made before this call."""
        if not (self.config.cuda_graphs and self.device.type == "cuda" and requests):
            return 0, 0.0
        longest = max(r.peak_kv_tokens(self.config.draft_len) for r in requests)
        graphs = self.runtime.graphs_for(self.cache.pages_for(longest), self.config)
        graphs.keep_draft_phases_of(self.runner.draft_phase)
        # Graphs kept from an earlier call: a step replays a larger captured bucket rather than capture a smaller one.
        graphs.replay_larger = graphs.captures > 0
        graphs.unscored_blocks = self.config.max_refresh_interval > 1
        self.runner.graphs = graphs
        # Index views at their largest from the start: growing them would invalidate the draft graphs. A view never
        # holds more than the context, whatever the slack between refreshes.
        max_view = min(graphs.max_candidates + self.views.extension_slack(), graphs.max_context)
        self.cache.index_views.ensure_capacity(max_view)
        return graphs.captures, graphs.capture_seconds

    def _record_compilation(self, compiled_before: tuple[int, float]) -> None:
        if not self.config.compile_layers:
            return
        graphs, seconds = compile_counters()
        self.stats.compiled_graphs = graphs - compiled_before[0]
        self.stats.compile_seconds = seconds - compiled_before[1]
        if self.stats.compiled_graphs:
            logger.info(f"compiled {self.stats.compiled_graphs} graphs for new shapes in "
                        f"{self.stats.compile_seconds:.1f} s")

    def _prefill_step(self, requests: list[Request], donors: dict[bytes, Request]) -> None:
        """Pack prompt chunks (up to `prefill_chunk_size` tokens); finished prompts sample their first token and
        build their first index views."""
        plan, finals, finished, logits = self.runner.prefill_forward(requests, donors)
        self.first_tokens.commit(plan, finals, finished, logits)

    # ---------------------------------------------------------------- used by the assisted-decoding generator
    def draft_pass(self, *args, **kwargs) -> None:
        """`ModelRunner.draft_pass`: one sparse draft pass."""
        self.runner.draft_pass(*args, **kwargs)

    def prefill_forward(self, requests: list[Request]):
        """`ModelRunner.prefill_forward`: one packed forward over the next prompt chunks."""
        return self.runner.prefill_forward(requests)

    def refresh_views(self, plan: StepPlan, segments: list[int], requests: list[Request], contexts: list[int]) -> None:
        """`IndexViewUpdates.refresh`: new index views from the scores a dense forward recorded."""
        self.views.refresh(plan, segments, requests, contexts)
