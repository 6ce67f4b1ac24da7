"""How a round decides what it keeps of its drafts: exact speculative sampling, and two diagnostic rules that are
not exact (a forced acceptance rate for timing random-weight models, and committing the drafts unverified)."""

from __future__ import annotations

import torch

from s3r_hf.sampler import sample_from_scores, speculative_accept


def draft_count(remaining: int | torch.Tensor, most: int, drafts_only: bool) -> int | torch.Tensor:
    """Drafts of a round of draft length `most` that starts with `remaining` tokens left to generate (an int on the
    host, or a tensor of them on the device: the same rule either way). A round adds its drafts plus one token, so
    an exact round drafts at most `remaining - 1`; a rule that commits its drafts only (`drafts_only`) drafts up to
    `remaining`."""
    limit = remaining if drafts_only else remaining - 1
    if isinstance(limit, torch.Tensor):
        return limit.clamp(min=0, max=most)
    return max(0, min(most, limit))


class Acceptance:
    """`accept(...) -> (num_accepted [R], next_tokens [R])`, on the device, with no host read."""

    drafts_only = False  # the round commits its accepted drafts and no correction or bonus token

    def accept(
        self,
        draft_tokens: torch.Tensor,
        draft_scores: torch.Tensor,
        target_scores: torch.Tensor,
        num_drafts: torch.Tensor,
        max_drafts: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class ExactAcceptance(Acceptance):
    """Speculative sampling (`sampler.speculative_accept`): the committed tokens are distributed as dense sampling's;
    greedy keeps the drafts that match the argmax."""

    def __init__(self, greedy: bool, generator: torch.Generator | None) -> None:
        self.greedy = greedy
        self.generator = generator

    def accept(self, draft_tokens, draft_scores, target_scores, num_drafts, max_drafts):
        result = speculative_accept(
            draft_tokens[:, :max_drafts], draft_scores[:, :max_drafts], target_scores, num_drafts,
            self.greedy, self.generator,
        )
        return result.num_accepted, result.next_tokens


class ForcedAcceptance(Acceptance):
    """Benchmark-only acceptance pattern (NOT exact): each draft passes with probability `rate`, so random-weight
    models can time the cost side of a given acceptance."""

    def __init__(self, rate: float, generator: torch.Generator | None) -> None:
        self.rate = rate
        self.generator = generator

    def accept(self, draft_tokens, draft_scores, target_scores, num_drafts, max_drafts):
        device = draft_tokens.device
        rows = torch.arange(draft_tokens.shape[0], device=device)
        coins = torch.rand(draft_tokens.shape, device=device, generator=self.generator)
        drafted = torch.arange(draft_tokens.shape[1], device=device)[None, :] < num_drafts[:, None]
        passed = (coins < self.rate) & drafted
        num_accepted = torch.cumprod(passed.int(), dim=-1).sum(dim=-1)
        next_tokens = sample_from_scores(target_scores[rows, num_accepted], True, None)
        return num_accepted, next_tokens


class UnverifiedAcceptance(Acceptance):
    """Diagnostic, NOT exact: commit the sparse drafter's tokens without the acceptance test, what a plain sparse
    rollout samples (it shows that the exactness tests have power)."""

    drafts_only = True

    def accept(self, draft_tokens, draft_scores, target_scores, num_drafts, max_drafts):
        num_accepted = (num_drafts - 1).clamp(min=0)
        next_tokens = draft_tokens[torch.arange(draft_tokens.shape[0]), num_accepted]
        return num_accepted, next_tokens


def acceptance_for(mode: str, forced_rate: float | None, greedy: bool, generator: torch.Generator | None) -> Acceptance:
    """The engine mode's rule: `"unverified"` commits drafts, a forced rate replaces the test, else exact."""
    if mode == "unverified":
        return UnverifiedAcceptance()
    if forced_rate is not None:
        return ForcedAcceptance(forced_rate, generator)
    return ExactAcceptance(greedy, generator)
