"""Stopping criteria and a streamer, called as dense `generate` calls them: once per generated token, whole batch.

Dense `generate` decodes every row in lockstep. After step `t` each row holds `t` new tokens (a row that finished
holds the pad token from then on); the loop calls the stopping criteria once with `input_ids` `[B, prompt + t]`,
clears the unfinished flag of each row whose answer is True, and hands the step's tokens `[B]` to the streamer.

S3R's rows advance by blocks, each at its own pace, so `BatchStopping` replays those steps: step `t` goes to the
criteria and the streamer as soon as every unfinished row has committed `t` tokens. A row that had run ahead of a
step that stops it is cut back to that step (`Request.truncate`). Criteria that answer per row, count their calls or
read the whole batch therefore see exactly the calls dense `generate` makes, and the output is the one it returns.
EOS and `max_new_tokens` are not criteria here: the engine stops rows on them itself, as it commits.

Without an EOS criterion dense `generate` pads no row: a row a criterion stopped goes on sampling real tokens until
every row has stopped, and all rows end at that step. `pads_stopped_rows=False` replays that.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StoppingCriteriaList

from s3r_hf.model_session import outside_call
from s3r_hf.request import Request, RequestStatus


class BatchStopping:
    """The custom stopping criteria and the streamer of one `generate` call, fed step by step.

    Args:
        criteria: criteria other than max length and EOS.
        requests: every row of the call, in row order (`requests[i].row == i`).
        input_ids: the call's left-padded prompt rows `[B, P]`; criteria get `input_ids` on its device.
        pad_token_id: what a finished row holds in later steps.
        streamer: gets the prompt from transformers, then each step's tokens `[B]` from here, then `end()`.
        scores: pass the criteria dense's `scores` argument (the tuple of every step's processed scores `[B, V]`,
            which dense builds only with `return_dict_in_generate=True, output_scores=True`); otherwise `None`, as
            dense passes. Rows without a token at a step hold zeros there.
        pads_stopped_rows: whether a row ends at the step a criterion stops it (dense with an EOS criterion), or
            samples on until every row has stopped (dense without one).
    """

    def __init__(
        self,
        criteria: StoppingCriteriaList,
        requests: list[Request],
        input_ids: torch.Tensor,
        pad_token_id: int,
        streamer: Any = None,
        scores: bool = False,
        pads_stopped_rows: bool = True,
    ) -> None:
        self.criteria = criteria
        self.requests = requests
        self.pad_token_id = pad_token_id
        self.streamer = streamer
        self.scores: tuple[torch.Tensor, ...] | None = () if scores else None
        self.prompt_width = input_ids.shape[1]
        self.step = 0  # steps already handed over
        self.stopped_at: dict[int, int] = {}  # row -> the step at which a criterion stopped it
        self.pads_stopped_rows = pads_stopped_rows
        self.flagged: set[int] = set()  # without padding: rows a criterion stopped, sampling on until all are
        self.input_ids: torch.Tensor | None = None
        if len(criteria) > 0:
            longest = max((r.max_new_tokens for r in requests), default=0)
            self.input_ids = torch.full(
                (len(requests), self.prompt_width + max(longest, 0)), pad_token_id, dtype=torch.long,
                device=input_ids.device,
            )
            self.input_ids[:, : self.prompt_width] = input_ids

    @property
    def active(self) -> bool:
        return len(self.criteria) > 0 or self.streamer is not None

    def advance(self) -> None:
        """Hand over every step that all unfinished rows have reached; stop the rows the criteria stop."""
        if not self.active:
            return
        self._enforce_stops()
        while self.step < self._reached():
            self.step += 1
            self._run_step(self.step)

    def end(self) -> None:
        """After the call (also when it failed, so that a consumer of the streamer does not wait forever)."""
        if self.streamer is not None:
            self.streamer.end()

    def _ended(self, request: Request) -> bool:
        return request.status is RequestStatus.FINISHED or request.row in self.stopped_at

    def _reached(self) -> int:
        """The last step every unfinished row has reached; once all rows ended, the longest row's last step."""
        unfinished = [len(r.generated) for r in self.requests if not self._ended(r)]
        if unfinished:
            return min(unfinished)
        return max((len(r.generated) for r in self.requests), default=0)

    def _run_step(self, step: int) -> None:
        live = [len(r.generated) >= step for r in self.requests]  # rows with a token at this step
        tokens = [r.generated[step - 1] if has else self.pad_token_id for r, has in zip(self.requests, live)]
        stops = [False] * len(self.requests)
        if len(self.criteria) > 0:
            column = self.prompt_width + step - 1
            self.input_ids[:, column] = torch.tensor(tokens, device=self.input_ids.device)
            if self.scores is not None:
                self.scores += (self._step_scores(step, live),)
            # A copy, as dense hands each step a new tensor: a criterion may keep it.
            with outside_call():
                stops = self.criteria(self.input_ids[:, : column + 1].clone(), self.scores).tolist()
        if self.streamer is not None:
            with outside_call():
                self.streamer.put(torch.tensor(tokens))
        for request, has, stop in zip(self.requests, live, stops):
            if has and stop and request.row not in self.stopped_at:
                if self.pads_stopped_rows:
                    self._stop(request, step)
                else:
                    self.flagged.add(request.row)
        if self.flagged and len(self.flagged) == len(self.requests):
            for request in self.requests:
                self._stop(request, step)

    def _step_scores(self, step: int, live: list[bool]) -> torch.Tensor:
        rows = [r.scores[step - 1] if has else None for r, has in zip(self.requests, live)]
        reference = next(row for row in rows if row is not None)
        return torch.stack([row if row is not None else torch.zeros_like(reference) for row in rows])

    def _stop(self, request: Request, step: int) -> None:
        self.stopped_at[request.row] = step
        request.truncate(step)
        # No tokens left to generate. A row paused under KV pressure keeps its status (the engine restores paused
        # rows); once restored it commits one more token and ends, and `_enforce_stops` cuts that token.
        request.max_new_tokens = step
        if request.status is RequestStatus.RUNNING:
            request.status = RequestStatus.FINISHED

    def _enforce_stops(self) -> None:
        for row, step in self.stopped_at.items():
            request = self.requests[row]
            request.truncate(step)
            if request.status is RequestStatus.RUNNING:
                request.status = RequestStatus.FINISHED
