"""`FirstTokens`: when a prompt's prefill is done, its first generated token is sampled from the logits of its last
position and its first index views are built from the scores of its last `draft_len + 1` queries."""

from __future__ import annotations

import torch

from s3r_hf.engine.commit import Committer
from s3r_hf.engine.sampling_setup import SamplingSetup
from s3r_hf.engine.view_updates import IndexViewUpdates
from s3r_hf.request import Request
from s3r_hf.sampler import sample_from_scores
from s3r_hf.step_plan import StepPlan


class FirstTokens:
    """Used by prefill steps and by mixed steps (whose prompt segments follow the round's verify blocks). `views` is
    None for engine AR, which never drafts from index views."""

    def __init__(self, sampling: SamplingSetup, committer: Committer, views: IndexViewUpdates | None) -> None:
        self.sampling = sampling
        self.committer = committer
        self.views = views

    def commit(self, plan: StepPlan, segments: list[int], finished: list[Request], logits: torch.Tensor) -> None:
        """`finished`: the prompts done in the forward of `plan`, at dense segments `segments`; `logits`: their last
        tokens' logits, one row each."""
        if not finished:
            return
        scores = self.sampling.logits_processor([r.row for r in finished], [r.history for r in finished], logits)
        sampled = sample_from_scores(scores, self.sampling.greedy, self.sampling.generator)
        logprobs = self.committer.logprobs(scores, sampled)
        logprobs = logprobs.tolist() if logprobs is not None else None
        first_tokens = sampled.tolist()
        for row, request in enumerate(finished):
            request.committed = request.prompt_len
            logprob = logprobs[row] if logprobs is not None else None
            self.committer.commit(request, first_tokens[row], scores, row, logits, row, logprob)
        self.committer.stopping_step()
        if self.views is not None:
            self.views.refresh(plan, segments, finished, [r.prompt_len for r in finished])
