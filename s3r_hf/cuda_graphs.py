"""CUDA graphs for single-token steps: sparse draft passes and dense decode steps.

A decode forward of an HF model launches hundreds of small kernels; at the batch sizes of RL rollouts that
launch work, not the memory traffic, sets the step time. Single-token steps have a fixed shape for a given
number of requests, so each (kind, batch bucket) is captured once and replayed: the step's metadata is copied
into the graph's static buffers, padding rows write their K/V to the cache's scratch page and read the
padding index-view row (length 0), and the kernels run with one program per row (a fixed grid).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.step_plan import DenseSegments, SparseQueries, StepPlan

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclass
class _CapturedStep:
    graph: torch.cuda.CUDAGraph | None
    plan: StepPlan
    input_ids: torch.Tensor  # [1, B]
    logits: torch.Tensor | None = None  # [B, V], the graph's output


class DecodeGraphs:
    """Captures and replays the model forward of single-token steps (draft passes, dense decode steps).

    Args:
        cache: the engine's `S3RCache`.
        forward: runs the model on `(input_ids [1, B], plan)` and returns logits `[B, V]`.
        max_pages: widest block table of any request of the call.
        draft_len: tokens drafted per round (bounds the provisional tail of a draft query).
    """

    def __init__(self, cache: S3RCache, forward: Callable, max_pages: int, draft_len: int) -> None:
        self.cache = cache
        self.forward = forward
        self.max_pages = max_pages
        self.max_context = max_pages * cache.page_size
        self.draft_len = draft_len
        self.steps: dict[tuple, _CapturedStep] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0

    @staticmethod
    def kind(plan: StepPlan) -> str | None:
        """`"sparse"` for draft steps, `"dense"` for single-query unscored dense steps, else `None`."""
        if plan.sparse is not None and plan.dense is None and plan.sparse.query_index is None:
            return "sparse"
        dense = plan.dense
        if (
            dense is not None and plan.sparse is None and dense.query_index is None and dense.score_starts is None
            and dense.max_query_len == 1
        ):
            return "dense"
        return None

    def supports(self, plan: StepPlan, num_tokens: int) -> bool:
        return self.kind(plan) is not None and num_tokens <= BUCKETS[-1]

    def run(self, input_ids: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """Logits `[n, V]` of the step, from a replayed graph (captured on first use of its bucket)."""
        kind = self.kind(plan)
        count = input_ids.shape[0]
        bucket = next(b for b in BUCKETS if b >= count)
        key = (kind, bucket, self.cache.index_views.capacity if kind == "sparse" else 0)
        step = self.steps.get(key)
        if step is None:
            self._drop_stale(kind, key)
            step = self._static_step(kind, bucket)
            self._fill(step, input_ids, plan, count)
            self._capture(step)
            self.steps[key] = step
        else:
            self._fill(step, input_ids, plan, count)
        step.graph.replay()
        self.replays += 1
        # A copy: the graph's output buffer is overwritten by the next replay.
        return step.logits[:count].to(torch.float32, copy=True)

    def _drop_stale(self, kind: str, key: tuple) -> None:
        """Index views grew (a new tensor): graphs that read the old one must not run again."""
        for old in [k for k in self.steps if k[0] == kind and k[1] == key[1] and k != key]:
            del self.steps[old]

    def _static_step(self, kind: str, bucket: int) -> _CapturedStep:
        device = self.cache.device
        long = dict(dtype=torch.long, device=device)
        int32 = dict(dtype=torch.int32, device=device)
        positions = torch.zeros(bucket, **int32)
        block_tables = torch.zeros(bucket, self.max_pages, **int32)
        plan = StepPlan(write_index=torch.zeros(bucket, **long), position_ids=torch.zeros(1, bucket, **long))
        if kind == "dense":
            plan.dense = DenseSegments(
                query_index=None, cu_seqlens=torch.arange(bucket + 1, **int32), positions=positions,
                block_tables=block_tables, score_starts=None, history_lens=torch.zeros(bucket, **long),
                num_candidates=0, max_query_len=1, max_context=self.max_context, num_splits=1,
            )
        else:
            capacity = self.cache.index_views.capacity
            plan.sparse = SparseQueries(
                query_index=None, slots=torch.zeros(bucket, **long), block_tables=block_tables,
                tail_starts=torch.zeros(bucket, **int32), positions=positions, view_width=capacity,
                max_keys=capacity + self.draft_len + 1, num_splits=1,
            )
        return _CapturedStep(graph=None, plan=plan, input_ids=torch.zeros(1, bucket, **long))

    def _fill(self, step: _CapturedStep, input_ids: torch.Tensor, plan: StepPlan, count: int) -> None:
        """Copy the step's metadata into the static buffers; rows past `count` become harmless padding."""
        static = step.plan
        scratch_row = self.cache.scratch_page * self.cache.page_size
        step.input_ids[0, :count].copy_(input_ids)
        step.input_ids[0, count:].zero_()
        static.position_ids[0, :count].copy_(plan.position_ids[0])
        static.position_ids[0, count:].zero_()
        static.write_index[:count].copy_(plan.write_index)
        static.write_index[count:].fill_(scratch_row)
        source = plan.dense if plan.dense is not None else plan.sparse
        target = static.dense if static.dense is not None else static.sparse
        target.positions[:count].copy_(source.positions)
        target.positions[count:].zero_()
        target.block_tables.zero_()
        target.block_tables[:count, : source.block_tables.shape[1]].copy_(source.block_tables)
        if static.sparse is not None:
            target.slots[:count].copy_(source.slots)
            target.slots[count:].fill_(self.cache.padding_slot)
            target.tail_starts[:count].copy_(source.tail_starts)
            target.tail_starts[count:].zero_()

    def _capture(self, step: _CapturedStep) -> None:
        # Warm up on a side stream (Triton compiles, allocator settles), then capture. The warm-up forwards
        # write the same K/V the replay will write, so they change nothing.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(step.input_ids, step.plan)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step.logits = self.forward(step.input_ids, step.plan)
        step.graph = graph
