"""`PromptChunks`: the next prompt chunks of a step, as dense segments on the host. A prefill step runs them alone; a
mixed step appends them to the round's verify blocks in the same forward.

With `S3RConfig.share_prompts`, a request that has not begun its prompt while another with the identical prompt (a
*leader*) prefills it waits, and becomes a *follower* in the step that finishes the leader's prompt: it takes no
chunk, costs no prompt tokens of the step's budget, and after the forward copies the leader's K/V pages. It finishes
its prompt in that step, with the leader's segment (its first index views come from the leader's scores) and the
leader's last-token logits (its first token is its own sample from them).

A request whose prompt a running request already holds whole (a *donor*: its leader finished the prompt in an earlier
step, as when requests are admitted one by one as others finish) copies all of it but the last token from the donor
before the forward and prefills that token alone. Its first index views then come from one query's scores instead of
`draft_len + 1`: which positions the drafter reads changes acceptance only, never the samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.request import Request, RequestStatus


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
    """Chunks of `prefill_chunk_size` prompt tokens at most, in request order, and the followers of whole-prompt
    chunks (`followers`: each request with its leader's chunk index). A final chunk's last `draft_len + 1` queries
    are scored: their top-K builds the prompt's first index views (a prompt copied from a donor has one query). A
    prompt whose view holds all of it (`S3RConfig.whole_view`, up to `min_budget` tokens) is not scored: its view is
    every position, whatever the scores. With `scores` off (engine AR, which never drafts) no prompt is scored."""

    def __init__(
        self,
        chunks: list[PromptChunk],
        cache: S3RCache,
        config: S3RConfig,
        followers: list[tuple[Request, int]] | None = None,
        copied_tokens: int = 0,
        scores: bool = True,
    ) -> None:
        self.chunks = chunks
        self.followers = followers or []
        self.copied_tokens = copied_tokens  # prompt tokens copied from donors before the forward
        block = config.draft_len + 1
        lengths = [c.end - c.start for c in chunks]
        self.tokens = torch.cat([c.request.prompt_ids[c.start : c.end] for c in chunks])
        self.write = [i for c in chunks for i in cache.flat_indices(c.request.slot, range(c.start, c.end))]
        self.positions = [p for c in chunks for p in range(c.start, c.end)]
        self.cu_seqlens = [0]
        for length in lengths:
            self.cu_seqlens.append(self.cu_seqlens[-1] + length)
        self.score_starts = [
            max(0, length - block) if scores and c.final and not config.whole_view(c.request.prompt_len) else -1
            for c, length in zip(chunks, lengths)
        ]
        self.scored = any(first >= 0 for first in self.score_starts)
        self.history_lens = [c.start + first if first >= 0 else 0 for c, first in zip(chunks, self.score_starts)]
        self.slots = [c.request.slot for c in chunks]
        self.num_candidates = max(config.budget(c.request.prompt_len) for c in chunks)
        self.max_query_len = max(lengths)
        self.max_context = max(c.end for c in chunks)
        self.max_scored_queries = max(
            (length - first for length, first in zip(lengths, self.score_starts) if first >= 0), default=0
        )
        # The chunk (segment) index of each prompt finished here, a follower's being its leader's.
        finals = [i for i, c in enumerate(chunks) if c.final]
        self.finals = finals + [leader for _, leader in self.followers]
        self.finished = [chunks[i].request for i in finals] + [follower for follower, _ in self.followers]
        self.last_rows = [self.cu_seqlens[i + 1] - 1 for i in self.finals]  # their last tokens' rows

    @classmethod
    def take(
        cls,
        requests: list[Request],
        cache: S3RCache,
        config: S3RConfig,
        reserve: Callable[[Request, int], bool],
        donors: dict[bytes, Request] | None = None,
        scores: bool = True,
    ) -> PromptChunks | None:
        """The next chunks of `requests` in order, while the budget lasts and `reserve(request, end)` gets the pages
        of a chunk (a chunk that does not fit ends the step's chunks); None when no chunk is taken. `scores`: see
        the class.

        `donors`: running requests whose whole prompt is in the cache, by prompt. A request that has not begun a
        prompt a donor holds copies all of it but its last token from the donor now, and prefills that token alone
        (its logits give the first token, its scores the first index views)."""
        budget, chunks, followers, copied = config.prefill_chunk_size, [], [], 0
        share = config.share_prompts
        donors = donors if share and donors else {}
        # Prompts some request has begun to prefill: a request with the same prompt that has not begun waits to copy
        # it, and follows the leader in the step that finishes it (`leaders`: prompt -> chunk index).
        started = {r.prompt_key for r in requests if share and r.prefilled > 0}
        leaders: dict[bytes, int] = {}
        for request in requests:
            fresh = share and request.prefilled == 0
            if fresh and request.prompt_key in leaders:
                if not reserve(request, request.prompt_len):
                    break
                followers.append((request, leaders[request.prompt_key]))
                continue
            if budget == 0:
                continue  # later requests may still follow a leader of this step
            donor = donors.get(request.prompt_key) if fresh and request.prompt_len > 1 else None
            if donor is not None and donor.status is not RequestStatus.RUNNING:
                donor = None
            if donor is None and fresh and request.prompt_key in started:
                continue  # it waits for its leader
            start = request.prompt_len - 1 if donor is not None else request.prefilled
            end = min(request.prompt_len, start + budget)
            if not reserve(request, end):
                break
            if donor is not None:  # all but the last token from the donor, before the forward
                cache.copy_prefix([(donor.slot, request.slot)], start)
                request.prefilled = start
                copied += start
            budget -= end - request.prefilled
            if share:
                if end == request.prompt_len:
                    leaders[request.prompt_key] = len(chunks)
                else:
                    started.add(request.prompt_key)
            chunks.append(PromptChunk(request, request.prefilled, end))
        return cls(chunks, cache, config, followers, copied, scores) if chunks else None

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def shared_tokens(self) -> int:
        """Prompt tokens copied instead of computed: from donors, and by the followers."""
        return self.copied_tokens + sum(follower.prompt_len for follower, _ in self.followers)

    def done(self, cache: S3RCache) -> None:
        """After the forward: the chunks' K/V are in the cache; the followers copy their leaders'."""
        for chunk in self.chunks:
            chunk.request.prefilled = chunk.end
            cache.set_length(chunk.request.slot, chunk.end)
        if self.followers:
            pairs = [(self.chunks[leader].request.slot, follower.slot) for follower, leader in self.followers]
            cache.copy_prefix(pairs, [follower.prompt_len for follower, _ in self.followers])
            for follower, _ in self.followers:
                follower.prefilled = follower.prompt_len
