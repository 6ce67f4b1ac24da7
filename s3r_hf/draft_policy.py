"""How many tokens a round drafts: the paper's fixed `k`, or `k` chosen before each round from measured costs.

A round that drafts `k` tokens costs `k` sparse draft passes and one verify block of `k + 1` queries, and commits
`E[τ(k)] = 1 + Σ_{i ≤ k} Π_{j ≤ i} α_j` tokens per request, where `α_j` is the chance that draft `j` is accepted
once the drafts before it were. A plain dense step (`k = 0`) costs one forward and commits one token. Drafting
pays only where `E[τ(k)] / cost(k) > 1 / cost(0)` (paper §5): where the KV reads of the running requests dominate
the weights and the kernel launches. Small models, short contexts and the tail of a rollout, where few requests
remain, are on the other side, and there S3R must decode as fast as dense decoding.

`AdaptiveDraftLength` measures the wall time of the rounds it chose, per (batch, context) bucket and `k`, and
estimates `α_j` from the acceptance tests it has seen; before each round it picks the `k` with the most committed
tokens per second, and now and then probes a `k` it has not measured lately, since both costs and acceptance
drift as contexts grow and requests finish. The engine reports the cost of a round only when the round before it
had the same `k`: the first round after a switch pays for work the previous round would have overlapped with its
own (the next round's launches), so it says little about what a steady run of that `k` costs. A probe therefore
runs a few rounds in a row.

Exactness does not depend on the choice: `k` is fixed before the round draws its randomness, from what earlier
rounds did, and every round is an exact speculative-sampling step for whatever `k` it runs (tests force `k` to
vary from round to round and check the samples against the dense distribution).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

SWITCH_COST = 2.0
"""Dense-step times a probe's two switches cost on top of its rounds: a refresh step before drafting, and a round
whose successor was not launched early."""


@dataclass(frozen=True)
class RoundShape:
    """What a round's cost depends on: how many requests it runs and their mean committed context."""

    rows: int
    context: int

    @property
    def bucket(self) -> tuple[int, int]:
        """Powers of two of both: costs within a bucket differ little, and few buckets keep probing cheap."""
        return (max(0, math.ceil(math.log2(max(self.rows, 1)))), max(0, int(math.log2(max(self.context, 1)))))


class DraftLengthPolicy(Protocol):
    """Chooses the draft length of each round; told what the rounds cost and how their drafts fared."""

    def choose(self, shape: RoundShape) -> int: ...

    def observe_cost(self, shape: RoundShape, draft_len: int, seconds: float) -> None: ...

    def observe_acceptance(self, draft_counts: list[int], accepted_counts: list[int]) -> None: ...


class FixedDraftLength:
    """The paper's rule: every round drafts `draft_len` tokens (`0`: the engine's dense decoding)."""

    def __init__(self, draft_len: int) -> None:
        self.draft_len = draft_len

    def choose(self, shape: RoundShape) -> int:
        return self.draft_len

    def observe_cost(self, shape: RoundShape, draft_len: int, seconds: float) -> None:
        pass

    def observe_acceptance(self, draft_counts: list[int], accepted_counts: list[int]) -> None:
        pass


class ScriptedDraftLength(FixedDraftLength):
    """Draft lengths taken in turn from a list, cycling (tests: the samples stay exact however `k` varies)."""

    def __init__(self, draft_lens: list[int]) -> None:
        if not draft_lens or min(draft_lens) < 0:
            raise ValueError(f"ScriptedDraftLength needs a non-empty list of draft lengths >= 0, got {draft_lens}")
        super().__init__(max(draft_lens))
        self.draft_lens = list(draft_lens)
        self.rounds = 0

    def choose(self, shape: RoundShape) -> int:
        k = self.draft_lens[self.rounds % len(self.draft_lens)]
        self.rounds += 1
        return k


