"""The draft phase of a round: every sparse draft pass of every request as one device-side program.

Between two draft passes nothing needs the host. Each pass's positions and K/V destinations follow from the
round's committed lengths and block tables, its input tokens are the previous pass's drafts, and the drafts are
sampled on the device from noise drawn before the phase. So the whole phase is one function of a few device
tensors (`DraftInputs`): it runs eagerly as it is, and on CUDA with `S3RConfig.cuda_graphs` it is captured once
per batch bucket and replayed as a single graph per round (`DecodeGraphs.run_draft_phase`).

Requests that draft fewer tokens than the round's longest (`max_new_tokens` is near) still run every pass, but
their extra passes write K/V to the cache's scratch page and stay on positions their pages cover; the extra
drafts are ignored by the acceptance test, which reads only each request's own `num_drafts`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from s3r_hf.logits import RaggedLogitsProcessor
from s3r_hf.sampler import sample_with_noise
from s3r_hf.step_plan import SparseQueries, StepPlan

_serials = itertools.count()  # tells draft phases apart for the life of the process (an `id` may be reused)


@dataclass
class DraftInputs:
    """What the draft phase of one round reads (one row per request)."""

    pending: torch.Tensor  # [B] long: the last committed token; the first pass writes its K/V
    committed: torch.Tensor  # [B] long: valid K/V length before the round
    num_drafts: torch.Tensor  # [B] long: tokens the request drafts this round
    slots: torch.Tensor  # [B] long: cache slots (index views are per slot)
    block_tables: torch.Tensor  # [B, max_pages] int32, covering every position the round writes
    noise: torch.Tensor | None  # [draft_len, B, V] Exp(1) draws for sampling; None when decoding greedily


@dataclass
class DraftOutputs:
    tokens: torch.Tensor  # [B, draft_len] long
    scores: torch.Tensor  # [B, draft_len, V] float32 processed scores the drafts were sampled from


class DraftPhase:
    """Runs the `draft_len` sparse draft passes of a round.

    Args:
        forward: the model on `(input_ids [1, B], plan)`, returning logits `[B, V]`.
        processor: the call's logits processors; must be history-free (the drafted prefix is not on the host).
        draft_len: passes per round.
        page_size: tokens per KV page.
        scratch_row: flat pool row where writes that belong to no request go.
        greedy: draft the argmax instead of sampling.
        vocab_size: width of the logits.
    """

    def __init__(
        self,
        forward: Callable,
        processor: RaggedLogitsProcessor,
        draft_len: int,
        page_size: int,
        scratch_row: int,
        greedy: bool,
        vocab_size: int,
    ) -> None:
        if not processor.history_free:
            raise ValueError("the on-device draft phase needs logits processors that do not read the token history")
        self.forward = forward
        self.processor = processor
        self.draft_len = draft_len
        self.page_size = page_size
        self.scratch_row = scratch_row
        self.greedy = greedy
        self.vocab_size = vocab_size
        self.serial = next(_serials)

    @property
    def signature(self) -> tuple | None:
        """What a captured graph of this phase computes besides its inputs (the processors, greedy or sampled, the
        pass layout); None when the processors cannot be compared (`RaggedLogitsProcessor.signature`)."""
        processors = self.processor.signature
        if processors is None:
            return None
        return (processors, self.greedy, self.draft_len, self.page_size, self.scratch_row, self.vocab_size)

    def __call__(self, inputs: DraftInputs, view_width: int, passes: int | None = None) -> DraftOutputs:
        """Run `passes` (default `draft_len`) passes; `view_width` bounds the index views read (a host int, fixed
        for a captured graph)."""
        if not self.greedy and inputs.noise is None:
            # Sampled drafts must follow the scores the acceptance test divides by; an argmax would not.
            raise ValueError(
                "sampled drafting needs DraftInputs.noise (see DraftPhase.noise_buffer and sampler.draw_noise)"
            )
        rows = inputs.pending.shape[0]
        passes = self.draft_len if passes is None else passes
        tail_starts = inputs.committed.to(torch.int32)
        positions, write_index = self._pass_positions(inputs, passes)
        positions_int32 = positions.to(torch.int32)
        tokens = inputs.pending
        drafted, scores = [], []
        for step in range(passes):
            sparse = SparseQueries(
                query_index=None, slots=inputs.slots, block_tables=inputs.block_tables, tail_starts=tail_starts,
                positions=positions_int32[step], view_width=view_width, max_keys=view_width + step + 1,
            )
            plan = StepPlan(write_index=write_index[step], position_ids=positions[step][None], sparse=sparse)
            logits = self.forward(tokens[None], plan)
            step_scores = self.processor(list(range(rows)), [], logits)
            if self.greedy:
                tokens = step_scores.argmax(dim=-1)
            else:
                tokens = sample_with_noise(step_scores, inputs.noise[step])
            drafted.append(tokens)
            scores.append(step_scores)
        return DraftOutputs(tokens=torch.stack(drafted, dim=1), scores=torch.stack(scores, dim=1))

    def _pass_positions(self, inputs: DraftInputs, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(positions, write_index)`, each `[passes, B]` long: every pass's query positions and K/V pool rows,
        computed in one go rather than a dozen small kernels per pass.

        Passes past a request's own drafts repeat its last real position, whose pages are reserved, and write to
        the scratch row.
        """
        steps = torch.arange(passes, device=inputs.committed.device)[:, None]  # [P, 1]
        last_real = torch.clamp(inputs.num_drafts - 1, min=0)[None, :]  # [1, B]
        positions = inputs.committed[None, :] + torch.minimum(last_real, steps)  # [P, B]
        pages = inputs.block_tables.gather(1, (positions // self.page_size).T).T.long()  # [P, B]
        write_index = torch.where(
            steps < inputs.num_drafts[None, :],
            pages * self.page_size + positions % self.page_size,
            torch.full_like(positions, self.scratch_row),
        )
        return positions, write_index

    def noise_buffer(self, rows: int, device: torch.device) -> torch.Tensor | None:
        """An uninitialised `[draft_len, rows, V]` noise buffer, or None when drafting greedily."""
        return None if self.greedy else torch.empty(self.draft_len, rows, self.vocab_size, device=device)
