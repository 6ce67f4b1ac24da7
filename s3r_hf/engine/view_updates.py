"""`IndexViewUpdates`: the index views `R ∪ TopK` rebuilt from a dense forward's scores, or extended by a round's
committed positions between refreshes (`S3RConfig.refresh_interval`, the draft-length policy's `refresh_due`)."""

from __future__ import annotations

import torch

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.engine.model_runner import ModelRunner
from s3r_hf.kernels import get_backend
from s3r_hf.request import Request
from s3r_hf.step_plan import StepPlan


class IndexViewUpdates:
    """Queues view updates on the device; the caller keeps each `Request.view_len` (the host's copy) in step."""

    def __init__(self, cache: S3RCache, config: S3RConfig, runner: ModelRunner) -> None:
        self.cache = cache
        self.config = config
        self.runner = runner

    def refresh(self, plan: StepPlan, segments: list[int], requests: list[Request], contexts: list[int]) -> None:
        """New index views for requests whose committed lengths after the refresh are `contexts` (host ints), from
        the scores the dense forward recorded, or every position where a view holds the whole context (such a
        prompt is not scored: `PromptChunks`); sets their `view_len`."""
        if not requests:
            return
        for request, context in zip(requests, contexts):
            request.view_len = self.config.budget(context)
        whole = [self.config.whole_view(context) for context in contexts]
        if any(whole):
            slots = self.runner.tensor([r.slot for r, w in zip(requests, whole) if w])
            lengths = [context for context, w in zip(contexts, whole) if w]
            self.cache.index_views.set_full(slots, self.runner.tensor(lengths), width=max(lengths))
        scored = [i for i, w in enumerate(whole) if not w]
        if scored:
            picked = [requests[i] for i in scored]
            width = max(r.view_len for r in picked)
            contexts_scored = self.runner.tensor([contexts[i] for i in scored])
            self.rebuild(plan, [segments[i] for i in scored], picked, contexts_scored, width)

    def extension_slack(self) -> int:
        """How far views may outgrow their budget: each round between refreshes adds up to `draft_len + 1`."""
        return (self.config.max_refresh_interval - 1) * (self.config.draft_len + 1)

    def extend(self, requests: list[Request], committed: torch.Tensor, contexts: torch.Tensor, max_new: int) -> int:
        """Queue the append of the round's committed positions `[committed, contexts)` (device tensors) to the
        requests' views, for a round without a refresh; returns a host bound on the new view lengths."""
        width = max(r.view_len for r in requests) + max_new
        self.cache.index_views.ensure_capacity(width)
        slots = self.runner.tensor([r.slot for r in requests])
        self.cache.index_views.extend(slots, committed, contexts, max_new)
        return width

    def rebuild(
        self, plan: StepPlan, segments: list[int], requests: list[Request], contexts: torch.Tensor, width: int,
        keep_scores: bool = False,
    ) -> None:
        """Queue the index-view rebuild of `requests` (plan segments `segments`) at committed lengths `contexts`
        (a device tensor), so it needs no host read; `width` bounds the views' budgets (a host int). The plan's
        scores are released after it unless `keep_scores` (a mixed step refreshes its finished prompts' views from
        the same plan next): the next forward's scores would otherwise sit beside them."""
        seg_index = self.runner.tensor(segments)
        slots = self.runner.tensor([r.slot for r in requests])
        history = plan.dense.history_lens[seg_index]
        budgets = self.config.budgets(contexts)
        scores = plan.scores
        if scores is None:
            raise RuntimeError("the plan's forward recorded no verify scores to rebuild index views from")
        views = get_backend(scores.device).select_index_views(scores, seg_index, history, contexts, budgets, width)
        self.cache.index_views.store(None, slots, views, budgets)
        if not keep_scores:
            plan.scores = None
