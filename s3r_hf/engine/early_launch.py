"""`EarlyLaunches`: the next round's work queued on the device before the host has read this round's decision, so
the device drafts (or runs the next dense step) while the host reads, rolls back and commits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.draft_phase import DraftOutputs
from s3r_hf.engine.acceptance import draft_count
from s3r_hf.engine.model_runner import ModelRunner, Verified
from s3r_hf.request import Request


@dataclass
class LaunchedDrafts:
    """A round's draft phase, launched before the host read the decision of the round before it. `draft_counts` are
    the host's copy of what the device computed, set once the host has read that decision."""

    requests: list[Request]
    tables: torch.Tensor
    drafts: DraftOutputs
    draft_counts: list[int] | None = None


@dataclass
class LaunchedStep:
    """The next dense step's forward, launched before the host read this step's tokens; `scored` when it records the
    scores of an index-view refresh."""

    requests: list[Request]
    verified: Verified
    scored: bool = False


def launched_rows(launched: list[Request], requests: list[Request]) -> list[int | None]:
    """Row of each of `requests` in work launched early for `launched` (None for a request it did not cover)."""
    index = {id(request): row for row, request in enumerate(launched)}
    return [index.get(id(request)) for request in requests]


class EarlyLaunches:
    """Holds at most one early draft phase (`drafts`) and one early dense step (`step`) until the next round takes
    them."""

    def __init__(self, runner: ModelRunner, cache: S3RCache, config: S3RConfig, drafts_only: bool) -> None:
        self.runner = runner
        self.cache = cache
        self.config = config
        self.drafts_only = drafts_only
        self.drafts: LaunchedDrafts | None = None
        self.step: LaunchedStep | None = None

    def launch_drafts(
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
        dropped from the outputs in the next round (`take_drafts`); their writes go to their own reserved pages or
        the scratch row. Skipped when those pages do not fit without pausing someone.
        """
        # A request that accepts no draft has the most tokens left, so the most drafts next round.
        most_drafts = [draft_count(r.remaining - 1, next_k, self.drafts_only) for r in requests]
        if max(most_drafts, default=0) == 0:
            return
        ends = [
            min(r.peak_kv_tokens(self.config.draft_len), r.committed + count + 1 + most + 1)
            for r, count, most in zip(requests, draft_counts, most_drafts)
        ]
        if not self.cache.reserve_if_fits([r.slot for r in requests], ends):
            return
        tables = self.cache.block_tables([r.slot for r in requests])
        counts = draft_count(remaining, next_k, self.drafts_only)
        drafts = self.runner.run_draft_phase(
            requests, next_tokens, contexts, counts, tables, view_width, max(most_drafts), next_k
        )
        self.drafts = LaunchedDrafts(list(requests), tables, drafts)  # `requests` is mutated later

    def set_draft_counts(self, requests: list[Request], accepted: list[int], next_k: int) -> None:
        """Once the host has read the decision: the launched phase's draft counts, as the device computed them."""
        if self.drafts is not None:
            self.drafts.draft_counts = [
                draft_count(r.remaining - (a + 1), next_k, self.drafts_only) for r, a in zip(requests, accepted)
            ]

    def take_drafts(self, requests: list[Request], draft_counts: list[int]):
        """`(draft counts, block tables, draft tokens, draft scores)` of this round from the early draft phase, or
        None when there is none or it covers fewer than half of `requests` (then the round drafts afresh).

        Requests it covers take their rows (those that finished in the previous round are dropped). Requests it
        does not cover, admitted or restored since it was launched, draft nothing this round: they take one dense
        token, and draft with the others from the next round on.
        """
        launched, self.drafts = self.drafts, None
        if launched is None:
            return None
        rows = launched_rows(launched.requests, requests)
        covered = [row is not None and launched.draft_counts[row] == count for row, count in zip(rows, draft_counts)]
        if 2 * sum(covered) < len(requests):
            return None
        tokens, scores = launched.drafts.tokens, launched.drafts.scores
        if all(covered) and rows == list(range(len(launched.requests))):
            return draft_counts, launched.tables, tokens, scores
        counts = [count if ok else 0 for count, ok in zip(draft_counts, covered)]
        gather = self.runner.tensor([row if ok else 0 for row, ok in zip(rows, covered)])  # uncovered rows: ignored
        return counts, self.cache.block_tables([r.slot for r in requests]), tokens[gather], scores[gather]

    def launch_dense_step(
        self, requests: list[Request], next_tokens: torch.Tensor, zeros: torch.Tensor, scored: bool
    ) -> None:
        """Queue the next dense step's forward (`scored`: a refresh step's) before the host reads this step's
        tokens. Every request commits exactly one token per step, so the next step's lengths and pages are known on
        the host, and its input tokens are `next_tokens` on the device; the host reads and commits while the device
        runs it (the same overlap the S3R draft phase gets from `launch_drafts`, so the baseline is not held back by
        host time). `zeros` are the step's (empty) draft tokens. Requests that finish now get a row too, dropped
        next step."""
        if all(r.remaining <= 1 for r in requests):
            return
        if not self.cache.reserve_if_fits([r.slot for r in requests], [r.committed + 2 for r in requests]):
            return
        tables = self.cache.block_tables([r.slot for r in requests])
        committed = [r.committed + 1 for r in requests]
        verified = self.runner.verify(
            requests, [0] * len(requests), zeros, tables, round_k=0, committed=committed, pending=next_tokens,
            scored=scored,
        )
        self.step = LaunchedStep(list(requests), verified, scored)  # `requests` is mutated later

    def has_dense_step_for(self, requests: list[Request], scored: bool) -> bool:
        """Whether `take_dense_step(requests, scored)` would serve the step launched early: there is one, of this
        kind (`scored`), and no request joined since. A scored step serves only the very rows it was launched for:
        its scores are laid out by them, and a refresh would read other requests' segments."""
        launched = self.step
        if launched is None or launched.scored != scored:
            return False
        rows = launched_rows(launched.requests, requests)
        return None not in rows and (not scored or rows == list(range(len(launched.requests))))

    def take_dense_step(self, requests: list[Request], scored: bool) -> Verified | None:
        """This step's forward from `launch_dense_step`, for the rows of `requests`; None when it would not serve
        (`has_dense_step_for`; then the step runs again)."""
        serves = self.has_dense_step_for(requests, scored)
        launched, self.step = self.step, None
        if not serves:
            return None
        rows = launched_rows(launched.requests, requests)
        if rows == list(range(len(launched.requests))):
            return launched.verified
        keep = self.runner.tensor(rows)  # one query per request, so a request's row is its logits row too
        verified = launched.verified
        return Verified(verified.plan, verified.logits[keep], list(range(len(rows) + 1)), verified.target_scores[keep])
