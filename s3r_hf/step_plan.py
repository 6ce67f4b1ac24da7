"""`StepPlan`: what one packed engine forward computes, read by the S3R attention function.

A forward packs many requests' tokens into one `[1, N]` batch. Each token belongs to a segment of one of two
kinds: *dense* segments (prefill chunks and verify blocks) attend causally over the request's full cache;
*sparse* queries (draft tokens) attend over the request's index view plus the provisional tail of the block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DenseSegments:
    """Dense causal segments of a step (prefill chunks, verify blocks)."""

    query_index: torch.Tensor | None  # [Nd] rows of the packed batch; None = all rows, in order
    cu_seqlens: torch.Tensor  # [Sd + 1] int32
    positions: torch.Tensor  # [Nd] int32 absolute positions
    block_tables: torch.Tensor  # [Sd, max_pages] int32
    score_starts: torch.Tensor | None  # [Sd] first scored query inside each segment, -1 = not scored
    history_lens: torch.Tensor  # [Sd] top-K candidates are drawn from positions < history_lens
    num_candidates: int  # top-K candidates kept per (segment, KV head)
    max_query_len: int  # longest segment (host int: kernels size their grids without reading the device)
    max_context: int  # longest context, the last query's position + 1
    max_scored_queries: int = 0  # most scored queries of any segment (sizes the verify-score scratch)
    num_splits: int | None = None  # fixed key split (CUDA-graph steps); None lets the kernel choose
    # `[1]` int32 on the device: how many leading segments hold real queries (a CUDA graph's static plan, replayed
    # at fewer rows than it holds). The kernel sizes its key splits for those rather than for the whole grid.
    live_segments: torch.Tensor | None = None
    min_live_segments: int = 1  # the fewest `live_segments` will hold (the graph's smallest replay)
    # A prefill step split by kind of query (`attention.py`; long chunks, or scored chunks longer than their scored
    # queries): `(segment, first packed row, first position, end position)` of each long one, which runs through
    # torch's fused causal attention (possibly none); the other segments' queries (`paged`, unscored) and every
    # segment's scored queries (`scored`, for their scores) go through the paged kernel, as segments with only those
    # queries.
    prefill_spans: list[tuple[int, int, int, int]] | None = None
    paged: DenseSegments | None = None
    scored: DenseSegments | None = None


@dataclass
class SparseQueries:
    """Single-token draft queries of a step."""

    query_index: torch.Tensor | None  # [Ns] rows of the packed batch; None = all rows, in order
    slots: torch.Tensor  # [Ns] cache slots (index views are per slot)
    block_tables: torch.Tensor  # [Ns, max_pages] int32
    tail_starts: torch.Tensor  # [Ns] int32 committed length: positions >= this are the block's provisional drafts
    positions: torch.Tensor  # [Ns] int32 absolute positions
    view_width: int  # longest index view among the queries' requests (host int)
    max_keys: int  # longest view + provisional tail (host int)
    num_splits: int | None = None  # fixed key split (CUDA-graph steps); None lets the kernel choose
    # Every layer's index views of `slots`, gathered once per forward by the engine (not once per layer).
    views: torch.Tensor | None = None  # [num_layers, Ns, Hkv, view_width] int32
    view_lens: torch.Tensor | None = None  # [Ns] int32


@dataclass
class StepPlan:
    """One packed forward: where each token's K/V goes and how each query attends."""

    write_index: torch.Tensor  # [N] flat pool row (page * page_size + offset) of each packed token
    position_ids: torch.Tensor  # [1, N]
    dense: DenseSegments | None = None
    sparse: SparseQueries | None = None
    # Filled by the attention function: every layer's verify scores of the scored segments in one tensor
    # `[layers, Sd, Hkv, max_context]`, so an index-view refresh reads them without stacking them first.
    scores: torch.Tensor | None = None
    layers_seen: set[int] = field(default_factory=set)
