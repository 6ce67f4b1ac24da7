"""`Committer`: appends generated tokens to requests on the host, and stops them where dense `generate` would."""

from __future__ import annotations

import torch

from s3r_hf.engine.sampling_setup import SamplingSetup
from s3r_hf.request import Request, RequestStatus
from s3r_hf.stopping import BatchStopping


class Committer:
    """Commits tokens one at a time (when scores or logits are read per token) or a round's block at once."""

    def __init__(self, sampling: SamplingSetup, return_logprobs: bool = False) -> None:
        self.sampling = sampling
        self.return_logprobs = return_logprobs

    @property
    def per_token(self) -> bool:
        """Whether an output reads every token's scores or logits (then blocks are committed token by token)."""
        return self.sampling.output_scores or self.sampling.output_logits

    def logprobs(self, scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """Log-probabilities of `tokens` under `softmax(scores)` (any leading shape), on the device; None when the
        call does not return them."""
        if not self.return_logprobs:
            return None
        log_probs = torch.log_softmax(scores.float(), dim=-1)
        return log_probs.gather(-1, tokens.to(scores.device)[..., None]).squeeze(-1)

    def commit(
        self,
        request: Request,
        token: int,
        scores: torch.Tensor,
        scores_row: int,
        logits: torch.Tensor,
        logits_row: int,
        logprob: float | None,
    ) -> bool:
        """Append one generated token; returns True when the request stops on it (EOS or `max_new_tokens`; the
        stopping criteria see the whole batch after the commit, `stopping_step`).

        The token's processed scores are `scores[scores_row]` and its raw logits `logits[logits_row]`; they are
        indexed only when an output reads them, since a tensor index per committed token is host time the round
        otherwise does not spend.
        """
        request.append(token)
        request.pending = token
        if self.sampling.output_scores:
            request.scores.append(scores[scores_row].detach().clone())
        if self.sampling.output_logits:
            request.raw_logits.append(logits[logits_row].detach().clone())
        if logprob is not None:
            request.logprobs.append(logprob)
        stop = self.reached_end(request, token)
        if stop:
            request.status = RequestStatus.FINISHED
        return stop

    def commit_block(self, request: Request, proposals: list[int], logprobs: list[float] | None) -> int:
        """Append a round's block of tokens at once, stopping where `commit` token by token would: after the first
        EOS, or at `max_new_tokens`. Only for rounds without per-token consumers (scores, logits). Returns how many
        tokens were committed."""
        eos_token_ids = self.sampling.eos_token_ids
        block = proposals
        if len(block) > 1:  # a dense step's one token is never cut: neither rule drops a block's first token
            block = block[: max(1, request.remaining)]  # `commit` appends a token before it checks the limit
            if not eos_token_ids.isdisjoint(block):
                first_eos = next(offset for offset, token in enumerate(block) if token in eos_token_ids)
                block = block[: first_eos + 1]  # the EOS token itself is committed
        request.extend(block)
        request.pending = block[-1]
        if logprobs is not None:
            request.logprobs.extend(logprobs[: len(block)])
        if self.reached_end(request, block[-1]):
            request.status = RequestStatus.FINISHED
        return len(block)

    def commit_round(
        self,
        requests: list[Request],
        proposals: list[list[int]],
        logprobs: list[list[float]] | None,
        target_scores: torch.Tensor,
        logits: torch.Tensor,
        block_starts: list[int],
    ) -> list[int]:
        """Commit each request's accepted drafts and correction or bonus token (`proposals`); returns how many
        tokens each committed. Scores and logits are read token by token; without them a row's block is committed
        in one go, which at B=64 saves a few hundred Python calls per round while the device waits."""
        committed_counts = []
        for row, request in enumerate(requests):
            row_logprobs = logprobs[row] if logprobs is not None else None
            if self.per_token:
                count = 0
                row_scores = target_scores[row]
                for offset, token in enumerate(proposals[row]):
                    count += 1
                    logprob = row_logprobs[offset] if row_logprobs is not None else None
                    if self.commit(request, token, row_scores, offset, logits, block_starts[row] + offset, logprob):
                        break
            else:
                count = self.commit_block(request, proposals[row], row_logprobs)
            committed_counts.append(count)
        self.stopping_step()
        return committed_counts

    def reached_end(self, request: Request, last_token: int) -> bool:
        """The stop rule both commit paths share: EOS was committed, or `max_new_tokens` is used up."""
        return last_token in self.sampling.eos_token_ids or request.remaining <= 0

    def stopping_step(self) -> None:
        """After a commit: the stopping criteria and the streamer get every step all unfinished rows have reached,
        with the whole batch, as dense `generate` calls them (`BatchStopping`; it may cut rows back and end them)."""
        if isinstance(self.sampling.stopping_criteria, BatchStopping):
            self.sampling.stopping_criteria.advance()