@dataclass
class _BucketCosts:
    """Recent round times of one (batch, context) bucket, per draft length, and when to probe next."""

    seconds: dict[int, deque] = field(default_factory=dict)
    medians: dict[int, float] = field(default_factory=dict)  # `estimate` of each k, kept current by `add`
    last_seen: dict[int, int] = field(default_factory=dict)  # round counter of each k's latest sample
    rounds: int = 0
    choice: int | None = None  # the best k when last chosen
    probe_gap: int = 0
    next_probe: int = 0
    probe_k: int = 0  # the length being probed, while `probe_left` rounds of the probe remain
    probe_left: int = 0

    def add(self, k: int, seconds: float, samples: int) -> None:
        kept = self.seconds.setdefault(k, deque(maxlen=samples))
        kept.append(seconds)
        # The lower median of the recent samples: a capture or a recompilation that slipped into one sample does
        # not move it. Kept here rather than sorted on every choice (a choice is made every round).
        self.medians[k] = sorted(kept)[(len(kept) - 1) // 2]

    def estimate(self, k: int) -> float | None:
        return self.medians.get(k)


class AdaptiveDraftLength:
    """Picks `k ∈ {0, …, max_draft_len}` before each round to maximise expected committed tokens per second.

    Args:
        max_draft_len: the largest `k` (`S3RConfig.draft_len`).
        prior_acceptance: `α_j` assumed before any draft was verified, worth `prior_weight` observations.
        acceptance_decay: weight kept by past acceptance counts at each observed round, so `α_j` follows the text.
        min_probe_gap / max_probe_gap: rounds between probes of a bucket; the gap doubles while probes confirm the
            choice and returns to the minimum when one changes it.
        samples: round times kept per (bucket, k).
        lengths: the draft lengths it may choose (default: all of `0..max_draft_len`).
        probe_rounds: consecutive rounds a probe runs (the engine times all but the first).
        switch_margin: how much more tokens per second drafting must promise to replace dense decoding.
        probe_budget: the share of a bucket's time its probes may lose, by the current estimates: a probe of a
            length that loses by far (drafting on a launch-bound model, say) waits correspondingly longer.

    A choice is made before every round, so it must cost little next to a dense step of a small model: the medians,
    the expected tokens and each bucket's neighbours by distance are kept up to date as observations arrive instead
    of being recomputed per choice.
    """

    def __init__(
        self,
        max_draft_len: int,
        prior_acceptance: float = 0.7,
        prior_weight: float = 4.0,
        acceptance_decay: float = 0.98,
        min_probe_gap: int = 8,
        max_probe_gap: int = 1024,
        samples: int = 5,
        lengths: tuple[int, ...] | None = None,
        probe_rounds: int = 3,
        switch_margin: float = 0.1,
        probe_budget: float = 0.01,
    ) -> None:
        if max_draft_len < 1:
            raise ValueError(f"AdaptiveDraftLength needs max_draft_len >= 1, got {max_draft_len}")
        self.max_draft_len = max_draft_len
        self.lengths = tuple(sorted(set(lengths))) if lengths is not None else tuple(range(max_draft_len + 1))
        if self.lengths[0] != 0 or self.lengths[-1] != max_draft_len:
            raise ValueError(f"AdaptiveDraftLength lengths must include 0 and {max_draft_len}, got {lengths}")
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.acceptance_decay = acceptance_decay
        self.min_probe_gap = min_probe_gap
        self.max_probe_gap = max_probe_gap
        self.samples = samples
        self.probe_rounds = probe_rounds
        self.switch_margin = switch_margin
        self.probe_budget = probe_budget
        self.reached = [0.0] * max_draft_len  # drafts at position j the acceptance test looked at
        self.accepted = [0.0] * max_draft_len
        self.buckets: dict[tuple[int, int], _BucketCosts] = {}
        self._nearest_buckets: dict[tuple[int, int], list[_BucketCosts]] = {}  # emptied when a bucket is added
        self._expected: dict[int, float] = {}  # `expected_tokens`, emptied when acceptance is observed
        self.choices: dict[int, int] = {}  # how often each k was chosen (reported by the engine's stats)

    # ---------------------------------------------------------------- acceptance
    def observe_acceptance(self, draft_counts: list[int], accepted_counts: list[int]) -> None:
        """One round's acceptance tests: request `r` drafted `draft_counts[r]` and kept `accepted_counts[r]`, so it
        reached positions `1..min(accepted + 1, drafted)` and passed `1..accepted`."""
        if max(draft_counts, default=0) == 0:
            return
        self._expected.clear()
        self.reached = [count * self.acceptance_decay for count in self.reached]
        self.accepted = [count * self.acceptance_decay for count in self.accepted]
        for drafted, accepted in zip(draft_counts, accepted_counts):
            for position in range(min(accepted + 1, drafted, self.max_draft_len)):
                self.reached[position] += 1
                if position < accepted:
                    self.accepted[position] += 1

    def acceptance(self) -> list[float]:
        """`α_j` for `j = 1..max_draft_len`: observed rates shrunk toward the prior by `prior_weight`."""
        prior = self.prior_weight * self.prior_acceptance
        return [(a + prior) / (r + self.prior_weight) for a, r in zip(self.accepted, self.reached)]

    def expected_tokens(self, k: int) -> float:
        """`E[τ(k)]`: tokens a round drafting `k` commits per request (the correction or bonus token included)."""
        total = self._expected.get(k)
        if total is None:
            total, survive = 1.0, 1.0
            for alpha in self.acceptance()[:k]:
                survive *= alpha
                total += survive
            self._expected[k] = total
        return total

    # ---------------------------------------------------------------- costs
    def observe_cost(self, shape: RoundShape, draft_len: int, seconds: float) -> None:
        bucket = self._bucket(shape.bucket)
        bucket.add(draft_len, seconds, self.samples)
        bucket.last_seen[draft_len] = bucket.rounds

    def cost_ratio(self, key: tuple[int, int], k: int, nearest: list[_BucketCosts] | None = None) -> float | None:
        """Estimated time of a `k`-round over a dense step's, in bucket `key` or the nearest bucket that measured
        both (`nearest`: the buckets by distance from `key`, if already sorted); None when nothing was measured."""
        for bucket in nearest if nearest is not None else self._nearest(key):
            ratio = self._bucket_ratio(bucket, k)
            if ratio is not None:
                return ratio
        return None

    def _nearest(self, key: tuple[int, int]) -> list[_BucketCosts]:
        """The buckets by distance from `key` (`key` itself first, if it exists)."""
        nearest = self._nearest_buckets.get(key)
        if nearest is None:
            order = sorted(self.buckets, key=lambda b: abs(b[0] - key[0]) + abs(b[1] - key[1]))
            nearest = self._nearest_buckets[key] = [self.buckets[b] for b in order]
        return nearest

    def _bucket_ratio(self, bucket: _BucketCosts, k: int) -> float | None:
        """`cost(k) / cost(0)` in one bucket: measured, or linear in `k` between the nearest measured lengths (a
        round's cost grows by one draft pass per drafted token)."""
        dense = bucket.estimate(0)
        if dense is None or dense <= 0:
            return None
        if k == 0:
            return 1.0
        measured = bucket.medians
        if k in measured:
            return measured[k] / dense
        below = max((j for j in measured if j < k), default=None)
        above = min((j for j in measured if j > k), default=None)
        if above is None:  # extrapolate from the two longest measured lengths
            longest = sorted(measured)[-2:]
            if len(longest) < 2:
                return None
            below, above = longest
        slope = (measured[above] - measured[below]) / (above - below)
        return max(measured[below] + slope * (k - below), 1e-12) / dense

    # ---------------------------------------------------------------- the choice
    def best(self, key: tuple[int, int], current: int | None = None) -> int | None:
        """The `k` with the most expected tokens per unit of time in bucket `key`; None before any measurement.

        From dense decoding (`current` is 0 or None) drafting must win by `switch_margin`: a switch costs a refresh
        step and launches that a run of dense steps overlaps, and a few measured rounds are noisy. Near break-even,
        where drafting gains nothing worth having, the rule stays with dense decoding instead of paying for switches.
        """
        return self._best(key, current)[0]

    def _best(self, key: tuple[int, int], current: int | None) -> tuple[int | None, dict[int, float]]:
        """`best`, and the expected tokens per unit of a dense step's time of every length with an estimate."""
        values = {}
        nearest = self._nearest(key)
        for k in self.lengths:
            ratio = self.cost_ratio(key, k, nearest)
            if ratio is not None:
                values[k] = self.expected_tokens(k) / ratio
        if len(values) < 2:
            return None, values
        best = max(values, key=lambda k: (values[k], -k))
        if best > 0 and not current and 0 in values and values[best] < (1 + self.switch_margin) * values[0]:
            return 0, values
        return best, values

    def report(self) -> list[dict]:
        """What the rule measured, per bucket (benchmarks print it): rows and context bucket (lower bounds), rounds
        seen, the current choice, and the estimated seconds of a round per draft length."""
        rows = []
        for (rows_log, context_log), bucket in sorted(self.buckets.items()):
            rows.append({
                "rows_from": 2 ** (rows_log - 1) + 1 if rows_log else 1, "rows_to": 2**rows_log,
                "context_from": 2**context_log, "rounds": bucket.rounds, "choice": bucket.choice,
                "seconds": {k: bucket.estimate(k) for k in sorted(bucket.seconds)},
                "samples": {k: len(v) for k, v in sorted(bucket.seconds.items())},
            })
        return rows

    def choose(self, shape: RoundShape) -> int:
        key = shape.bucket
        bucket = self._bucket(key)
        bucket.rounds += 1
        best, values = self._best(key, bucket.choice)
        if bucket.probe_left > 0:  # a probe in progress
            bucket.probe_left -= 1
            k = bucket.probe_k
        elif best is None:  # nothing to compare yet: measure dense steps, then full rounds
            k = 0 if 0 not in bucket.seconds else self.max_draft_len
        else:
            if best != bucket.choice:  # the evidence moved: look again soon, as soon as the probe is worth it
                bucket.choice = best
                affordable = self._affordable_gap(values, best, self._probe_length(bucket, best))
                bucket.probe_gap = max(self.min_probe_gap, affordable)
                bucket.next_probe = bucket.rounds + bucket.probe_gap
            k = self._probe(bucket, best, values) if bucket.rounds >= bucket.next_probe else best
        self.choices[k] = self.choices.get(k, 0) + 1
        return k

    def _probe(self, bucket: _BucketCosts, best: int, values: dict[int, float]) -> int:
        """Start a probe of `_probe_length` for the next `probe_rounds` rounds. The gap to the next probe doubles
        while the probes keep confirming `best` (up to `max_probe_gap`), and is never shorter than
        `_affordable_gap`."""
        k = self._probe_length(bucket, best)
        bucket.probe_k, bucket.probe_left = k, self.probe_rounds - 1
        doubled = min(self.max_probe_gap, max(self.min_probe_gap, 2 * bucket.probe_gap))
        bucket.probe_gap = max(doubled, self._affordable_gap(values, best, k))
        bucket.next_probe = bucket.rounds + bucket.probe_gap
        return k

    def _probe_length(self, bucket: _BucketCosts, best: int) -> int:
        """The length next to the choice or at either end that this bucket measured longest ago (the ends first,
        which tell most about whether drafting pays at all)."""
        ends = (0, self.max_draft_len)
        candidates = [k for k in {*ends, best - 1, best + 1} - {best} if k in self.lengths]
        return min(candidates, key=lambda j: (bucket.last_seen.get(j, -1), j not in ends, j))

    def _affordable_gap(self, values: dict[int, float], best: int, k: int) -> int:
        """Rounds of `best` between probes of `k` for the time a probe loses, by the current estimates, to stay
        within `probe_budget` of the time in between. `values` are tokens per dense-step time; a probe's rounds
        commit `probe_rounds * E[τ(k)]` tokens, which `best` would have committed faster, and it switches twice."""
        if k not in values or best not in values or values[k] >= values[best]:
            return 0
        tokens = self.probe_rounds * self.expected_tokens(k)
        lost = tokens / values[k] - tokens / values[best] + SWITCH_COST  # in dense-step times
        best_round = self.expected_tokens(best) / values[best]
        return math.ceil(lost / (self.probe_budget * best_round))

    def _bucket(self, key: tuple[int, int]) -> _BucketCosts:
        bucket = self.buckets.get(key)
        if bucket is None:
            # A new bucket (the batch shrank, contexts grew) starts from its nearest neighbour's choice and as
            # confident in it: where the neighbour's probes kept confirming it, the first probe here waits as long.
            gap, choice = self.min_probe_gap, None
            if self.buckets:
                nearest = self._nearest(key)[0]
                gap, choice = max(gap, nearest.probe_gap), nearest.choice
            bucket = self.buckets[key] = _BucketCosts(choice=choice, probe_gap=gap, next_probe=gap)
            self._nearest_buckets.clear()
        return bucket


def adaptive_for(max_draft_len: int) -> AdaptiveDraftLength:
    """The engine's adaptive rule: a dense step or a full-length round. Every other length would be CUDA graphs of its
    own (a draft phase and a verify block per batch bucket), each capture costing dozens of rounds' worth of time in
    a call, for a gain over the nearer end that the measured costs rarely show."""
    return AdaptiveDraftLength(max_draft_len, lengths=(0, max_draft_len))
