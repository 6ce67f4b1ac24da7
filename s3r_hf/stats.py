"""`S3RStats`: what speculative decoding did during one generation call."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class S3RStats:
    """Counts of one S3R generation call.

    `mean_acceptance_length` is τ as vLLM and SGLang report it: tokens committed per verification round,
    the correction or bonus token included (so it lies in `[1, draft_len + 1]`).
    """

    steps: int = 0  # lockstep rounds of the engine (each: the draft passes and one verify forward)
    rounds: int = 0  # request-rounds (one per request verified in a step)
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    prefill_tokens: int = 0
    offload_episodes: int = 0  # requests paused (KV moved to host memory) under KV pressure
    pages_offloaded: int = 0
    peak_kv_pages: int = 0
    # Wall time of prefill steps and of decoding rounds; when the engine times, the device is synchronized where
    # the engine switches between the two (not between rounds, which overlap).
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # CUDA-graph captures included
    graph_captures: int = 0
    graph_capture_seconds: float = 0.0  # part of decode_seconds spent capturing CUDA graphs
    # Per-stage wall time of the rounds (draft, verify, accept, refresh) with `s3r_timing="stages"` only: the
    # device is synchronized between stages, which removes host/device overlap, so use it to see where a round's
    # time goes, not for the headline numbers.
    stage_seconds: dict[str, float] = field(default_factory=dict)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def record_round(self, num_drafted: list[int], num_accepted: list[int], num_committed: list[int]) -> None:
        """Add one verification round; one entry per request verified in it."""
        self.rounds += len(num_drafted)
        self.drafted += sum(num_drafted)
        self.accepted += sum(num_accepted)
        self.committed += sum(num_committed)
        self._grow(max(num_drafted, default=0))
        self._count_positions(self.position_drafted, num_drafted)
        # A position counts as accepted only where it was drafted.
        self._count_positions(self.position_accepted, [min(a, d) for a, d in zip(num_accepted, num_drafted)])

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

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """τ: committed tokens per verification round (accepted drafts + the correction/bonus token)."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Probability that draft position `i` (0-based) was accepted, given that it was drafted."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    def to_dict(self) -> dict[str, float | int | list[float]]:
        return {
            "steps": self.steps,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "prefill_tokens": self.prefill_tokens,
            "offload_episodes": self.offload_episodes,
            "pages_offloaded": self.pages_offloaded,
            "peak_kv_pages": self.peak_kv_pages,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "graph_captures": self.graph_captures,
            "graph_capture_seconds": self.graph_capture_seconds,
            "stage_seconds": dict(self.stage_seconds),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
        }
