"""CUDA graphs for decode steps: sparse draft passes, dense decode steps and verify blocks.

A decode forward of an HF model launches hundreds of small kernels; at the batch sizes of RL rollouts that
launch work, not the memory traffic, sets the step time. Decode steps have a fixed shape for a given number of
requests, so each (kind, batch bucket) is captured once and replayed: the step's metadata is copied into the
graph's static buffers, padding rows write their K/V to the cache's scratch page and read the padding
index-view row (length 0), and the kernels run on a fixed grid. A verify step holds up to `draft_len + 1`
tokens per request; its unused token slots form one extra padding segment, and its verify-score scratch is
sized for the longest context of the call. Rounds that do not refresh the index views
(`S3RConfig.refresh_interval`) verify without scores, as kind `"block"`. The draft phase of a round (all its
draft passes, sampling included, see `draft_phase.py`) is one graph.

Buckets: a step replays the smallest bucket already captured that holds its rows, unless that bucket is more
than `REUSE_FACTOR` times the bucket the rows would need (then the smaller one is captured). Padding rows cost
little next to the weights every step reads, and each capture costs a warm-up run and a capture, so a batch
that shrinks as requests finish captures about two buckets per kind instead of one per size. In a call whose
graphs were kept from an earlier one (`replay_larger`), a larger captured bucket is also replayed while its
forward holds at most `REPLAY_LARGER_TOKENS` tokens, padding included: which row counts a sampled rollout's tail
reaches changes from call to call, and a capture there costs more than the padding rows of a short tail. Beyond
that size the padding adds GEMM work to every step of the tail, in every later call, where a capture is made
once. For the same reason a verify block of drafts whose forward would hold at most that many tokens is captured
at the widest bucket that does (32 requests of 7 tokens): a later call's tail may draft at row counts the first
never reached, and one graph serves them all. It is captured ahead, from padding rows, when a wider verify graph
of its block width is first captured, so a later call's tail finds it even if the first call's never drafted there;
so is any bucket between the two that neither serves (48 requests, under a graph of 256: `keys_ahead`). Where a
call may skip refreshes, a verify graph's unscored twin (`"block"`) is captured with it too (`ahead_of`): which
rounds skip one is the adaptive rule's choice, and the first to do so may come many calls later.

There is no bucket of one row: torch.compile specializes a dimension of size 1, so with compiled layers the first
step down to one request would compile every layer's frames again, in whichever call (a later GRPO step) a tail
first gets there. A padding row costs a one-request step nothing measurable (both read the same weights).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.draft_phase import DraftInputs, DraftOutputs, DraftPhase
from s3r_hf.matmul_precision import float32_matmul_precision
from s3r_hf.sampler import draw_noise
from s3r_hf.step_plan import DenseSegments, SparseQueries, StepPlan

logger = logging.get_logger(__name__)

BUCKETS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
REUSE_FACTOR = 4
REPLAY_LARGER_TOKENS = 256
"""Most tokens a forward of a kept graph may hold, padding included, for a later call to replay it at fewer rows
(`DecodeGraphs.replay_larger`). Up to about this many, a decode-shaped forward's GEMMs cost what reading their
weights costs (bf16 on an H200), so padding rows are nearly free; a verify graph of 256 requests holds seven times
as many tokens."""
# Kinds whose steps pack several queries per request as segments (their buckets count requests, not tokens).
_BLOCK_KINDS = ("verify", "block")


def _bucket_for(rows: int) -> int:
    """The smallest bucket that holds `rows` rows (the largest bucket for more)."""
    return next(b for b in BUCKETS if b >= min(rows, BUCKETS[-1]))


def _fewest_reusing(bucket: int) -> int:
    """The fewest rows that replay a captured `bucket` within `REUSE_FACTOR` (`DecodeGraphs._key`)."""
    return next(rows for rows in range(1, bucket + 1) if REUSE_FACTOR * _bucket_for(rows) >= bucket)


@dataclass
class _CapturedStep:
    graph: torch.cuda.CUDAGraph | None
    plan: StepPlan
    input_ids: torch.Tensor  # [1, B]
    logits: torch.Tensor | None = None  # [B, V], the graph's output
    live_segments: int | None = None  # the count last written to `plan.dense.live_segments` (block graphs)


@dataclass
class _CapturedDraftPhase:
    graph: torch.cuda.CUDAGraph | None
    inputs: DraftInputs  # static, `bucket` rows
    outputs: DraftOutputs | None = None


class DecodeGraphs:
    """Captures and replays decode forwards: dense decode steps, verify blocks, draft passes and whole draft phases.

    Args:
        cache: the engine's `S3RCache`.
        forward: runs the model on `(input_ids [1, B], plan)` and returns logits `[B, V]`.
        max_pages: widest block table of any request of the call.
        draft_len: tokens drafted per round (bounds the provisional tail of a draft query and a verify block).
        max_candidates: top-K candidates a verify step keeps (the budget at the longest context).
    """

    def __init__(self, cache: S3RCache, forward: Callable, max_pages: int, draft_len: int, max_candidates: int) -> None:
        self.cache = cache
        self.max_candidates = max_candidates
        self.forward = forward
        self.max_pages = max_pages
        self.max_context = max_pages * cache.page_size
        self.draft_len = draft_len
        self.steps: dict[tuple, _CapturedStep | _CapturedDraftPhase] = {}
        self.replays = 0
        self.captures = 0
        # Set for each call (the engine): graphs kept from an earlier call, so a larger captured bucket is replayed
        # rather than a smaller one captured, within `REPLAY_LARGER_TOKENS`.
        self.replay_larger = False
        # Set for each call (the engine): the call may verify without scores (`S3RConfig.max_refresh_interval` > 1),
        # so a verify graph's unscored twin is captured with it (`ahead_of`).
        self.unscored_blocks = False
        self.capture_seconds = 0.0  # wall time spent capturing (device-synchronized)
        self.capture_log: list[str] = []  # one entry per capture, in order: what was captured and how long it took

    @staticmethod
    def kind(plan: StepPlan, draft_len: int | None = None) -> str | None:
        """`"sparse"` (draft steps), `"dense"` (single-query unscored steps), `"verify"` (scored blocks of at
        most `draft_len + 1` queries per request), `"block"` (the same unscored), or `None` for steps that run
        eagerly (prefill chunks, mixed steps)."""
        if plan.sparse is not None and plan.dense is None and plan.sparse.query_index is None:
            return "sparse"
        dense = plan.dense
        if dense is None or plan.sparse is not None or dense.query_index is not None:
            return None
        if dense.score_starts is None and dense.max_query_len == 1:
            return "dense"
        if draft_len is not None and dense.max_query_len <= draft_len + 1:
            return "verify" if dense.score_starts is not None else "block"
        return None

    def supports(self, plan: StepPlan, num_tokens: int) -> bool:
        kind = self.kind(plan, self.draft_len)
        segments = num_tokens if kind not in _BLOCK_KINDS else plan.dense.cu_seqlens.shape[0] - 1
        return kind is not None and segments <= BUCKETS[-1]

    @staticmethod
    def supports_draft_phase(rows: int) -> bool:
        return rows <= BUCKETS[-1]

    def run(
        self, input_ids: torch.Tensor, plan: StepPlan, bucket_floor: int = 0, precision: str = "highest"
    ) -> torch.Tensor:
        """Logits `[n, V]` of the step, from a replayed graph (captured on first use of its bucket, with float32
        matmuls at `precision`: the graph keeps the kernels chosen then).

        `bucket_floor` replays a bucket at least that large: late draft passes of a round, with fewer requests,
        reuse the round's graph (padding rows are cheap) instead of capturing one per smaller size.
        """
        kind = self.kind(plan, self.draft_len)
        count = input_ids.shape[0]
        segments = count if kind not in _BLOCK_KINDS else plan.dense.cu_seqlens.shape[0] - 1
        capacity = self.cache.index_views.capacity if kind == "sparse" else 0
        # A block graph holds `width` queries per request: a round that drafts fewer tokens (adaptive draft
        # lengths) replays one sized for its own blocks rather than padding every block to `draft_len + 1`.
        width = plan.dense.max_query_len if kind in _BLOCK_KINDS else 1
        rows = max(segments, bucket_floor)
        key = self._key(kind, rows, capacity, width)
        step = self.steps.get(key)
        if step is None:
            self._drop_stale(kind, key)
            step = self._static_step(kind, key[1], width)
            self._fill(kind, step, input_ids, plan, count)
            step.graph, step.logits = self._capture(lambda: self.forward(step.input_ids, step.plan), key, precision)
            self.steps[key] = step
            self._capture_ahead(key, precision)
        else:
            self._fill(kind, step, input_ids, plan, count)
        step.graph.replay()
        self.replays += 1
        if kind == "verify":  # the real segments' verify scores (graph buffers, valid until the next replay)
            scores = step.plan.scores
            plan.scores = None if scores is None else scores[:, :segments]
        # A copy: the graph's output buffer is overwritten by the next replay.
        return step.logits[:count].to(torch.float32, copy=True)

    def run_draft_phase(
        self,
        phase: DraftPhase,
        inputs: DraftInputs,
        generator: torch.Generator | None,
        passes: int | None = None,
        precision: str = "highest",
    ) -> DraftOutputs:
        """The round's draft passes from one replayed graph, captured with float32 matmuls at `precision`;
        `inputs.noise` is ignored (drawn here, in place).

        The outputs are views of the graph's buffers, valid until the next draft phase of this bucket. Each number
        of `passes` (the round's longest draft) is a graph of its own, and so is each `DraftPhase.signature` (the
        logits processors are part of the graph).
        """
        count = inputs.pending.shape[0]
        capacity = self.cache.index_views.capacity
        passes = self.draft_len if passes is None else passes
        key = self._key("draft", count, capacity, passes, self.draft_variant(phase))
        captured = self.steps.get(key)
        fresh = captured is None
        if fresh:
            self._drop_stale("draft", key)
            captured = _CapturedDraftPhase(graph=None, inputs=self._static_draft_inputs(key[1], phase))
        self._fill_draft_inputs(captured.inputs, inputs, count)
        if captured.inputs.noise is not None:
            draw_noise(captured.inputs.noise, generator)
        if fresh:
            static = captured.inputs
            captured.graph, captured.outputs = self._capture(
                lambda: phase(static, capacity, passes=passes), key, precision
            )
            self.steps[key] = captured
        captured.graph.replay()
        self.replays += 1
        return DraftOutputs(tokens=captured.outputs.tokens[:count], scores=captured.outputs.scores[:count])

    @staticmethod
    def draft_variant(phase: DraftPhase) -> tuple:
        """The key part that tells draft phases apart: their signature, or the phase's serial number when it has none
        (then its graphs serve that phase, one call, only)."""
        signature = phase.signature
        return ("signature", signature) if signature is not None else ("phase", phase.serial)

    def keep_draft_phases_of(self, phase: DraftPhase | None) -> None:
        """Drop the draft-phase graphs of other signatures than `phase`'s (earlier calls' processors); a call without
        a draft phase (dense decoding) leaves them for the next call that drafts."""
        if phase is None:
            return
        variant = self.draft_variant(phase)
        for key in [k for k in self.steps if k[0] == "draft" and k[4] != variant]:
            del self.steps[key]

    def _key(self, kind: str, rows: int, capacity: int, width: int = 1, variant: tuple | None = None) -> tuple:
        """`(kind, bucket, capacity, width, variant)` to replay for `rows` rows: a captured bucket up to
        `REUSE_FACTOR` times too large (with `replay_larger`, also a larger one whose forward holds at most
        `REPLAY_LARGER_TOKENS` tokens), else the smallest that fits."""
        rows = min(rows, BUCKETS[-1])
        ideal = _bucket_for(rows)
        captured = sorted(
            k[1] for k in self.steps
            if k[0] == kind and k[2] == capacity and k[3] == width and k[4] == variant and k[1] >= rows
        )
        tokens_per_row = width if kind in _BLOCK_KINDS else 1  # a draft phase's width counts passes, not tokens
        reusable = captured and (
            captured[0] <= REUSE_FACTOR * ideal
            or (self.replay_larger and captured[0] * tokens_per_row <= REPLAY_LARGER_TOKENS)
        )
        bucket = captured[0] if reusable else ideal
        if not reusable and kind in _BLOCK_KINDS and width > 1 and ideal * width <= REPLAY_LARGER_TOKENS:
            # A tail's verify block: capture the widest bucket whose forward still holds at most
            # `REPLAY_LARGER_TOKENS` tokens, so every smaller tail, in this call or a later one, replays it. (Not
            # a one-query refresh step: that bucket would be 256 requests, and a scored graph keeps a score
            # scratch per request as long as the longest context.)
            bucket = max(b for b in BUCKETS if b * width <= REPLAY_LARGER_TOKENS)
        return (kind, bucket, capacity, width, variant)

    @staticmethod
    def tail_key(key: tuple) -> tuple | None:
        """The key of the tail's verify graph that serves blocks of `key`'s width at fewer rows (the widest bucket
        within `REPLAY_LARGER_TOKENS`, see `_key`), when `key` is a block graph wider than that; else None."""
        kind, bucket, capacity, width, variant = key
        if kind not in _BLOCK_KINDS or width == 1:
            return None
        tail = max((b for b in BUCKETS if b * width <= REPLAY_LARGER_TOKENS), default=None)
        return None if tail is None or tail >= bucket else (kind, tail, capacity, width, variant)

    def _fewest_rows(self, kind: str, bucket: int, width: int) -> int:
        """The fewest requests a block graph of `bucket` rows replays with (`_key`): a graph within
        `REPLAY_LARGER_TOKENS` may serve any smaller tail; a wider one has a tail graph, captured with it
        (`_capture_ahead`), that serves every count up to the tail's bucket, and serves no count whose own
        bucket is more than `REUSE_FACTOR` times smaller. Its attention sizes the key splits of its grid for that
        many (`triton_backend.split_grid`)."""
        tail = self.tail_key((kind, bucket, 0, width, None))
        if tail is None:
            return 1
        return max(tail[1] + 1, _fewest_reusing(bucket))

    @classmethod
    def keys_ahead(cls, key: tuple) -> list[tuple]:
        """The block graphs to capture with a block graph `key` wider than `REPLAY_LARGER_TOKENS`, so that every
        smaller request count of its width replays a captured graph (`_key`): the tail's graph (`tail_key`) and, where
        the fewest requests `key` serves (`REUSE_FACTOR`) leave a gap above the tail's bucket, the buckets that fill
        it, widest first. Empty for other graphs."""
        tail = cls.tail_key(key)
        if tail is None:
            return []
        kind, bucket, capacity, width, variant = key
        keys = [tail]
        while (fewest := _fewest_reusing(bucket)) > tail[1] + 1:
            bucket = _bucket_for(fewest - 1)
            keys.append((kind, bucket, capacity, width, variant))
        return keys

    def ahead_of(self, key: tuple) -> list[tuple]:
        """The graphs to capture with `key`: those `keys_ahead` names and, where the call may verify without scores
        (`unscored_blocks`), a verify graph's unscored twin (`"block"`, the same rows and width) and the graphs it
        names. Which rounds skip a refresh is the adaptive rule's choice, made from timings, so the first may come many
        calls after the verify graph, and a capture there (with its kernels' first builds) would pause that call."""
        keys = self.keys_ahead(key)
        if self.unscored_blocks and key[0] == "verify" and key[3] > 1:
            twin = ("block", *key[1:])
            keys += [twin, *self.keys_ahead(twin)]
        return keys

    def _capture_ahead(self, key: tuple, precision: str) -> None:
        """Capture, from padding rows alone, the block graphs `ahead_of` names for a block graph just captured. A
        sampled call's tail reaches row counts that change from call to call, and the adaptive rule's probes draft
        at row counts it had not drafted at before; captured now, those graphs are ready when a later call first
        drafts there, instead of being captured in that call."""
        for ahead in self.ahead_of(key):
            if ahead in self.steps:
                continue
            kind, bucket, _, width, _ = ahead
            step = self._static_step(kind, bucket, width)
            self._fill_padding(kind, step)
            step.graph, step.logits = self._capture(
                lambda step=step: self.forward(step.input_ids, step.plan), ahead, precision
            )
            self.steps[ahead] = step

    def _fill_padding(self, kind: str, step: _CapturedStep) -> None:
        """Static buffers of a block graph holding no request: every token slot is in the padding segment, which
        writes its K/V to the scratch page and scores nothing. (`live_segments` keeps its bucket: the next `_fill`
        sets the real count.)"""
        step.plan.dense.block_tables.zero_()
        step.plan.dense.cu_seqlens[0] = 0
        self._pad(kind, step, count=0, rows=0)

    def _drop_stale(self, kind: str, key: tuple) -> None:
        """Index views grew (a new tensor): graphs that read the old one must not run again."""
        for old in [k for k in self.steps if k[0] == kind and k[2] != key[2]]:
            del self.steps[old]

    def _static_draft_inputs(self, bucket: int, phase: DraftPhase) -> DraftInputs:
        device = self.cache.device
        long = dict(dtype=torch.long, device=device)
        noise = phase.noise_buffer(bucket, device)
        return DraftInputs(
            pending=torch.zeros(bucket, **long), committed=torch.zeros(bucket, **long),
            num_drafts=torch.zeros(bucket, **long), slots=torch.full((bucket,), self.cache.padding_slot, **long),
            block_tables=torch.zeros(bucket, self.max_pages, dtype=torch.int32, device=device), noise=noise,
        )

    def _fill_draft_inputs(self, static: DraftInputs, inputs: DraftInputs, count: int) -> None:
        """Rows past `count` become padding: no drafts (writes go to scratch), the padding slot's empty views."""
        for name in ("pending", "committed", "num_drafts", "slots"):
            getattr(static, name)[:count].copy_(getattr(inputs, name))
        static.num_drafts[count:].zero_()
        static.committed[count:].zero_()
        static.slots[count:].fill_(self.cache.padding_slot)
        static.block_tables.zero_()
        static.block_tables[:count, : inputs.block_tables.shape[1]].copy_(inputs.block_tables)

    def _static_step(self, kind: str, bucket: int, width: int) -> _CapturedStep:
        """Static buffers of a step graph of `bucket` rows. A block graph's attention reads how many requests are
        real (`DenseSegments.live_segments`, set by `_fill`) and splits their keys as a grid of that many would: a
        graph replayed for a tail of a few requests would otherwise leave each one's keys to the few long-running
        programs chosen for all of its padding segments. (Dense-step graphs keep the count of their bucket: with the
        live count there too, engine AR's float32 GRPO rollouts were slower, which the kernel's own timings do not
        explain; docs/benchmarks.md, log of 2026-12-03.)"""
        device = self.cache.device
        long = dict(dtype=torch.long, device=device)
        int32 = dict(dtype=torch.int32, device=device)
        positions = torch.zeros(bucket, **int32)
        block_tables = torch.zeros(bucket, self.max_pages, **int32)
        plan = StepPlan(write_index=torch.zeros(bucket, **long), position_ids=torch.zeros(1, bucket, **long))
        # The attention kernels size their grids' key splits from the bucket and `max_context` / `max_keys`, all
        # fixed for a graph (`triton_backend._num_splits`, `sparse_splits`); a block graph's kernel then uses as
        # many of them as suit the requests of each replay (`live_segments`).
        if kind == "dense":
            plan.dense = DenseSegments(
                query_index=None, cu_seqlens=torch.arange(bucket + 1, **int32), positions=positions,
                block_tables=block_tables, score_starts=None, history_lens=torch.zeros(bucket, **long),
                num_candidates=0, max_query_len=1, max_context=self.max_context, num_splits=None,
            )
        elif kind in _BLOCK_KINDS:
            tokens = bucket * width
            scored = kind == "verify"
            plan = StepPlan(write_index=torch.zeros(tokens, **long), position_ids=torch.zeros(1, tokens, **long))
            plan.dense = DenseSegments(
                query_index=None, cu_seqlens=torch.zeros(bucket + 2, **int32),
                positions=torch.zeros(tokens, **int32), block_tables=torch.zeros(bucket + 1, self.max_pages, **int32),
                score_starts=torch.zeros(bucket + 1, **int32) if scored else None,
                history_lens=torch.zeros(bucket + 1, **long), num_candidates=self.max_candidates if scored else 0,
                max_query_len=width, max_context=self.max_context,
                max_scored_queries=width if scored else 0, num_splits=None,
                live_segments=torch.full((1,), bucket, **int32),
                min_live_segments=self._fewest_rows(kind, bucket, width),
            )
            return _CapturedStep(graph=None, plan=plan, input_ids=torch.zeros(1, tokens, **long))
        else:
            capacity = self.cache.index_views.capacity
            plan.sparse = SparseQueries(
                query_index=None, slots=torch.zeros(bucket, **long), block_tables=block_tables,
                tail_starts=torch.zeros(bucket, **int32), positions=positions, view_width=capacity,
                max_keys=capacity + self.draft_len + 1, num_splits=None,
            )
        return _CapturedStep(graph=None, plan=plan, input_ids=torch.zeros(1, bucket, **long))

    def _fill(self, kind: str, step: _CapturedStep, input_ids: torch.Tensor, plan: StepPlan, count: int) -> None:
        """Copy the step's metadata into the static buffers; rows past `count` become harmless padding."""
        static = step.plan
        step.input_ids[0, :count].copy_(input_ids)
        static.position_ids[0, :count].copy_(plan.position_ids[0])
        static.write_index[:count].copy_(plan.write_index)
        source = plan.dense if plan.dense is not None else plan.sparse
        target = static.dense if static.dense is not None else static.sparse
        target.positions[:count].copy_(source.positions)
        rows, width = source.block_tables.shape
        if width < target.block_tables.shape[1] or rows < target.block_tables.shape[0]:
            target.block_tables.zero_()
        target.block_tables[:rows, :width].copy_(source.block_tables)
        if kind in _BLOCK_KINDS:
            if rows != step.live_segments:  # a launch only when the row count changes
                target.live_segments.fill_(rows)
                step.live_segments = rows
            target.cu_seqlens[: rows + 1].copy_(source.cu_seqlens)
            if kind == "verify":
                target.score_starts[:rows].copy_(source.score_starts)
            target.history_lens[:rows].copy_(source.history_lens)
        if static.sparse is not None:
            target.slots[:count].copy_(source.slots)
            target.tail_starts[:count].copy_(source.tail_starts)
        self._pad(kind, step, count, rows)

    def _pad(self, kind: str, step: _CapturedStep, count: int, rows: int) -> None:
        """Make the static buffers past `count` tokens (a block graph's past `rows` segments) harmless padding: their
        K/V go to the scratch page; in a block graph all unused token slots form one padding segment that scores
        nothing and later segments are empty; a draft query reads the padding slot's empty view."""
        static = step.plan
        target = static.dense if static.dense is not None else static.sparse
        # Each of these is a device launch, and on a small model a dense step costs its host work: token padding is
        # written only where there is some.
        if count < step.input_ids.shape[1]:
            step.input_ids[0, count:].zero_()
            static.position_ids[0, count:].zero_()
            static.write_index[count:].fill_(self.cache.scratch_page * self.cache.page_size)
            target.positions[count:].zero_()
        if kind in _BLOCK_KINDS:
            target.cu_seqlens[rows + 1 :].fill_(static.write_index.shape[0])
            if kind == "verify":
                target.score_starts[rows:].fill_(-1)
            target.history_lens[rows:].zero_()
        if static.sparse is not None:
            target.slots[count:].fill_(self.cache.padding_slot)
            target.tail_starts[count:].zero_()

    def _capture(self, program: Callable, key: tuple, precision: str = "highest"):
        """Capture `program()` (after one warm-up run, see `capture_graph`) with float32 matmuls at `precision`
        (`float32_matmul_precision`; the graph keeps the kernels chosen then) and return `(graph, its outputs)`;
        `key` (see `_key`) names it in the log.

        The warm-up sees the same inputs the replay will see, so the K/V it writes are the ones the replay writes
        again.
        """
        torch.cuda.synchronize()
        started = time.perf_counter()
        # Each graph keeps a private memory pool. Graphs captured into one shared pool may place a later graph's
        # outputs in an earlier graph's scratch memory, which is safe only if they replay in capture order; a round
        # reads its draft phase's outputs after the verify graph has replayed, and the early draft launch captures
        # new draft buckets after verify buckets, so with a shared pool a verify replay could overwrite the drafts.
        with float32_matmul_precision(precision):
            graph, outputs = capture_graph(program)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        self.captures += 1
        self.capture_seconds += seconds
        kind, bucket, capacity, width, _ = key
        self.capture_log.append(f"{kind} {bucket}x{width} ({seconds:.2f} s)")
        logger.info(
            f"captured a CUDA graph: {kind}, {bucket} rows of {width}, index views {capacity} wide, {seconds:.3f} s"
        )
        return graph, outputs


def capture_graph(program: Callable) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`(graph, outputs)` of `program()` captured as a CUDA graph, after one warm-up run on a side stream (Triton
    kernels and compiled layers compile there, the allocator settles) so the capture records only replayable work.

    Python's cyclic garbage collector is off during the capture. A collection there would run the destructors of
    whatever unreachable cycles hold (the caller's and other libraries' objects included) inside the capture: CUDA
    work such as the event that releasing a pinned host tensor records on its copy's stream, which a capture in
    torch's default "global" mode may refuse. Whether a collection starts inside a capture depends on allocation
    counts, so such a failure would come and go; the garbage is collected after the capture instead.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        program()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with garbage_collection_paused(), torch.cuda.graph(graph):
        outputs = program()
    return graph, outputs


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, as it was before after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
