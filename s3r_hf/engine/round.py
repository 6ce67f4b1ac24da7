"""`SpeculativeRound`: one round of every running request. Draft, verify, accept, update the index views, commit.

Everything the next round's draft phase needs is queued on the device behind the copy of this round's decision,
before the host reads it (docs/architecture.md, "One engine step"); the host then rolls the cache back to the
accepted prefix and commits.
"""

from __future__ import annotations

import torch

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.draft_policy import DraftLengthPolicy
from s3r_hf.engine.acceptance import Acceptance, draft_count
from s3r_hf.engine.commit import Committer
from s3r_hf.engine.early_launch import EarlyLaunches
from s3r_hf.engine.model_runner import ModelRunner, Verified
from s3r_hf.engine.prompt_chunks import PromptChunks
from s3r_hf.engine.round_timing import RoundTimer, round_shape
from s3r_hf.engine.view_updates import IndexViewUpdates
from s3r_hf.request import Request
from s3r_hf.staging import start_host_copy
from s3r_hf.stats import S3RStats


class SpeculativeRound:
    """Runs rounds and keeps what carries from one round to the next: the chosen draft lengths, whether the index
    views are stale, and the rounds since their last refresh.

    `learns_acceptance`: the policy is told what the drafts' rounds accepted (exact S3R and forced acceptance, not
    the unverified drafter). `refreshes_views`: outside engine AR, a drafting round after dense steps first runs a
    refresh step. `may_launch_early` is set by the engine per round (never with stage timing).
    """

    def __init__(
        self,
        runner: ModelRunner,
        views: IndexViewUpdates,
        acceptance: Acceptance,
        early: EarlyLaunches,
        committer: Committer,
        timer: RoundTimer,
        policy: DraftLengthPolicy,
        cache: S3RCache,
        config: S3RConfig,
        stats: S3RStats,
        learns_acceptance: bool,
        refreshes_views: bool,
    ) -> None:
        self.runner, self.views, self.acceptance, self.early = runner, views, acceptance, early
        self.committer, self.timer, self.policy = committer, timer, policy
        self.cache, self.config, self.stats = cache, config, stats
        self.learns_acceptance = learns_acceptance
        self.refreshes_views = refreshes_views
        self.may_launch_early = False
        self.round_k = 0  # the draft length of the round being planned or run
        self.next_k: int | None = None  # the next round's draft length, when chosen while this round ran
        # Dense steps (k = 0) neither score nor extend the index views; a round that drafts after them first runs
        # one scored dense step to rebuild the views (a refresh step).
        self.views_stale = False
        self.rounds_since_refresh = 0  # rounds whose views were only extended (the policy's `refresh_due`)

    def choose_draft_len(self, requests: list[Request]) -> int:
        """This round's draft length: the one chosen while the previous round ran (its drafts may already be on the
        device), else the policy's choice now. The time since the previous round began is that round's cost."""
        self.timer.cost_previous_round(self.policy)
        k, self.next_k = self.next_k, None
        self.round_k = self.policy.choose(round_shape(requests)) if k is None else k
        return self.round_k

    def runs_queued_dense_step(self, requests: list[Request], k: int) -> bool:
        """Whether a round of draft length `k` would run as a dense step (`k = 0`, or the refresh step before
        drafting resumes) whose forward the round before already launched for these requests."""
        refresh_step = k > 0 and self.views_stale and self.refreshes_views
        if k > 0 and not refresh_step:
            return False
        return self.early.has_dense_step_for(requests, scored=refresh_step)

    def draft_count(self, request: Request) -> int:
        """Drafts this round: `max_new_tokens` shortens the last block (the round adds drafts + 1 tokens)."""
        if not self.round_k:  # a dense step (asked for every request, twice per step)
            return 0
        return draft_count(request.remaining, self.round_k, self.acceptance.drafts_only)

    def run(self, requests: list[Request], k: int, prompts: PromptChunks | None = None) -> Verified | None:
        """One round of draft length `k` for every running request. `k = 0` is a dense step; if the views went stale
        in dense steps, a `k > 0` round runs as a refresh step first (a scored dense step that rebuilds them) and
        drafts `k` in the round after it. In a mixed step the verify forward also runs the `prompts` chunks
        (`MixedStep`); returns the verify forward."""
        if not requests:
            return None
        refresh_step = k > 0 and self.views_stale and self.refreshes_views
        if refresh_step:
            self.next_k, k = k, 0
        self.round_k = k
        # The views are refreshed from this verify's scores, extended by its committed tokens, or left as they are.
        age = self.rounds_since_refresh  # rounds since the views this round drafts from were refreshed
        refresh = refresh_step or (k > 0 and self.policy.refresh_due(round_shape(requests), k, age))
        started = self.timer.round_started(requests, k, refresh_step, refresh)

        # Draft: taken from the early launch when it covers the round, else drafted now.
        draft_counts = [self.draft_count(r) for r in requests]
        draft_counts, tables, draft_tokens, draft_scores = self._draft(requests, draft_counts)
        max_drafts = max(draft_counts, default=0)
        started = self.timer.stage_done("draft", started)

        # Verify `[pending, d_1..d_k]` densely (scored when the views are refreshed from it); a mixed step's prompt
        # chunks run in the same forward.
        verified = self._verify(requests, draft_counts, draft_tokens, tables, k, refresh, prompts)
        started = self.timer.stage_done("verify", started)

        # Accept; the decision is the one device-to-host read, and its copy is queued first.
        num_drafts = (
            self.runner.tensor(draft_counts) if max_drafts
            else torch.zeros(len(requests), dtype=torch.long, device=self.runner.device)  # one launch, no copy
        )
        num_accepted, next_tokens = self.acceptance.accept(
            draft_tokens, draft_scores, verified.target_scores, num_drafts, max_drafts
        )
        decision = torch.cat([num_accepted[:, None], next_tokens[:, None], draft_tokens[:, :max_drafts]], dim=1)
        read_decision = start_host_copy(decision)
        started = self.timer.stage_done("accept", started)

        # Behind the copy on the device: the views' update, the log-probs, and the next round's early launch.
        next_round = self._update_views(requests, verified, num_accepted, max_drafts, k, refresh, prompts is not None)
        logprobs = self._logprobs(len(requests), draft_tokens, verified.target_scores, num_accepted, next_tokens)
        if self.may_launch_early:
            self._launch_next(requests, k, draft_counts, draft_tokens, num_accepted, next_tokens, next_round)
        started = self.timer.stage_done("refresh", started)

        # The host reads the decision, rolls the cache back to the accepted prefix and commits.
        self._commit(requests, read_decision().tolist(), draft_counts, max_drafts, k, refresh, age, logprobs, verified)
        self.timer.stage_done("commit", started)
        return verified

    # ---------------------------------------------------------------- stages
    def _draft(self, requests: list[Request], draft_counts: list[int]):
        """`(draft counts, block tables, draft tokens, draft scores)` of the round."""
        launched = self.early.take_drafts(requests, draft_counts)
        if launched is not None:  # drafted while the host read and committed the previous round
            return launched
        if not any(draft_counts):  # a dense step: no drafts, and its block tables only if its forward runs now
            zeros = torch.zeros(len(requests), 1, dtype=torch.long, device=self.runner.device)
            no_scores = zeros.new_empty(len(requests), 0, self.runner.vocab_size, dtype=torch.float)
            return draft_counts, None, zeros, no_scores
        # Pages for the whole round were reserved before it: one block table serves every forward of the round.
        tables = self.cache.block_tables([r.slot for r in requests])
        draft_tokens, draft_scores = self.runner.draft(requests, draft_counts, tables, self.round_k)
        return draft_counts, tables, draft_tokens, draft_scores

    def _verify(self, requests, draft_counts, draft_tokens, tables, k: int, refresh: bool, prompts) -> Verified:
        """A dense step launched early serves unless the step drafts or packs prompt chunks (then it runs again)."""
        verified = self.early.take_dense_step(requests, scored=refresh)
        if verified is None or k > 0 or prompts is not None:
            if tables is None:
                tables = self.cache.block_tables([r.slot for r in requests])
            verified = self.runner.verify(
                requests, draft_counts, draft_tokens, tables, round_k=k, scored=refresh, prompts=prompts
            )
        return verified

    def _update_views(
        self, requests, verified: Verified, num_accepted, max_drafts: int, k: int, refresh: bool, mixed: bool
    ):
        """Queue the views' rebuild (`refresh`) or extension (a drafting round between refreshes) at the new
        committed lengths; a dense step leaves them stale. A `mixed` step's scores are kept for its prompts' views.
        Returns what an early draft launch needs, `(contexts, remaining, view width)` on the device, or None when
        the views were left as they are."""
        if not (refresh or k > 0):
            self.views_stale = True  # a dense step: the views miss its token until the next refresh
            return None
        committed, remaining = self.runner.tensor([[r.committed for r in requests], [r.remaining for r in requests]])
        contexts = committed + num_accepted + 1  # K/V of the pending token and the accepted drafts are valid
        # Views of requests that finish this round are rebuilt too (harmless: their slots are released after it).
        plan = verified.plan
        if refresh:
            self.views.rebuild(
                plan, list(range(len(requests))), requests, contexts, plan.dense.num_candidates, keep_scores=mixed
            )
            width = plan.dense.num_candidates
        else:
            width = self.views.extend(requests, committed, contexts, max_drafts + 1)
        if k > 0:
            self.stats.view_refreshes += refresh
            self.stats.view_extensions += not refresh
        self.rounds_since_refresh = 0 if refresh else self.rounds_since_refresh + 1
        self.views_stale = False
        return contexts, remaining, width

    def _logprobs(self, rows: int, draft_tokens, target_scores, num_accepted, next_tokens) -> torch.Tensor | None:
        """Log-probability of the token committed at each block offset (the accepted drafts, then the correction or
        bonus token), queued before an early draft phase overwrites the draft buffers."""
        if not self.config.return_logprobs:
            return None
        spare = torch.zeros(rows, 1, dtype=torch.long, device=draft_tokens.device)
        proposed = torch.cat([draft_tokens, spare], dim=1)[:, : target_scores.shape[1]]
        proposed[torch.arange(rows, device=draft_tokens.device), num_accepted] = next_tokens
        return self.committer.logprobs(target_scores, proposed)

    def _launch_next(self, requests, k: int, draft_counts, draft_tokens, num_accepted, next_tokens, next_round) -> None:
        """The next round's draft length, chosen now from what the rounds before this one cost, so its work can be
        queued behind this round's before the host reads the decision: its draft phase, or a dense step after a
        dense step (its lengths are known on the host), scored when it is the refresh step before drafting
        resumes."""
        if self.next_k is None:
            self.next_k = self.policy.choose(round_shape(requests))
        drafts_next = self.next_k > 0 and not self.views_stale
        if drafts_next and self.runner.draft_phase is not None:
            contexts, remaining, view_width = next_round
            left = remaining - (num_accepted + 1)
            self.early.launch_drafts(requests, draft_counts, next_tokens, contexts, left, view_width, self.next_k)
        elif not drafts_next and k == 0 and self.runner.sampling.logits_processor.history_free:
            self.early.launch_dense_step(requests, next_tokens, draft_tokens, scored=self.next_k > 0)

    def _commit(
        self, requests, decision, draft_counts, max_drafts: int, k: int, refresh: bool, age: int, logprobs, verified
    ):
        accepted = [row[0] for row in decision]
        self.early.set_draft_counts(requests, accepted, self.next_k)  # the counts the device computed
        for request, count in zip(requests, accepted):
            request.committed += count + 1
            # Pages past the new length stay reserved: an early draft phase may be writing into them.
            self.cache.set_length(request.slot, request.committed, release_pages=False)
            if refresh:  # the host's copy of what the device's rebuild or extension set
                request.view_len = self.config.budget(request.committed)
            elif k > 0:
                request.view_len += count + 1
        if max_drafts > 0 and self.learns_acceptance:
            self.policy.observe_acceptance(draft_counts, accepted, age)
        logprobs = logprobs.tolist() if logprobs is not None else None
        proposals = [row[2:][: row[0]] + [row[1]] for row in decision]
        committed = self.committer.commit_round(
            requests, proposals, logprobs, verified.target_scores, verified.logits, verified.block_starts
        )
        self.stats.steps += 1
        rows = [request.row for request in requests] if max_drafts > 0 else None  # a dense step counts no drafts
        self.stats.record_round(draft_counts, accepted, committed, rows)
