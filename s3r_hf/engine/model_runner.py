"""`ModelRunner`: builds the `StepPlan` of each kind of forward (prefill chunks, draft passes, verify blocks) and runs
it, eagerly or as a CUDA-graph replay."""

from __future__ import annotations

from typing import NamedTuple

import torch

from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.cuda_graphs import DecodeGraphs
from s3r_hf.draft_phase import DraftInputs, DraftOutputs, DraftPhase
from s3r_hf.engine.prompt_chunks import PromptChunks
from s3r_hf.engine.sampling_setup import SamplingSetup
from s3r_hf.matmul_precision import float32_matmul_precision
from s3r_hf.model_forward import ModelForward
from s3r_hf.request import Request
from s3r_hf.sampler import draw_noise, sample_from_scores
from s3r_hf.staging import to_device, to_device_packed
from s3r_hf.stats import S3RStats
from s3r_hf.step_plan import DenseSegments, SparseQueries, StepPlan

SDPA_PREFILL_QUERIES = 1024
"""Prefill chunks at least this long run their attention through torch's fused SDPA kernels, one call each: on an
H200 several times the paged kernel's rate at long prompts (docs/benchmarks.md). The shorter chunks of the same step
stay with the paged kernel, which serves them all in one launch."""


def query_subset(
    spans: list[tuple[int, int, int]], picks: list[tuple[int, int]]
) -> tuple[list[int], list[int], list[int]]:
    """Some queries of a prefill step as segments of their own, one per chunk: `picks[i] = (first, count)` takes
    queries `first .. first + count` of chunk `i` (`count` 0: none). Returns their packed rows, query offsets and
    positions. `spans`: `(first packed row, first position, end position)` of each chunk."""
    rows, cu, positions = [], [0], []
    for (row, start, _), (first, count) in zip(spans, picks):
        rows.extend(range(row + first, row + first + count))
        positions.extend(range(start + first, start + first + count))
        cu.append(cu[-1] + count)
    return rows, cu, positions


def prefill_parts(
    spans: list[tuple[int, int, int]], score_starts: list[int], min_queries: int
) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """How a prefill step with a chunk of `min_queries` or more is split: `(chunk, first packed row, first position,
    end position)` of each chunk that long (torch's SDPA), the picks (`query_subset`) of the shorter chunks (the
    paged kernel) and of every chunk's scored queries (the paged kernel, for their scores)."""
    long = [(chunk, *span) for chunk, span in enumerate(spans) if span[2] - span[1] >= min_queries]
    long_chunks = {chunk for chunk, *_ in long}
    short = [(0, 0) if chunk in long_chunks else (0, end - start) for chunk, (_, start, end) in enumerate(spans)]
    scored = [(first, end - start - first) if first >= 0 else (0, 0) for (_, start, end), first in
              zip(spans, score_starts)]
    return long, short, scored


class Verified(NamedTuple):
    """A verify forward's plan, logits `[N, V]`, block starts (`N` offsets per request, then the end) and
    processed target scores `[R, k + 1, V]`. In a mixed step, `prompt_logits` are the logits of the last tokens of
    the prompts the step's chunks finished; their segments follow the `R` verify blocks in the plan."""

    plan: StepPlan
    logits: torch.Tensor
    block_starts: list[int]
    target_scores: torch.Tensor
    prompt_logits: torch.Tensor | None = None


