"""Apply transformers' logits processors to many requests whose histories have different lengths."""

from __future__ import annotations

import copy
import itertools
from collections import defaultdict

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from s3r_hf.model_session import outside_call

# Processors whose output depends only on the scores, never on the token history: one batched call covers
# all rows whatever their lengths. Matched by exact type: a subclass may read the history.
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
    the history (repetition penalty, min-length, n-gram bans, …) may also keep per-row state sized to the
    `generate` batch, so they are called with the whole batch in its row order, once per history length, with
    the exact `input_ids` rows that `generate` would pass them (rows not in the call are zero-filled and their
    outputs dropped). `prefix_allowed_tokens_fn` (`PrefixConstrainedLogitsProcessor`) is the exception: it hands each
    row's history to a user's function, which may reject a history it does not know (a constraint trie returning no
    token for a zero-filled row makes transformers raise), so it is called for each entry alone, with its
    prompt's index as the batch id, as in dense `generate`. Processors that keep state *across* calls are not supported.

    Args:
        processors: the list `generate` prepared.
        batch_size: rows of the `generate` batch (after `num_return_sequences` expansion).
    """

    def __init__(self, processors: LogitsProcessorList | None, batch_size: int) -> None:
        self.processors = processors if processors is not None else LogitsProcessorList()
        self.batch_size = batch_size
        self.history_free = all(type(p) in _HISTORY_FREE for p in self.processors)

    @property
    def signature(self) -> tuple | None:
        """What the processors compute, as a hashable value: each processor's class and settings, when every
        setting is a plain Python scalar; None otherwise (then equal signatures could not show equal behaviour).

        A CUDA graph of the draft phase bakes the processors' settings in; a later call replays it only when its
        processors have the same signature (`DecodeGraphs.run_draft_phase`)."""
        parts = []
        for processor in self.processors:
            settings = vars(processor)
            if not all(isinstance(value, (bool, int, float, str, type(None))) for value in settings.values()):
                return None
            parts.append((type(processor).__qualname__, tuple(sorted(settings.items()))))
        return tuple(parts)

    def __call__(self, rows: list[int], histories: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Processed float32 scores for raw `logits` `[E, V]`; entry `e` belongs to batch row `rows[e]` and
        `histories[e]` is the `input_ids` row its scores follow."""
        scores = logits.float()
        if len(self.processors) == 0 or scores.shape[0] == 0:
            return scores
        if self.history_free:
            placeholder = torch.zeros(scores.shape[0], 1, dtype=torch.long, device=scores.device)
            return self.processors(placeholder, scores)
        # Consecutive processors other than the prefix constraint run as one list, so each history length's batch
        # is built once for all of them. A user's processor may run the model (to score a candidate, say): as with
        # stopping criteria, it gets the model's own code, not this call's attention.
        with outside_call():
            for per_entry, run in itertools.groupby(self.processors, key=_per_entry):
                if per_entry:
                    for processor in run:
                        scores = _each_row_alone(processor, rows, histories, scores)
                else:
                    scores = self._by_history_length(LogitsProcessorList(run), rows, histories, scores)
        return scores

    def _by_history_length(
        self, processors: LogitsProcessorList, rows, histories, scores: torch.Tensor
    ) -> torch.Tensor:
        """`processors` over the whole batch once per history length; entries of other lengths zero-filled."""
        groups: dict[int, list[int]] = defaultdict(list)
        for entry, history in enumerate(histories):
            groups[history.shape[0]].append(entry)
        out = torch.empty_like(scores)
        for length, entries in groups.items():
            batch_rows = torch.tensor([rows[e] for e in entries], device=scores.device)
            input_ids = torch.zeros(self.batch_size, length, dtype=torch.long, device=scores.device)
            input_ids[batch_rows] = torch.stack([histories[e] for e in entries]).to(scores.device)
            batch_scores = torch.zeros(self.batch_size, scores.shape[1], device=scores.device)
            index = torch.tensor(entries, device=scores.device)
            batch_scores[batch_rows] = scores[index]
            out[index] = processors(input_ids, batch_scores)[batch_rows]
        return out


def _per_entry(processor: LogitsProcessor) -> bool:
    return isinstance(processor, PrefixConstrainedLogitsProcessor)


def _each_row_alone(processor: PrefixConstrainedLogitsProcessor, rows, histories, scores: torch.Tensor) -> torch.Tensor:
    """transformers' own `processor` on each entry as a batch of one, its function told the batch id dense `generate`
    gives that row: its prompt's index, `row // num_return_sequences` (transformers builds the processor with
    `num_beams=max(num_beams, num_return_sequences)`, and S3R runs no beams)."""
    out = torch.empty_like(scores)
    single = copy.copy(processor)
    single._num_beams = 1
    sequences_per_prompt = processor._num_beams
    for entry, (row, history) in enumerate(zip(rows, histories)):
        prompt = row // sequences_per_prompt
        single._prefix_allowed_tokens_fn = lambda _, sent, p=prompt: processor._prefix_allowed_tokens_fn(p, sent)
        out[entry] = single(history[None].to(scores.device), scores[entry : entry + 1])[0]
    return out
