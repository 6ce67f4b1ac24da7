"""`MixedStep` (paper §B.2, MixedForward): a round of the decoding requests whose verify forward also runs the next
prompt chunks of newly admitted or restored requests, so new requests do not stall decoding
(`S3RConfig.mixed_steps`).

The drafts are the decoding requests' alone (sparse passes, as in any round); the prompt chunks are dense segments
after the verify blocks. Logits are kept for the verify rows and the last token of each prompt the step finishes;
those prompts get their first token and first index views as a prefill step would give them (`FirstTokens`).

Where the round is a dense step the round before already launched (`EarlyLaunches`: the dense regime, where the
adaptive rule does not draft), its forward is on the device, replayed from a CUDA graph: packing the prompt chunks
into a forward of the decoding rows would run those rows a second time, eagerly. The chunks then run in a forward of
their own in the same step, after the dense step.
"""

from __future__ import annotations

from s3r_hf.engine.first_tokens import FirstTokens
from s3r_hf.engine.model_runner import ModelRunner
from s3r_hf.engine.prompt_chunks import PromptChunks
from s3r_hf.engine.round import SpeculativeRound
from s3r_hf.engine.round_timing import RoundTimer
from s3r_hf.engine.scheduler import Scheduler
from s3r_hf.request import Request, RequestStatus


class MixedStep:
    """Runs mixed steps; `steps` counts those that prefilled prompt chunks (packed or beside a queued dense step:
    `S3RStats.mixed_steps_packed`, `mixed_steps_beside_queued`)."""

    def __init__(
        self,
        round: SpeculativeRound,
        runner: ModelRunner,
        scheduler: Scheduler,
        first_tokens: FirstTokens,
        timer: RoundTimer,
    ) -> None:
        self.round = round
        self.runner = runner
        self.scheduler = scheduler
        self.first_tokens = first_tokens
        self.timer = timer
        self.steps = 0

    def run(self, decoding: list[Request], prefilling: list[Request], donors: dict[bytes, Request]) -> None:
        """One round of `decoding` (pauses under KV pressure may shorten it), packed with the prompt chunks of
        `prefilling` that fit in the pages the round leaves free (none fit: a plain round); `donors`: prompts the
        new requests may copy (`PromptChunks.take`; one paused meanwhile is skipped)."""
        k = self.round.choose_draft_len(decoding)
        self.scheduler.make_room_for_round(decoding, self.round.draft_count)
        still_running = [r for r in prefilling if r.status is RequestStatus.RUNNING]
        prompts = self.runner.prompt_chunks(still_running, only_if_fits=True, donors=donors)
        if prompts is not None and self.round.runs_queued_dense_step(decoding, k):
            self._beside_queued_step(decoding, k, prompts)
            return
        # The step after a mixed step is planned afresh: no early launch is queued behind one.
        self.round.may_launch_early = prompts is None and not self.timer.stages
        verified = self.round.run(decoding, k, prompts)
        if prompts is None:
            return
        segments = [len(decoding) + chunk for chunk in prompts.finals]  # the prompts follow the verify blocks
        self.first_tokens.commit(verified.plan, segments, prompts.finished, verified.prompt_logits)
        self.runner.stats.mixed_steps_packed += 1
        self._prefilled()

    def _beside_queued_step(self, decoding: list[Request], k: int, prompts: PromptChunks) -> None:
        """The dense step launched early for `decoding`, then `prompts` in a forward of their own. The next step is
        launched early only if no prompt finishes here: one that does decodes from the next step on, and a step
        launched for the others alone would run again."""
        self.round.may_launch_early = not prompts.finished and not self.timer.stages
        self.round.run(decoding, k)
        self.first_tokens.commit(*self.runner.chunks_forward(prompts))
        self.runner.stats.mixed_steps_beside_queued += 1
        self._prefilled()

    def _prefilled(self) -> None:
        self.timer.interrupted()  # the interval around a mixed step is no round's cost
        self.steps += 1