class ModelRunner:
    """The engine's forwards. `graphs` is set by the engine when `S3RConfig.cuda_graphs` is on (on CUDA)."""

    def __init__(
        self,
        model_forward: ModelForward,
        cache: S3RCache,
        config: S3RConfig,
        sampling: SamplingSetup,
        stats: S3RStats,
        draft_phase: DraftPhase | None,
        scores_verify: bool,
        vocab_size: int,
    ) -> None:
        # Held by the draft phase and the graphs too; it does not point back at the engine (see model_forward.py).
        self.model_forward = model_forward
        self.cache = cache
        self.config = config
        self.sampling = sampling
        self.stats = stats
        self.draft_phase = draft_phase
        # Engine AR never drafts, so neither its prompts nor its verify record scores for index views.
        self.scores_verify = scores_verify
        self.vocab_size = vocab_size
        self.device = cache.device
        self.graphs: DecodeGraphs | None = None
        # Draft passes may run their float32 matmuls in TF32 (`S3RConfig.draft_matmul_precision`); the flag is left
        # alone for other dtypes, where toggling it would only make torch.compile build the layers again.
        float32_cuda = cache.dtype == torch.float32 and cache.device.type == "cuda"
        self.draft_precision = config.draft_matmul_precision if float32_cuda else "highest"

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        plan: StepPlan,
        keep: torch.Tensor | None = None,
        bucket_floor: int = 0,
        precision: str = "highest",
    ) -> torch.Tensor:
        """One packed forward of `input_ids` `[N]`; float logits of the kept rows (all rows when `keep` is None).

        Decode steps replay a CUDA graph when `S3RConfig.cuda_graphs` is on (`bucket_floor`: see `DecodeGraphs`).
        `precision`: of its float32 matmuls (`float32_matmul_precision`), set while it runs eagerly or is captured.
        """
        input_ids = input_ids.to(self.device)
        if self.graphs is not None and keep is None and self.graphs.supports(plan, input_ids.shape[0]):
            return self.graphs.run(input_ids, plan, bucket_floor=bucket_floor, precision=precision)
        with float32_matmul_precision(precision):
            return self.model_forward(input_ids[None], plan, keep).float()

    def capture_seconds(self) -> float:
        return self.graphs.capture_seconds if self.graphs is not None else 0.0

    def tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(values, self.device)

    def int32(self, values: list[int]) -> torch.Tensor:
        """Kernel metadata in the kernels' own index type, so no per-layer conversion is launched."""
        return to_device(values, self.device, torch.int32)

    # ---------------------------------------------------------------- prefill
    def prefill_forward(self, requests: list[Request], donors: dict[bytes, Request] | None = None):
        """One packed forward over the next prompt chunks of `requests` (`donors`: see `PromptChunks.take`).

        Returns the plan, the segment index and request of every prompt finished by this step, and the logits
        of those prompts' last tokens.
        """
        return self.chunks_forward(self.prompt_chunks(requests, donors=donors))

    def chunks_forward(self, chunks: PromptChunks):
        """One forward over `chunks` alone (their pages reserved); returns what `prefill_forward` returns."""
        dense = DenseSegments(
            query_index=None,
            cu_seqlens=self.int32(chunks.cu_seqlens),
            positions=self.int32(chunks.positions),
            block_tables=self.cache.block_tables(chunks.slots),
            score_starts=self.int32(chunks.score_starts) if chunks.scored else None,
            history_lens=self.tensor(chunks.history_lens),
            num_candidates=chunks.num_candidates,
            max_query_len=chunks.max_query_len,
            max_context=chunks.max_context,
            max_scored_queries=chunks.max_scored_queries,
        )
        # The scored queries of chunks longer than them are scored in a launch of their own, and the launch over
        # every query stores no logits: a prefill tiling of the paged kernel then builds one variant whether a step
        # scores its prompts or not (prompts of a whole view are not scored, `S3RConfig.whole_view`), instead of
        # building the other in whichever later call, a GRPO step, first sees the other kind (about a second).
        if chunks.max_query_len >= SDPA_PREFILL_QUERIES or (
            chunks.scored and chunks.max_query_len > chunks.max_scored_queries
        ):
            spans = [(row, c.start, c.end) for row, c in zip(chunks.cu_seqlens, chunks.chunks)]
            dense.prefill_spans, short, scored = prefill_parts(spans, chunks.score_starts, SDPA_PREFILL_QUERIES)
            dense.paged = self._query_subset(dense, spans, short, scored=False)
            dense.scored = self._query_subset(dense, spans, scored, scored=True)
        plan = StepPlan(write_index=self.tensor(chunks.write), position_ids=dense.positions.long()[None], dense=dense)
        logits = self.forward(chunks.tokens, plan, keep=self.tensor(chunks.last_rows))
        chunks.done(self.cache)
        self.stats.prefill_tokens += chunks.num_tokens
        self.stats.shared_prompt_tokens += chunks.shared_tokens
        return plan, chunks.finals, chunks.finished, logits

    def _query_subset(
        self, dense: DenseSegments, spans: list[tuple[int, int, int]], picks: list[tuple[int, int]], scored: bool
    ) -> DenseSegments | None:
        """The picked queries (`query_subset`) as segments for the paged kernel, every one scored if `scored`; None
        if none is picked."""
        rows, cu, positions = query_subset(spans, picks)
        if not rows:
            return None
        counts = [count for _, count in picks]
        return DenseSegments(
            query_index=self.tensor(rows), cu_seqlens=self.int32(cu), positions=self.int32(positions),
            block_tables=dense.block_tables,
            score_starts=self.int32([0 if count else -1 for count in counts]) if scored else None,
            history_lens=dense.history_lens, num_candidates=dense.num_candidates, max_query_len=max(counts),
            max_context=dense.max_context, max_scored_queries=dense.max_scored_queries if scored else 0,
        )

    def prompt_chunks(
        self, requests: list[Request], only_if_fits: bool = False, donors: dict[bytes, Request] | None = None
    ) -> PromptChunks | None:
        """The next prompt chunks of `requests` (`S3RConfig.prefill_chunk_size` tokens at most), their pages
        reserved. A prefill step must fit (`S3RCache.reserve` raises otherwise); a mixed step (`only_if_fits`) takes
        the chunks that fit in the pages its round left free, possibly none."""
        def reserve(request: Request, end: int) -> bool:
            if only_if_fits:
                return self.cache.reserve_if_fits([request.slot], [end])
            self.cache.reserve(request.slot, end)
            return True

        return PromptChunks.take(requests, self.cache, self.config, reserve, donors, scores=self.scores_verify)

    # ---------------------------------------------------------------- drafts
    def draft(
        self, requests: list[Request], draft_counts: list[int], tables: torch.Tensor, round_k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens `[R, k]` and their scores `[R, k, V]` of a round of draft length `round_k`: the on-device
        draft phase, or one host-driven pass per position when a logits processor reads the token history."""
        max_drafts = max(draft_counts, default=0)
        if max_drafts > 0 and self.draft_phase is not None:
            pending, committed, counts = self.tensor(
                [[r.pending for r in requests], [r.committed for r in requests], draft_counts]
            ).unbind(0)
            view_width = max(r.view_len for r in requests)
            drafts = self.run_draft_phase(requests, pending, committed, counts, tables, view_width, max_drafts, round_k)
            return drafts.tokens, drafts.scores
        draft_tokens = torch.zeros(len(requests), max(max_drafts, 1), dtype=torch.long, device=self.device)
        draft_scores = torch.zeros(len(requests), max(max_drafts, 1), self.vocab_size, device=self.device)
        for step in range(max_drafts):
            rows = [i for i, k in enumerate(draft_counts) if k > step]
            self.draft_pass(step, [requests[i] for i in rows], rows, draft_tokens, draft_scores,
                            tables if len(rows) == len(requests) else tables[self.tensor(rows)], len(requests))
        return draft_tokens, draft_scores

    def run_draft_phase(
        self,
        requests: list[Request],
        pending: torch.Tensor,
        committed: torch.Tensor,
        counts: torch.Tensor,
        tables: torch.Tensor,
        view_width: int,
        passes: int,
        round_k: int,
    ) -> DraftOutputs:
        """Every draft pass of the round on the device, from device tensors of its pending tokens, committed
        lengths and draft counts: one graph replay (the round's draft length `round_k` passes, so the last rounds
        of a request replay the graph of the others), or the same program run eagerly (`passes` passes over index
        views at most `view_width` long)."""
        slots = self.tensor([r.slot for r in requests])
        inputs = DraftInputs(pending, committed, counts, slots, tables, noise=None)
        if self.graphs is not None and self.graphs.supports_draft_phase(len(requests)):
            return self.graphs.run_draft_phase(
                self.draft_phase, inputs, self.sampling.draft_noise_generator, passes=round_k,
                precision=self.draft_precision,
            )
        noise = self.draft_phase.noise_buffer(len(requests), self.device)
        inputs.noise = None if noise is None else draw_noise(noise, self.sampling.draft_noise_generator)
        with float32_matmul_precision(self.draft_precision):
            return self.draft_phase(inputs, view_width, passes=passes)

    def draft_pass(
        self,
        step: int,
        requests: list[Request],
        rows: list[int],
        draft_tokens: torch.Tensor,
        draft_scores: torch.Tensor,
        block_tables: torch.Tensor | None = None,
        round_size: int = 0,
    ) -> None:
        """Draft token `step + 1` for each request with sparse attention over its index view.

        `block_tables` (rows of `requests`) may come from the round; `round_size` keeps late passes, which have
        fewer requests, in the round's CUDA-graph bucket instead of capturing smaller ones.
        """
        write, positions = [], []
        for request in requests:
            position = request.committed + step
            write += self.cache.flat_indices(request.slot, [position])
            positions.append(position)
        index = self.tensor(rows)
        if block_tables is None:
            block_tables = self.cache.block_tables([r.slot for r in requests])
        # Input tokens stay on the device: the pending token, then the previous pass's drafts.
        tokens = self.tensor([r.pending for r in requests]) if step == 0 else draft_tokens[index, step - 1]
        sparse = SparseQueries(
            query_index=None,
            slots=self.tensor([r.slot for r in requests]),
            block_tables=block_tables,
            tail_starts=self.int32([r.committed for r in requests]),
            positions=self.int32(positions),
            view_width=max(r.view_len for r in requests),
            max_keys=max(r.view_len for r in requests) + step + 1,
        )
        plan = StepPlan(write_index=self.tensor(write), position_ids=sparse.positions.long()[None], sparse=sparse)
        logits = self.forward(tokens, plan, bucket_floor=round_size, precision=self.draft_precision)
        history_free = self.sampling.logits_processor.history_free
        histories = [] if history_free else [r.tokens[: r.length + step] for r in requests]
        scores = self.sampling.logits_processor([r.row for r in requests], histories, logits)
        drafts = sample_from_scores(scores, self.sampling.greedy, self.sampling.draft_noise_generator)
        draft_tokens[index, step] = drafts
        draft_scores[index, step] = scores
        if not history_free:
            # Provisional: logits processors of later positions must see the drafted prefix.
            for request, token in zip(requests, drafts.tolist()):
                request.tokens[request.length + step] = token

    # ---------------------------------------------------------------- verify
    def verify(
        self,
        requests: list[Request],
        draft_counts: list[int],
        draft_tokens: torch.Tensor,
        tables: torch.Tensor,
        round_k: int,
        committed: list[int] | None = None,
        pending: torch.Tensor | None = None,
        scored: bool = True,
        prompts: PromptChunks | None = None,
    ) -> Verified:
        """Dense forward over `[pending, d_1..d_k]` of every request; overwrites the drafts' provisional K/V.

        `committed` lengths and `pending` tokens (a device tensor) default to the requests' own. With `scored`
        (and outside engine AR) each layer also leaves the attention scores an index-view refresh selects from.
        `prompts`: a mixed step; the prompt chunks follow the verify blocks in the same forward (run eagerly).
        """
        scored = scored and self.scores_verify
        committed = committed if committed is not None else [r.committed for r in requests]
        pending = pending if pending is not None else self.tensor([r.pending for r in requests])
        dense_step = not any(draft_counts)  # one query per request, its pending token
        if dense_step:  # every step of dense decoding: its host work is what a step costs on a small model
            write = self.cache.flat_rows([r.slot for r in requests], committed)
            positions, cu = committed, list(range(len(requests) + 1))
        else:
            write, positions, cu, block_rows, block_offsets = [], [], [0], [], []
            for row, (request, context, count) in enumerate(zip(requests, committed, draft_counts)):
                write += self.cache.flat_indices(request.slot, range(context, context + count + 1))
                positions += range(context, context + count + 1)
                cu.append(cu[-1] + count + 1)
                block_rows += [row] * (count + 1)
                block_offsets += range(count + 1)
        # The step's metadata in one host-to-device copy per index type (a dense step's host work is what it costs
        # on a small model).
        gathers = [] if dense_step else [block_rows, block_offsets]
        write_index, history_lens, *gathers = to_device_packed([write, committed, *gathers], self.device)
        cu_seqlens, positions_32, *starts = to_device_packed(
            [cu, positions, *([[0] * len(requests)] if scored else [])], self.device, torch.int32
        )
        # `[pending, d_1..d_k]` of every request, gathered on the device.
        tokens = pending if dense_step else torch.cat([pending[:, None], draft_tokens], dim=1)[gathers[0], gathers[1]]
        num_candidates = max(self.config.budget(c + k + 1) for c, k in zip(committed, draft_counts)) if scored else 0
        dense = DenseSegments(
            query_index=None,
            cu_seqlens=cu_seqlens,
            positions=positions_32,
            block_tables=tables,
            score_starts=starts[0] if scored else None,
            history_lens=history_lens,
            num_candidates=num_candidates,
            # The round's length, not its longest block: rounds whose requests all draft fewer (`max_new_tokens` is
            # near) replay the round's CUDA graph instead of capturing one per shorter width.
            max_query_len=max(max(draft_counts), round_k) + 1,
            max_context=max(c + k + 1 for c, k in zip(committed, draft_counts)),
            max_scored_queries=max(draft_counts) + 1 if scored else 0,
        )
        plan = StepPlan(write_index=write_index, position_ids=dense.positions.long()[None], dense=dense)
        if prompts is None:
            logits, prompt_logits = self.forward(tokens, plan), None
        else:  # logits of the verify rows, then of the finished prompts' last tokens
            verify_rows = len(write)
            plan, tokens, keep = self._append_prompts(plan, tokens, [r.slot for r in requests], prompts)
            logits = self.forward(tokens, plan, keep=keep)
            logits, prompt_logits = logits[:verify_rows], logits[verify_rows:]
            prompts.done(self.cache)
            self.stats.prefill_tokens += prompts.num_tokens
            self.stats.shared_prompt_tokens += prompts.shared_tokens
        rows, histories = [], []
        if not self.sampling.logits_processor.history_free:
            histories = [
                r.tokens[: r.length + offset] for r, count in zip(requests, draft_counts) for offset in range(count + 1)
            ]
            rows = [r.row for r, count in zip(requests, draft_counts) for _ in range(count + 1)]
        flat_scores = self.sampling.logits_processor(rows, histories, logits)
        width = max(draft_counts) + 1
        if cu[-1] == width * len(requests):  # every block is full: the rows are already in place
            return Verified(plan, logits, cu, flat_scores.reshape(len(requests), width, -1), prompt_logits)
        target_scores = torch.zeros(len(requests), width, flat_scores.shape[-1], device=self.device)
        target_scores[gathers[0], gathers[1]] = flat_scores  # some blocks are shorter: not a dense step
        return Verified(plan, logits, cu, target_scores, prompt_logits)

    def _append_prompts(
        self, plan: StepPlan, tokens: torch.Tensor, slots: list[int], prompts: PromptChunks
    ) -> tuple[StepPlan, torch.Tensor, torch.Tensor]:
        """A mixed step's plan: the verify plan's segments (`slots`), then the prompt chunks as further dense
        segments. Verify blocks stay scored or unscored as they were (-1 when unscored); a finished prompt's last
        `draft_len + 1` queries are scored. Returns the plan, the tokens and the rows whose logits are kept (every
        verify row, then each finished prompt's last token)."""
        verify, rows = plan.dense, len(tokens)
        score_starts = verify.score_starts
        if score_starts is None:
            score_starts = self.int32([-1] * len(slots))
        dense = DenseSegments(
            query_index=None,
            cu_seqlens=torch.cat([verify.cu_seqlens, verify.cu_seqlens[-1] + self.int32(prompts.cu_seqlens[1:])]),
            positions=torch.cat([verify.positions, self.int32(prompts.positions)]),
            block_tables=self.cache.block_tables(slots + prompts.slots),
            score_starts=torch.cat([score_starts, self.int32(prompts.score_starts)]),
            history_lens=torch.cat([verify.history_lens, self.tensor(prompts.history_lens)]),
            num_candidates=max(verify.num_candidates, prompts.num_candidates),
            max_query_len=max(verify.max_query_len, prompts.max_query_len),
            max_context=max(verify.max_context, prompts.max_context),
            max_scored_queries=max(verify.max_scored_queries, prompts.max_scored_queries),
        )
        write = torch.cat([plan.write_index, self.tensor(prompts.write)])
        mixed = StepPlan(write_index=write, position_ids=dense.positions.long()[None], dense=dense)
        keep = self.tensor(list(range(rows)) + [rows + row for row in prompts.last_rows])
        return mixed, torch.cat([tokens, prompts.tokens.to(self.device)]), keep
