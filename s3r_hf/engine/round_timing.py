"""`RoundTimer`: the engine's wall-clock bookkeeping. Prefill and decode totals, per-stage totals with
`timing="stages"`, and each round's cost for the draft-length policy."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from s3r_hf.draft_policy import DraftLengthPolicy, RoundShape
from s3r_hf.request import Request
from s3r_hf.stats import S3RStats


def round_shape(requests: list[Request]) -> RoundShape:
    return RoundShape(rows=len(requests), context=sum(r.committed for r in requests) // max(len(requests), 1))


class RoundTimer:
    """`timing`: False, True (synchronize around prefill and decoding) or `"stages"` (also every stage of a round).
    `capture_seconds` reads the CUDA-graph capture time so far; captures are no round's cost."""

    def __init__(
        self, timing: bool | str, device: torch.device, stats: S3RStats, capture_seconds: Callable[[], float]
    ) -> None:
        self.timing = timing
        self.device = device
        self.stats = stats
        self.capture_seconds = capture_seconds
        # (shape, k, start, capture seconds, whether the round before had the same k, whether it refreshes the
        # views, whether the round before did)
        self._timed_round: tuple[RoundShape, int, float, float, bool, bool, bool] | None = None
        self._previous_k: int | None = None  # the draft length of the previous round (a refresh step counts as 0)
        self._previous_refreshed = False
        self._captured_before_stage = 0.0  # capture seconds already counted when the current stage began
        self._step_began: tuple[int, float] | None = None  # (rows, start) of the step running now

    @property
    def stages(self) -> bool:
        """Every stage of a round is timed apart (so nothing is launched early)."""
        return self.timing == "stages"

    def clock(self) -> float:
        if self.timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def end_phase(self, phase: str | None, started: float) -> float:
        """Add the time since `started` to the `phase` ("prefill" or "decode") totals; returns the time now."""
        now = self.clock()
        if phase == "prefill":
            self.stats.prefill_seconds += now - started
        elif phase == "decode":
            self.stats.decode_seconds += now - started
        return now

    # ---------------------------------------------------------------- round costs for the draft-length policy
    def cost_previous_round(self, policy: DraftLengthPolicy) -> None:
        """Report the time since the previous round began as its cost. Neither an interval with a CUDA-graph capture
        in it nor the first round after a switch of `k` (it ran launches the round before would have overlapped) is
        what a run of such rounds costs, so those are dropped. The cost goes with whether the round refreshed the
        views and whether the round before it did (its view update ran in this interval)."""
        now = time.perf_counter()
        if self._timed_round is not None:
            shape, k, started, captured, steady, refreshes, follows_refresh = self._timed_round
            if steady and captured == self.capture_seconds():
                policy.observe_cost(shape, k, now - started, refreshes, follows_refresh)
        self._timed_round = None

    def round_started(self, requests: list[Request], k: int, refresh_step: bool, refreshes: bool) -> float:
        """A round of draft length `k` begins (a refresh step is costed as no round), refreshing the index views or
        not; returns the start of its first stage."""
        steady = self._previous_k == k
        follows_refresh, self._previous_k, self._previous_refreshed = self._previous_refreshed, k, refreshes
        now = self.step_ended()
        self._step_began = (len(requests), now)
        self._timed_round = None if refresh_step else (
            round_shape(requests), k, now, self.capture_seconds(), steady, refreshes, follows_refresh
        )
        if not self.stages:
            return 0.0
        self._captured_before_stage = self.capture_seconds()
        return self.clock()

    def step_ended(self) -> float:
        """The decode step running now (if any) is over: its wall time goes to the stats under its number of rows.
        Returns the time now."""
        now = time.perf_counter()
        if self._step_began is not None:
            rows, began = self._step_began
            self.stats.record_step_interval(rows, now - began)
            self._step_began = None
        return now

    def interrupted(self) -> None:
        """A prefill step or a mixed step ran: the interval around it is no round's cost, and the next round follows
        no round."""
        self._timed_round = None
        self._previous_k = None
        self._previous_refreshed = False
        self._step_began = None

    # ---------------------------------------------------------------- stages
    def stage_done(self, stage: str, started: float) -> float:
        """With `timing="stages"`, add the time since `started` to `stage`, CUDA-graph captures left out (they are
        reported apart); returns the new start."""
        if not self.stages:
            return started
        now = self.clock()
        captured = self.capture_seconds()
        elapsed = now - started - (captured - self._captured_before_stage)
        self._captured_before_stage = captured
        self.stats.stage_seconds[stage] = self.stats.stage_seconds.get(stage, 0.0) + elapsed
        return now
