"""Apply transformers' logits processors to many requests whose histories have different lengths."""

from __future__ import annotations

from collections import defaultdict

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# Processors whose output depends only on the scores, never on the token history: one batched call covers
# all rows whatever their lengths.
_HISTORY_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


class RaggedLogitsProcessor:
    """Runs a `LogitsProcessorList` on rows whose token histories differ in length.

    Draft and verify scores of the same prefix go through this same object with the same history, which is
    what keeps the proposal `q` and the target `p` processed identically (Appendix A.3). Processors that read
    the history (repetition penalty, min-length, …) are called once per group of rows of equal length with the
    exact `input_ids` that `generate` would pass them.
    """

    def __init__(self, processors: LogitsProcessorList | None) -> None:
        self.processors = processors if processors is not None else LogitsProcessorList()
        self.history_free = all(isinstance(p, _HISTORY_FREE) for p in self.processors)

    def __call__(self, histories: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Processed float32 scores `[R, V]` for raw `logits` `[R, V]`; `histories[r]` is row `r`'s `input_ids`."""
        scores = logits.float()
        if len(self.processors) == 0 or scores.shape[0] == 0:
            return scores
        if self.history_free:
            placeholder = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
            return self.processors(placeholder, scores)
        groups: dict[int, list[int]] = defaultdict(list)
        for row, history in enumerate(histories):
            groups[history.shape[0]].append(row)
        out = torch.empty_like(scores)
        for rows in groups.values():
            input_ids = torch.stack([histories[r] for r in rows])
            index = torch.tensor(rows, device=scores.device)
            out[index] = self.processors(input_ids, scores[index])
        return out
