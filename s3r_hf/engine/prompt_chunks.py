"""`PromptChunks`: the next prompt chunks of a step, as dense segments on the host. A prefill step runs them alone; a
mixed step appends them to the round's verify blocks in the same forward."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.request import Request


@dataclass
class PromptChunk:
    """Prompt positions `[start, end)` of `request`."""

    request: Request
    start: int
    end: int

    @property
    def final(self) -> bool:
        return self.end == self.request.prompt_len


class PromptChunks:
    """Chunks of `prefill_chunk_size` prompt tokens at most, in request order. A final chunk's last `draft_len + 1`
    queries are scored: their top-K builds the prompt's first index views."""

    def __init__(self, chunks: list[PromptChunk], cache: S3RCache, config: S3RConfig) -> None:
        self.chunks = chunks
        block = config.draft_len + 1
        lengths = [c.end - c.start for c in chunks]
        self.tokens = torch.cat([c.request.prompt_ids[c.start : c.end] for c in chunks])
        self.write = [i for c in chunks for i in cache.flat_indices(c.request.slot, range(c.start, c.end))]
        self.positions = [p for c in chunks for p in range(c.start, c.end)]
        self.cu_seqlens = [0]
        for length in lengths:
            self.cu_seqlens.append(self.cu_seqlens[-1] + length)
        self.score_starts = [max(0, length - block) if c.final else -1 for c, length in zip(chunks, lengths)]
        self.history_lens = [c.start + first if first >= 0 else 0 for c, first in zip(chunks, self.score_starts)]
        self.slots = [c.request.slot for c in chunks]
        self.num_candidates = max(config.budget(c.request.prompt_len) for c in chunks)
        self.max_query_len = max(lengths)
        self.max_context = max(c.end for c in chunks)
        self.max_scored_queries = max(
            (length - first for length, first in zip(lengths, self.score_starts) if first >= 0), default=0
        )
        self.finals = [i for i, c in enumerate(chunks) if c.final]  # chunk index of each prompt finished here
        self.finished = [chunks[i].request for i in self.finals]
        self.last_rows = [self.cu_seqlens[i + 1] - 1 for i in self.finals]  # their last tokens' rows

    @classmethod
    def take(
        cls,
        requests: list[Request],
        cache: S3RCache,
        config: S3RConfig,
        reserve: Callable[[Request, int], bool],
    ) -> PromptChunks | None:
        """The next chunks of `requests` in order, while the budget lasts and `reserve(request, end)` gets the pages
        of a chunk (a chunk that does not fit ends the step's chunks); None when no chunk is taken."""
        budget, chunks = config.prefill_chunk_size, []
        for request in requests:
            if budget == 0:
                break
            end = min(request.prompt_len, request.prefilled + budget)
            if not reserve(request, end):
                break
            budget -= end - request.prefilled
            chunks.append(PromptChunk(request, request.prefilled, end))
        return cls(chunks, cache, config) if chunks else None

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    def done(self, cache: S3RCache) -> None:
        """After the forward: the chunks' K/V are in the cache."""
        for chunk in self.chunks:
            chunk.request.prefilled = chunk.end
            cache.set_length(chunk.request.slot, chunk.end)
