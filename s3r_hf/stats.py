"""`S3RStats`: what speculative decoding did during one generation call.

Two summaries of the same rounds are kept apart, because they answer different questions:

- τ (`tau`): tokens committed per request-round, over every round a request took part in, dense steps (rounds
  where it drafted nothing) included, and after the commit cut at EOS or `max_new_tokens`. It is what speed follows:
  a round costs about the same whatever it accepts, so the tokens a round yields is the speed-up's numerator.
- vLLM's speculative-decoding metrics (`num_drafts`, `num_draft_tokens`, `num_accepted_tokens`,
  `num_accepted_tokens_per_pos`, `mean_acceptance_length = 1 + num_accepted_tokens / num_drafts`): counted over
  drafts only, i.e. over request-rounds that drafted at least one token. They describe the drafter, whatever the
  engine chose to do with it. A request-round that drafted nothing (the adaptive engine's dense steps, a request's
  first round after admission, the last token of a response) is a dense step (`dense_steps`), not a draft.

Without dense steps and cuts the two agree (each draft commits its accepted tokens plus one); with an adaptive
engine that often decodes densely, τ is lower than the mean acceptance length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class S3RStats:
    """Counts of one S3R generation call (see the module docstring for τ against the mean acceptance length).

    `drafted` / `accepted` are vLLM's `num_draft_tokens` / `num_accepted_tokens` (both names work);
    `position_drafted` / `position_accepted` count per draft position (0-based), `position_accepted` being vLLM's
    `num_accepted_tokens_per_pos`.
    """

    # Decode steps of the engine: each runs one round of every running request (its draft passes, if any, and one
    # verify or dense forward). Prefill steps are not counted.
    decode_steps: int = 0
    request_rounds: int = 0  # one per request in each decode step, dense steps included
    num_drafts: int = 0  # request-rounds that drafted at least one token (vLLM's num_drafts)
    dense_steps: int = 0  # request-rounds that drafted nothing: one dense token, not a draft
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    prefill_tokens: int = 0
    shared_prompt_tokens: int = 0  # prompt tokens copied from another request's identical prompt, not computed
    # Mixed steps (`S3RConfig.mixed_steps`) that prefilled prompt chunks next to decoding requests: packed into the
    # round's verify forward, or run in a forward of their own because that round was a dense step already queued
    # on the device (launched early behind the step before).
    mixed_steps_packed: int = 0
    mixed_steps_beside_queued: int = 0
    offload_episodes: int = 0  # requests paused (KV moved to host memory) under KV pressure
    pages_offloaded: int = 0  # KV pages copied to host memory by those pauses
    pages_restored: int = 0  # and copied back when the requests resumed
    peak_kv_pages: int = 0
    peak_host_kv_pages: int = 0  # most KV pages held in host memory at once by paused requests
    # The AIMD concurrency limit: `(engine step, limit)` where it changed, the starting limit at step 0 first; and how
    # many steps lowered it (KV pressure or a restore backlog).
    concurrency_trace: list[tuple[int, int]] = field(default_factory=list)
    concurrency_backoffs: int = 0
    # Wall time of prefill steps and of decoding rounds; when the engine times, the device is synchronized where
    # the engine switches between the two (not between rounds, which overlap).
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # CUDA-graph captures included
    graph_captures: int = 0
    graph_capture_seconds: float = 0.0  # part of decode_seconds spent capturing CUDA graphs
    # What this call captured: kind, rows x queries per row, seconds (`DecodeGraphs.capture_log`). A later call of a
    # kept runtime should capture nothing; when it does, this says which step needed a graph the earlier ones had not.
    captured_graphs: list[str] = field(default_factory=list)
    # torch.compile work during the call (`S3RConfig.compile_layers`): graphs compiled for shapes not seen before in
    # the process, and the seconds spent compiling them (part of prefill and decode time).
    compiled_graphs: int = 0
    compile_seconds: float = 0.0
    # Variants of s3r-hf's own Triton kernels built during the call (compiled, for about a second each, or read from
    # Triton's disk cache): one per new specialization of their arguments; after the first call, 0 is steady state.
    kernel_variants: int = 0
    # Per-stage wall time of the rounds (draft, verify, accept, refresh) with `s3r_timing="stages"` only: the
    # device is synchronized between stages, which removes host/device overlap, so use it to see where a round's
    # time goes, not for the headline numbers.
    stage_seconds: dict[str, float] = field(default_factory=dict)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    # Request-rounds by the number of tokens drafted (0: dense steps), e.g. how often an adaptive engine chose each
    # draft length (shorter near the end of a response, where fewer tokens remain).
    draft_length_counts: dict[int, int] = field(default_factory=dict)
    # Drafting steps whose verify refreshed the index views (top-K anew from its scores), and those that only extended
    # them with the committed tokens (`S3RConfig.refresh_interval`); refresh steps before drafting are not counted.
    view_refreshes: int = 0
    view_extensions: int = 0
    # Decoding by the number of requests running in a step, in powers of two (the key: at most that many rows):
    # `{"seconds", "steps", "tokens"}` each, the seconds being host wall time from one step's start to the next's
    # (a prefill step's interval is left out). Shows where a call's time goes, e.g. its tail of a few long responses.
    decode_by_rows: dict[int, dict[str, float]] = field(default_factory=dict)
    # Draft tokens proposed and accepted per request (the key: its batch row). The rows of a call accept at different
    # rates, so under speculation they advance at different rates where dense decoding moves them in step, and a call
    # that runs to `max_new_tokens` ends with its least-accepting rows (docs/benchmarks.md, "rows that accept
    # differently"); `acceptance_by_request` summarises the spread.
    request_acceptance: dict[int, list[int]] = field(default_factory=dict)

    def record_round(
        self, num_drafted: list[int], num_accepted: list[int], num_committed: list[int],
        batch_rows: list[int] | None = None,
    ) -> None:
        """Add one verification round; one entry per request verified in it (`batch_rows`: the requests' batch rows, for
        `request_acceptance`).

        An entry with `num_drafted == 0` is a dense step of that request (one token from one dense position); it
        counts in `rounds`, `committed` and τ, and in `dense_steps` instead of `num_drafts`.
        """
        count, committed = len(num_drafted), sum(num_committed)
        self.request_rounds += count
        self.accepted += sum(num_accepted)
        self.committed += committed
        if count:
            rows = self._rows_entry(count)
            rows["steps"] += 1
            rows["tokens"] += committed
        if count and not any(num_drafted):  # a dense step (every step of dense decoding): no drafts to count
            self.dense_steps += count
            self.draft_length_counts[0] = self.draft_length_counts.get(0, 0) + count
            return
        lengths = Counter(num_drafted)
        self.dense_steps += lengths[0]
        self.num_drafts += count - lengths[0]
        for length, times in lengths.items():
            self.draft_length_counts[length] = self.draft_length_counts.get(length, 0) + times
        self.drafted += sum(num_drafted)
        for row, drafted, accepted in zip(batch_rows or (), num_drafted, num_accepted):
            if drafted:
                counts = self.request_acceptance.setdefault(row, [0, 0])
                counts[0] += drafted
                counts[1] += accepted
        self._grow(max(num_drafted, default=0))
        self._count_positions(self.position_drafted, num_drafted)
        # A position counts as accepted only where it was drafted.
        self._count_positions(self.position_accepted, [min(a, d) for a, d in zip(num_accepted, num_drafted)])

    def record_step_interval(self, rows: int, seconds: float) -> None:
        """Wall time from the start of a decode step of `rows` requests to the start of the next step."""
        self._rows_entry(rows)["seconds"] += seconds

    def _rows_entry(self, rows: int) -> dict[str, float]:
        bucket = 1 << max(rows - 1, 0).bit_length()
        entry = self.decode_by_rows.get(bucket)
        if entry is None:
            entry = self.decode_by_rows[bucket] = {"seconds": 0.0, "steps": 0, "tokens": 0}
        return entry

    @staticmethod
    def _count_positions(counts: list[int], lengths: list[int]) -> None:
        """`counts[p] += ` the number of `lengths` above `p`. A round has a handful of distinct lengths, so this walks
        the positions once, from the last, over a histogram instead of every request times every position."""
        histogram = Counter(lengths)
        longer = 0
        for position in range(max(lengths, default=0) - 1, -1, -1):
            longer += histogram.get(position + 1, 0)
            counts[position] += longer

    def _grow(self, length: int) -> None:
        missing = length - len(self.position_drafted)
        if missing > 0:
            self.position_drafted.extend([0] * missing)
            self.position_accepted.extend([0] * missing)

    def record_concurrency_limit(self, step: int, limit: int, previous: int | None = None) -> None:
        """The limit after engine step `step` (`previous`: the limit before it; None for the starting limit)."""
        if previous is not None and limit < previous:
            self.concurrency_backoffs += 1
        if not self.concurrency_trace or self.concurrency_trace[-1][1] != limit:
            self.concurrency_trace.append((step, limit))

    @property
    def concurrency_limit_min(self) -> int:
        return min((limit for _, limit in self.concurrency_trace), default=0)

    @property
    def concurrency_limit_max(self) -> int:
        return max((limit for _, limit in self.concurrency_trace), default=0)

    @property
    def concurrency_limit_final(self) -> int:
        return self.concurrency_trace[-1][1] if self.concurrency_trace else 0

    @property
    def num_draft_tokens(self) -> int:
        """vLLM's name for `drafted`: draft tokens proposed."""
        return self.drafted

    @property
    def num_accepted_tokens(self) -> int:
        """vLLM's name for `accepted`: draft tokens accepted."""
        return self.accepted

    @property
    def num_accepted_tokens_per_pos(self) -> list[int]:
        """vLLM's per-position counts: drafts whose token at position `i` (0-based) was accepted."""
        return list(self.position_accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's mean acceptance length, `1 + num_accepted_tokens / num_drafts`: tokens a draft yields, the
        correction or bonus token included. Dense steps are not drafts and do not count; without any draft it is
        1.0 when dense steps ran (each commits one token) and 0.0 when nothing ran."""
        if self.num_drafts:
            return 1.0 + self.accepted / self.num_drafts
        return 1.0 if self.request_rounds else 0.0

    def acceptance_by_request(self, min_drafted: int = 24) -> dict[str, float]:
        """The spread of the requests' own acceptance rates (accepted over drafted tokens), over requests that drafted
        at least `min_drafted` tokens: `{"requests", "p10", "p50", "p90"}`; empty when none did."""
        rates = sorted(a / d for d, a in self.request_acceptance.values() if d >= min_drafted)
        if not rates:
            return {}

        def quantile(q: float) -> float:
            return rates[min(len(rates) - 1, round(q * (len(rates) - 1)))]

        return {"requests": len(rates), "p10": quantile(0.1), "p50": quantile(0.5), "p90": quantile(0.9)}

    @property
    def tau(self) -> float:
        """τ: committed tokens per request-round, dense steps included (after the cut at EOS or `max_new_tokens`)."""
        return self.committed / self.request_rounds if self.request_rounds else 0.0

    @property
    def pages_moved_per_1k_tokens(self) -> float:
        """KV pages offloaded and restored per 1,000 committed tokens (the paper's Table 2 measure of paging cost)."""
        return (self.pages_offloaded + self.pages_restored) * 1000 / self.committed if self.committed else 0.0

    # The former names of `decode_steps` and `request_rounds`, kept working.
    @property
    def steps(self) -> int:
        return self.decode_steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.decode_steps = value

    @property
    def rounds(self) -> int:
        return self.request_rounds

    @rounds.setter
    def rounds(self, value: int) -> None:
        self.request_rounds = value

    @property
    def rounds_per_refresh(self) -> float:
        """Drafting steps per index-view refresh (1.0 when every round refreshes, as in the paper; 0.0 without
        drafting steps)."""
        return (self.view_refreshes + self.view_extensions) / self.view_refreshes if self.view_refreshes else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Probability that draft position `i` (0-based) was accepted, given that it was drafted."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def to_dict(self) -> dict[str, Any]:
        """Every count and summary as plain Python values (JSON-ready; `draft_length_counts` has int keys)."""
        return {
            "decode_steps": self.decode_steps,
            "request_rounds": self.request_rounds,
            "num_drafts": self.num_drafts,
            "dense_steps": self.dense_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "prefill_tokens": self.prefill_tokens,
            "shared_prompt_tokens": self.shared_prompt_tokens,
            "mixed_steps_packed": self.mixed_steps_packed,
            "mixed_steps_beside_queued": self.mixed_steps_beside_queued,
            "offload_episodes": self.offload_episodes,
            "pages_offloaded": self.pages_offloaded,
            "pages_restored": self.pages_restored,
            "pages_moved_per_1k_tokens": self.pages_moved_per_1k_tokens,
            "peak_kv_pages": self.peak_kv_pages,
            "peak_host_kv_pages": self.peak_host_kv_pages,
            "concurrency_trace": [list(entry) for entry in self.concurrency_trace],
            "concurrency_backoffs": self.concurrency_backoffs,
            "concurrency_limit_min": self.concurrency_limit_min,
            "concurrency_limit_max": self.concurrency_limit_max,
            "concurrency_limit_final": self.concurrency_limit_final,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "graph_captures": self.graph_captures,
            "graph_capture_seconds": self.graph_capture_seconds,
            "captured_graphs": list(self.captured_graphs),
            "compiled_graphs": self.compiled_graphs,
            "compile_seconds": self.compile_seconds,
            "kernel_variants": self.kernel_variants,
            "stage_seconds": dict(self.stage_seconds),
            "draft_length_counts": dict(sorted(self.draft_length_counts.items())),
            "view_refreshes": self.view_refreshes,
            "view_extensions": self.view_extensions,
            "rounds_per_refresh": self.rounds_per_refresh,
            "decode_by_rows": {rows: dict(entry) for rows, entry in sorted(self.decode_by_rows.items())},
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": self.num_accepted_tokens_per_pos,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tau": self.tau,
            "per_position_acceptance": self.per_position_acceptance,
            "acceptance_by_request": self.acceptance_by_request(),
        }
