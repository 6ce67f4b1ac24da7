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

The same rule chooses how often a drafting round refreshes the index views (`S3RConfig.refresh_interval`). A
refresh costs the verify's score material, the score reduction and the top-K; the rounds between only extend the
views with their committed tokens, and their drafts are accepted a little less often the older the views get. The
rule estimates acceptance per view age and the cost of refreshing and extending rounds, and runs the interval `N`
with the most expected tokens per second: `Σ_{a<N} E[τ(k, a)]` over the time of one refreshing and `N - 1`
extending rounds. Now and then a cycle one round longer or shorter measures the neighbouring interval, where
drafting is the choice; a probe of drafting from dense decoding refreshes every round.

Exactness does not depend on either choice: `k` and the refresh are fixed before the round draws its randomness,
from what earlier rounds did, and every round is an exact speculative-sampling step for whatever `k` it runs over
whatever views it has (tests force `k` and the refreshes to vary from round to round and check the samples
against the dense distribution).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

MAX_ADAPTIVE_REFRESH_INTERVAL = 4
"""The longest refresh interval the adaptive rule tries. Acceptance falls with every round a view goes without a
refresh, while what a skipped refresh saves stays the same, so long intervals gain less and less."""

SWITCH_COST = 2.0
"""Dense-step times a probe's two switches cost on top of its rounds: a refresh step before drafting, and a round
whose successor was not launched early."""
DENSE_KEY = (0, False, False)
"""A dense step's key among a bucket's round times (`_BucketCosts.seconds`)."""
NEIGHBOUR_RATIO_SPREAD = 2.0
"""How far a round's cost over a dense step's may move between batch sizes: launch-bound at a few rows, bandwidth-
bound at many. A new bucket whose neighbour at another batch size chose by less probes soon instead of trusting it."""


def _distance(a: tuple[int, int], b: tuple[int, int]) -> int:
    """How far apart two buckets are: the steps of rows and of context between them."""
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


@dataclass(frozen=True)
class RoundShape:
    """What a round's cost depends on: how many requests it runs and their mean committed context."""

    rows: int
    context: int

    @property
    def bucket(self) -> tuple[int, int]:
        """Powers of two of both: costs within a bucket differ little, and few buckets keep probing cheap. (The
        ceiling of log2 of the rows and the floor of log2 of the context, in integer arithmetic: it is asked for
        twice per step.)"""
        return (max(self.rows - 1, 0).bit_length(), max(self.context, 1).bit_length() - 1)


class DraftLengthPolicy(Protocol):
    """Chooses the draft length of each round and whether a drafting round refreshes the index views; told what the
    rounds cost and how their drafts fared.

    A round's cost is the time from its start to the next round's. It holds the round's own verify and the view
    update queued by the round before it (behind that round's decision), so it is reported with both: whether the
    round refreshes (`refreshes`) and whether the round before it did (`follows_refresh`). `age` counts the rounds
    since the views a round drafts from were refreshed (0: refreshed by the round before).
    """

    def choose(self, shape: RoundShape) -> int: ...

    def refresh_due(self, shape: RoundShape, draft_len: int, age: int) -> bool: ...

    def observe_cost(
        self, shape: RoundShape, draft_len: int, seconds: float, refreshes: bool = True, follows_refresh: bool = True
    ) -> None: ...

    def observe_acceptance(self, draft_counts: list[int], accepted_counts: list[int], age: int = 0) -> None: ...


class FixedDraftLength:
    """The paper's rule: every round drafts `draft_len` tokens (`0`: the engine's dense decoding) and refreshes the
    views every `refresh_interval` rounds (the paper: every round)."""

    def __init__(self, draft_len: int, refresh_interval: int = 1) -> None:
        if refresh_interval < 1:
            raise ValueError(f"refresh_interval must be >= 1, got {refresh_interval}")
        self.draft_len = draft_len
        self.refresh_interval = refresh_interval

    def choose(self, shape: RoundShape) -> int:
        return self.draft_len

    def refresh_due(self, shape: RoundShape, draft_len: int, age: int) -> bool:
        return age + 1 >= self.refresh_interval

    def observe_cost(
        self, shape: RoundShape, draft_len: int, seconds: float, refreshes: bool = True, follows_refresh: bool = True
    ) -> None:
        pass

    def observe_acceptance(self, draft_counts: list[int], accepted_counts: list[int], age: int = 0) -> None:
        pass


class ScriptedDraftLength(FixedDraftLength):
    """Draft lengths taken in turn from a list, cycling, and likewise whether each drafting round refreshes the views
    (`refreshes`; default: every round). Tests: the samples stay exact however `k` and the refreshes vary."""

    def __init__(self, draft_lens: list[int], refreshes: list[bool] | None = None) -> None:
        if not draft_lens or min(draft_lens) < 0:
            raise ValueError(f"ScriptedDraftLength needs a non-empty list of draft lengths >= 0, got {draft_lens}")
        if refreshes is not None and not refreshes:
            raise ValueError("ScriptedDraftLength refreshes must be a non-empty list of bools or None")
        super().__init__(max(draft_lens))
        self.draft_lens = list(draft_lens)
        self.refreshes = list(refreshes) if refreshes is not None else [True]
        self.rounds = 0
        self.drafting_rounds = 0

    def choose(self, shape: RoundShape) -> int:
        k = self.draft_lens[self.rounds % len(self.draft_lens)]
        self.rounds += 1
        return k

    def refresh_due(self, shape: RoundShape, draft_len: int, age: int) -> bool:
        refresh = self.refreshes[self.drafting_rounds % len(self.refreshes)]
        self.drafting_rounds += 1
        return refresh


@dataclass
class _BucketCosts:
    """Recent round times of one (batch, context) bucket, per draft length and refresh pattern, and when to probe
    next.

    A round's time is keyed by `(k, refreshes, follows_refresh)` (a dense step: `(0, False, False)`): in a cycle of
    `N` rounds the refreshing round follows an extending one (or a refreshing one when `N = 1`), the first extending
    round pays the previous refresh's view rebuild, and the others pay an extension each."""

    key: tuple[int, int]  # (rows, context) bucket, see `RoundShape.bucket`
    seconds: dict[tuple[int, bool, bool], deque] = field(default_factory=dict)
    medians: dict[tuple[int, bool, bool], float] = field(default_factory=dict)  # kept current by `add`
    last_seen: dict[int, int] = field(default_factory=dict)  # round counter of each k's latest sample
    pattern_seen: dict[tuple[bool, bool], int] = field(default_factory=dict)  # refresh cycle of each pattern's latest
    rounds: int = 0
    choice: int | None = None  # the best k when last chosen
    probe_gap: int = 0
    next_probe: int = 0
    next_review: int = 0  # the round at which the choice is compared with the estimates again
    probe_k: int = 0  # the length being probed, while `probe_left` rounds of the probe remain
    probe_left: int = 0
    cycles: int = 0  # refresh cycles begun in this bucket
    interval: int = 1  # the best refresh interval when last chosen
    interval_probe_gap: int = 0  # in cycles
    next_interval_probe: int = 0
    extends_measured: bool = False  # a drafting round that only extended the views was timed here
    probes: int = 0  # probes of a draft length started here (reported: where a call's probing went)

    def add(self, key: tuple[int, bool, bool], seconds: float, samples: int) -> None:
        kept = self.seconds.setdefault(key, deque(maxlen=samples))
        kept.append(seconds)
        self.extends_measured |= key[0] > 0 and not key[1]
        # The lower median of the recent samples: a capture or a recompilation that slipped into one sample does
        # not move it. Kept here rather than sorted on every choice (a choice is made every round). A dense step's
        # cost is the least of its samples: dense steps vary little, and what varies is what slips into their
        # intervals when they are probes between drafting rounds (the pipeline catching up). An inflated dense cost
        # would make drafting look better than it is, and keep choosing it where it is slower.
        self.medians[key] = min(kept) if key[0] == 0 else sorted(kept)[(len(kept) - 1) // 2]

    def dense(self) -> float | None:
        return self.medians.get(DENSE_KEY)

    def round_cost(self, k: int, interval: int) -> float | None:
        """Mean time of a `k`-round when the views are refreshed every `interval` rounds, or None if unmeasured. A
        pattern not yet seen is taken from the nearest one that costs at least as much: a refreshing round after an
        extending one from one after a refreshing one (it pays an extension instead of a rebuild), an extending
        round between extending ones from the first after a refresh."""
        if k == 0:
            return self.dense()
        every_round = self.medians.get((k, True, True))
        if interval == 1:
            return every_round
        refreshing = self.medians.get((k, True, False), every_round)
        first_extending = self.medians.get((k, False, True))
        if refreshing is None or first_extending is None:
            return None
        extending = self.medians.get((k, False, False), first_extending)
        return (refreshing + first_extending + (interval - 2) * extending) / interval

    def measured_lengths(self) -> set[int]:
        return {key[0] for key in self.medians}


class AdaptiveDraftLength:
    """Picks `k ∈ {0, …, max_draft_len}` before each round, and the refresh interval of the index views, to maximise
    expected committed tokens per second.

    Args:
        max_draft_len: the largest `k` (`S3RConfig.draft_len`).
        prior_acceptance: `α_j` assumed before any draft was verified, worth `prior_weight` observations. At a view
            age not yet observed, the estimate at the age before it is the prior (no further decline is assumed
            until one is seen, so longer intervals get tried).
        acceptance_decay: weight kept by past acceptance counts at each observed round, so `α_j` follows the text.
        min_probe_gap / max_probe_gap: rounds between probes of a bucket's draft length (and refresh cycles between
            probes of its refresh interval); the gap doubles while probes confirm the choice and returns to the
            minimum when one changes it.
        samples: round times kept per (bucket, k, refresh pattern).
        lengths: the draft lengths it may choose (default: all of `0..max_draft_len`).
        refresh_intervals: the refresh intervals it may choose (default: every round, the paper's rule).
        probe_rounds: consecutive rounds a probe runs (the engine times all but the first).
        switch_margin: how much more tokens per second drafting must promise to replace dense decoding, and half
            of it to go on once chosen. Besides a switch's own cost it covers what the estimates do not see:
            requests accept at rates of their own, drafting lets them part, and where the cost of a step hardly
            depends on its rows (a few rows, launch-bound) a call ends with its slowest requests, which gain less
            than the pooled rate says; and a bucket that drafts times its dense steps only in probes between
            drafting rounds, where they cost more than in a run of them.
        first_dense_samples: dense steps the first bucket times before its first drafting round (later buckets
            start from their neighbours' estimates): a single sample may hold a warm-up's work.
        probe_budget: the share of a bucket's time its probes may lose, by the current estimates: a probe of a
            length that loses by far (drafting on a launch-bound model, say) waits correspondingly longer.
        review_rounds: rounds a bucket keeps its choice before the estimates are compared again (probes and the
            first choice in a bucket are never delayed).

    A choice is made before every round, so it must cost little next to a dense step of a small model: the medians,
    the expected tokens and each bucket's neighbours by distance are kept up to date as observations arrive instead
    of being recomputed per choice, and a bucket's choice is reviewed every `review_rounds` rounds rather than
    every round (the estimates move little from one round to the next).
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
        refresh_intervals: tuple[int, ...] = (1,),
        probe_rounds: int = 3,
        switch_margin: float = 0.2,
        first_dense_samples: int = 3,
        probe_budget: float = 0.005,
        review_rounds: int = 8,
    ) -> None:
        if max_draft_len < 1:
            raise ValueError(f"AdaptiveDraftLength needs max_draft_len >= 1, got {max_draft_len}")
        self.max_draft_len = max_draft_len
        self.lengths = tuple(sorted(set(lengths))) if lengths is not None else tuple(range(max_draft_len + 1))
        if self.lengths[0] != 0 or self.lengths[-1] != max_draft_len:
            raise ValueError(f"AdaptiveDraftLength lengths must include 0 and {max_draft_len}, got {lengths}")
        self.refresh_intervals = tuple(sorted(set(refresh_intervals)))
        if not self.refresh_intervals or self.refresh_intervals[0] < 1:
            raise ValueError(f"AdaptiveDraftLength refresh_intervals must be >= 1, got {refresh_intervals}")
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.acceptance_decay = acceptance_decay
        self.min_probe_gap = min_probe_gap
        self.max_probe_gap = max_probe_gap
        self.samples = samples
        self.probe_rounds = probe_rounds
        self.switch_margin = switch_margin
        self.first_dense_samples = first_dense_samples
        self.probe_budget = probe_budget
        self.review_rounds = review_rounds
        ages = self.refresh_intervals[-1]
        # Drafts at position j the acceptance test looked at, and those it passed, per view age (the last age
        # counts every older one too).
        self.reached = [[0.0] * max_draft_len for _ in range(ages)]
        self.accepted = [[0.0] * max_draft_len for _ in range(ages)]
        self.buckets: dict[tuple[int, int], _BucketCosts] = {}
        self._nearest_buckets: dict[tuple[int, int], list[_BucketCosts]] = {}  # emptied when a bucket is added
        self._dense_floors: dict[tuple[int, int], float | None] = {}  # emptied when a dense step is timed
        # `acceptance` per age and `mean_tokens` per (k, interval), emptied when acceptance is observed.
        self._acceptance: dict[int, list[float]] = {}
        self._mean_tokens: dict[tuple[int, int], float] = {}
        self._cycle_interval = 1  # the interval of the refresh cycle running now
        self.choices: dict[int, int] = {}  # how often each k was chosen (reported by the engine's stats)
        self.interval_choices: dict[int, int] = {}  # how often each refresh interval was run

    # ---------------------------------------------------------------- acceptance
    def observe_acceptance(self, draft_counts: list[int], accepted_counts: list[int], age: int = 0) -> None:
        """One round's acceptance tests over views `age` rounds old: request `r` drafted `draft_counts[r]` and kept
        `accepted_counts[r]`, so it reached positions `1..min(accepted + 1, drafted)` and passed `1..accepted`."""
        if max(draft_counts, default=0) == 0:
            return
        self._acceptance.clear()
        self._mean_tokens.clear()
        decay = self.acceptance_decay
        self.reached = [[count * decay for count in counts] for counts in self.reached]
        self.accepted = [[count * decay for count in counts] for counts in self.accepted]
        row = min(age, len(self.reached) - 1)  # the oldest age counts every older one too
        reached, passed = self.reached[row], self.accepted[row]
        for drafted, accepted in zip(draft_counts, accepted_counts):
            for position in range(min(accepted + 1, drafted, self.max_draft_len)):
                reached[position] += 1
                if position < accepted:
                    passed[position] += 1

    def acceptance(self, age: int = 0) -> list[float]:
        """`α_j` for `j = 1..max_draft_len` over views `age` rounds old: observed rates shrunk by `prior_weight`
        toward the prior at age 0, toward the estimate one age younger beyond it."""
        age = min(age, len(self.reached) - 1)
        rates = self._acceptance.get(age)
        if rates is None:
            prior = [self.prior_acceptance] * self.max_draft_len if age == 0 else self.acceptance(age - 1)
            w = self.prior_weight
            rates = [(a + w * p) / (r + w) for a, r, p in zip(self.accepted[age], self.reached[age], prior)]
            self._acceptance[age] = rates
        return rates

    def expected_tokens(self, k: int, age: int = 0) -> float:
        """`E[τ(k)]`: tokens a round drafting `k` over views `age` rounds old commits per request (the correction or
        bonus token included)."""
        total, survive = 1.0, 1.0
        for alpha in self.acceptance(age)[:k]:
            survive *= alpha
            total += survive
        return total

    def mean_tokens(self, k: int, interval: int = 1) -> float:
        """`E[τ(k)]` averaged over a refresh cycle of `interval` rounds (view ages `0..interval - 1`)."""
        key = (k, interval)
        tokens = self._mean_tokens.get(key)
        if tokens is None:
            tokens = self._mean_tokens[key] = sum(self.expected_tokens(k, age) for age in range(interval)) / interval
        return tokens

    # ---------------------------------------------------------------- costs
    def observe_cost(
        self, shape: RoundShape, draft_len: int, seconds: float, refreshes: bool = True, follows_refresh: bool = True
    ) -> None:
        bucket = self._bucket(shape.bucket)
        pattern = (refreshes, follows_refresh) if draft_len else (False, False)
        bucket.add((draft_len, *pattern), seconds, self.samples)
        bucket.last_seen[draft_len] = bucket.rounds
        if draft_len:
            bucket.pattern_seen[pattern] = bucket.cycles
        else:
            self._dense_floors.clear()

    def cost_ratio(self, key: tuple[int, int], k: int, nearest: list[_BucketCosts] | None = None) -> float | None:
        """Estimated time of a `k`-round (at its best refresh interval) over a dense step's, in bucket `key` or the
        nearest bucket that measured both (`nearest`: the buckets by distance from `key`, if already sorted); None
        when nothing was measured."""
        value = self._value(key, k, nearest)
        return None if value is None else self.mean_tokens(k, value[1]) / value[0]

    def _value(
        self, key: tuple[int, int], k: int, nearest: list[_BucketCosts] | None = None
    ) -> tuple[float, int] | None:
        """`(expected tokens per dense step's time, refresh interval)` of `k` at its best interval, from bucket
        `key` or the nearest bucket that measured enough; None when nothing was."""
        for bucket in nearest if nearest is not None else self._nearest(key):
            value = self._bucket_value(bucket, k)
            if value is not None:
                return value
        return None

    def _nearest(self, key: tuple[int, int]) -> list[_BucketCosts]:
        """The buckets by distance from `key` (`key` itself first, if it exists)."""
        nearest = self._nearest_buckets.get(key)
        if nearest is None:
            order = sorted(self.buckets, key=lambda b: _distance(b, key))
            nearest = self._nearest_buckets[key] = [self.buckets[b] for b in order]
        return nearest

    def _bucket_value(self, bucket: _BucketCosts, k: int) -> tuple[float, int] | None:
        """`_value` in one bucket: the best over the refresh intervals with a cost estimate."""
        best = None
        # Until an extending round was timed here only the shortest interval has a cost (and a choice is made every
        # round, so the others are not even tried).
        intervals = self.refresh_intervals if k and bucket.extends_measured else self.refresh_intervals[:1]
        for interval in intervals:
            ratio = self._bucket_ratio(bucket, k, interval)
            if ratio is not None:
                value = self.mean_tokens(k, interval) / ratio
                if best is None or value > best[0]:
                    best = (value, interval)
        return best

    def _bucket_ratio(self, bucket: _BucketCosts, k: int, interval: int) -> float | None:
        """`cost(k) / cost(0)` in one bucket with views refreshed every `interval` rounds: measured, or linear in `k`
        between the nearest measured lengths (a round's cost grows by one draft pass per drafted token)."""
        dense = self._dense_cost(bucket)
        if dense is None or dense <= 0:
            return None
        if k == 0:
            return 1.0
        cost = bucket.round_cost(k, interval)
        if cost is not None:
            return cost / dense
        measured = {j: bucket.round_cost(j, interval) for j in bucket.measured_lengths()}
        measured = {j: c for j, c in measured.items() if c is not None}
        below = max((j for j in measured if j < k), default=None)
        above = min((j for j in measured if j > k), default=None)
        if above is None:  # extrapolate from the two longest measured lengths
            longest = sorted(measured)[-2:]
            if len(longest) < 2:
                return None
            below, above = longest
        elif below is None:
            return None
        slope = (measured[above] - measured[below]) / (above - below)
        return max(measured[below] + slope * (k - below), 1e-12) / dense

    def _dense_cost(self, bucket: _BucketCosts) -> float | None:
        """A dense step's cost in `bucket`: the least of its samples, and no more than any bucket of at least as
        many rows and as long contexts measured. A dense step's work only grows with both, but a bucket that
        drafts times its dense steps only in probes between drafting rounds, where they cost more than they do in
        a run of dense steps; a larger bucket that decoded densely corrects that."""
        key = bucket.key
        if key not in self._dense_floors:
            costs = [
                cost for other, larger in self.buckets.items()
                if other[0] >= key[0] and other[1] >= key[1] and (cost := larger.dense()) is not None
            ]
            self._dense_floors[key] = min(costs, default=None)
        return self._dense_floors[key]

    # ---------------------------------------------------------------- the choice
    def best(self, key: tuple[int, int], current: int | None = None) -> int | None:
        """The `k` with the most expected tokens per unit of time in bucket `key`; None before any measurement.

        From dense decoding (`current` is 0 or None) drafting must win by `switch_margin`, and by half of it to go
        on drafting: a switch costs a refresh step and launches that a run of dense steps overlaps, the requests'
        acceptance rates part, and a few measured rounds are noisy. Near break-even, where drafting gains nothing
        worth having, the rule decodes densely; the gap between the two margins keeps it from switching back and
        forth on noise.
        """
        return self._best(key, current)[0]

    def _best(self, key: tuple[int, int], current: int | None) -> tuple[int | None, dict[int, tuple[float, int]]]:
        """`best`, and `(expected tokens per unit of a dense step's time, refresh interval)` of every length with
        an estimate."""
        values = {}
        nearest = self._nearest(key)
        for k in self.lengths:
            value = self._value(key, k, nearest)
            if value is not None:
                values[k] = value
        if len(values) < 2:
            return None, values
        best = max(values, key=lambda k: (values[k][0], -k))
        margin = self.switch_margin / 2 if current else self.switch_margin
        if best > 0 and 0 in values and values[best][0] < (1 + margin) * values[0][0]:
            return 0, values
        return best, values

    def report(self) -> list[dict]:
        """What the rule measured, per bucket (benchmarks print it): rows and context bucket (lower bounds), rounds
        seen, probes started, the current choice and refresh interval, and the estimated seconds of a round per draft
        length (at the interval chosen last)."""
        rows = []
        for (rows_log, context_log), bucket in sorted(self.buckets.items()):
            lengths = sorted(bucket.measured_lengths())
            rows.append({
                "rows_from": 2 ** (rows_log - 1) + 1 if rows_log else 1, "rows_to": 2**rows_log,
                "context_from": 2**context_log, "rounds": bucket.rounds, "probes": bucket.probes,
                "choice": bucket.choice,
                "refresh_interval": bucket.interval,
                "seconds": {k: bucket.round_cost(k, bucket.interval) for k in lengths},
                "samples": {k: sum(len(v) for key, v in bucket.seconds.items() if key[0] == k) for k in lengths},
            })
        return rows

    def choose(self, shape: RoundShape) -> int:
        key = shape.bucket
        bucket = self._bucket(key)
        bucket.rounds += 1
        if bucket.probe_left > 0:  # a probe in progress
            bucket.probe_left -= 1
            k = bucket.probe_k
        elif bucket.choice is not None and bucket.rounds < min(bucket.next_review, bucket.next_probe):
            k = bucket.choice  # between reviews
        else:
            k = self._review(bucket, key)
        self.choices[k] = self.choices.get(k, 0) + 1
        return k

    def _review(self, bucket: _BucketCosts, key: tuple[int, int]) -> int:
        """Compare the estimates again: the bucket's choice, or a probe when one is due."""
        bucket.next_review = bucket.rounds + self.review_rounds
        best, values = self._best(key, bucket.choice)
        if best is None:  # nothing to compare yet: measure dense steps, then full rounds
            timed = len(bucket.seconds.get(DENSE_KEY, ()))
            k = 0 if timed < min(self.first_dense_samples, self.samples) else self.max_draft_len
        else:
            if best != bucket.choice:  # the evidence moved: look again soon, as soon as the probe is worth it
                bucket.choice = best
                affordable = self._affordable_gap(values, best, self._probe_length(bucket, best))
                bucket.probe_gap = max(self.min_probe_gap, affordable)
                bucket.next_probe = bucket.rounds + bucket.probe_gap
            k = self._probe(bucket, best, values) if bucket.rounds >= bucket.next_probe else best
        return k

    def refresh_due(self, shape: RoundShape, draft_len: int, age: int) -> bool:
        """Whether a round drafting `draft_len` over views `age` rounds old refreshes them: at the end of a cycle of
        the interval chosen when the cycle began (at age 0)."""
        if len(self.refresh_intervals) == 1:
            return age + 1 >= self.refresh_intervals[0]
        if age == 0:
            self._cycle_interval = self._choose_interval(self._bucket(shape.bucket), shape.bucket, draft_len)
        return age + 1 >= self._cycle_interval

    def _choose_interval(self, bucket: _BucketCosts, key: tuple[int, int], k: int) -> int:
        """The interval of a new refresh cycle: the best by the estimates, or a neighbour of it now and then (more
        rarely while probes keep confirming the choice), which measures the refresh pattern that neighbour needs.

        Where the bucket decodes densely (or has chosen nothing yet), a probe of drafting refreshes every round: it
        measures one thing, whether drafting pays, and needs only the graphs of refreshing rounds. Running the
        extending rounds of a longer interval there would make a later call, whose graphs are otherwise all
        captured, capture the extending rounds' graph for a probe that rarely changes the choice."""
        bucket.cycles += 1
        if not bucket.choice:
            interval = self.refresh_intervals[0]
            self.interval_choices[interval] = self.interval_choices.get(interval, 0) + 1
            return interval
        value = self._value(key, k)
        best = value[1] if value is not None else self.refresh_intervals[0]
        if best != bucket.interval:
            bucket.interval, bucket.interval_probe_gap = best, self.min_probe_gap
            bucket.next_interval_probe = bucket.cycles + bucket.interval_probe_gap
        interval = best
        if bucket.cycles >= bucket.next_interval_probe:
            interval = self._probe_interval(bucket, best)
            bucket.interval_probe_gap = min(self.max_probe_gap, max(self.min_probe_gap, 2 * bucket.interval_probe_gap))
            bucket.next_interval_probe = bucket.cycles + bucket.interval_probe_gap
        self.interval_choices[interval] = self.interval_choices.get(interval, 0) + 1
        return interval

    def _probe_interval(self, bucket: _BucketCosts, best: int) -> int:
        """The neighbouring interval whose distinctive refresh pattern this bucket measured longest ago: a refresh
        after a refresh (interval 1), an extension after a refresh (2), an extension after an extension (3 and
        more)."""
        position = self.refresh_intervals.index(best)
        neighbours = self.refresh_intervals[max(position - 1, 0): position + 2]
        candidates = [interval for interval in neighbours if interval != best] or [best]
        patterns = {1: (True, True), 2: (False, True)}
        return min(candidates, key=lambda n: bucket.pattern_seen.get(patterns.get(n, (False, False)), -1))

    def _probe(self, bucket: _BucketCosts, best: int, values: dict[int, tuple[float, int]]) -> int:
        """Start a probe of `_probe_length` for the next `probe_rounds` rounds. The gap to the next probe doubles
        while the probes keep confirming `best` (up to `max_probe_gap`), and is never shorter than
        `_affordable_gap`."""
        k = self._probe_length(bucket, best)
        bucket.probe_k, bucket.probe_left = k, self.probe_rounds - 1
        bucket.probes += 1
        doubled = min(self.max_probe_gap, max(self.min_probe_gap, 2 * bucket.probe_gap))
        bucket.probe_gap = max(doubled, self._affordable_gap(values, best, k))
        bucket.next_probe = bucket.rounds + bucket.probe_gap
        return k

    def _probe_length(self, bucket: _BucketCosts, best: int) -> int:
        """The length next to the choice (among the lengths it may choose) or at either end that this bucket measured
        longest ago (the ends first, which tell most about whether drafting pays at all)."""
        ends = (0, self.max_draft_len)
        at = self.lengths.index(best)
        neighbours = self.lengths[max(at - 1, 0) : at + 2]
        candidates = {*ends, *neighbours} - {best}
        return min(candidates, key=lambda j: (bucket.last_seen.get(j, -1), j not in ends, j))

    def _affordable_gap(self, values: dict[int, tuple[float, int]], best: int, k: int) -> int:
        """Rounds of `best` between probes of `k` for the time a probe loses, by the current estimates, to stay
        within `probe_budget` of the time in between. `values` are tokens per dense-step time; a probe's rounds
        commit `probe_rounds * E[τ(k)]` tokens, which `best` would have committed faster, and it switches twice."""
        if k not in values or best not in values or values[k][0] >= values[best][0]:
            return 0
        tokens = self.probe_rounds * self.mean_tokens(k, values[k][1])
        lost = tokens / values[k][0] - tokens / values[best][0] + SWITCH_COST  # in dense-step times
        best_round = self.mean_tokens(best, values[best][1]) / values[best][0]
        return math.ceil(lost / (self.probe_budget * best_round))

    def _bucket(self, key: tuple[int, int]) -> _BucketCosts:
        bucket = self.buckets.get(key)
        if bucket is None:
            # A new bucket (the batch shrank, contexts grew) starts from its nearest neighbour's choices and as
            # confident in them: where the neighbour's probes kept confirming them, the first probe here waits as
            # long. Except where the batch size differs and the neighbour's choice wins by less than
            # `NEIGHBOUR_RATIO_SPREAD`: a dense step and a round scale differently with rows (at a rollout's last
            # few rows both are launch-bound), so that choice may not hold here, and such a bucket (the tail) may
            # live too few rounds per call to reach the neighbour's gap. It probes after `min_probe_gap` rounds.
            gap, choice, interval, interval_gap = self.min_probe_gap, None, self.refresh_intervals[0], 0
            if self.buckets:
                nearest_key = min(self.buckets, key=lambda b: _distance(b, key))
                nearest = self.buckets[nearest_key]
                choice = nearest.choice
                if nearest_key[0] == key[0] or not self._near_break_even(key, choice):
                    gap = max(gap, nearest.probe_gap)
                interval, interval_gap = nearest.interval, nearest.interval_probe_gap
            interval_gap = max(self.min_probe_gap, interval_gap)
            bucket = self.buckets[key] = _BucketCosts(
                key=key, choice=choice, probe_gap=gap, next_probe=gap, interval=interval,
                interval_probe_gap=interval_gap, next_interval_probe=interval_gap,
            )
            self._nearest_buckets.clear()
            self._dense_floors.clear()
        return bucket

    def _near_break_even(self, key: tuple[int, int], choice: int | None) -> bool:
        """Whether another length comes within `NEIGHBOUR_RATIO_SPREAD` of `choice` by the estimates for `key`."""
        values = {k: value for k in self.lengths if (value := self._value(key, k)) is not None}
        if choice not in values:
            return True
        return any(value[0] * NEIGHBOUR_RATIO_SPREAD >= values[choice][0] for k, value in values.items() if k != choice)


def adaptive_for(
    max_draft_len: int, refresh_interval: int | None = None, lengths: tuple[int, ...] | None = None
) -> AdaptiveDraftLength:
    """The engine's adaptive rule over `lengths` (`S3RConfig.adaptive_draft_lengths`), by default a dense step or a
    full-length round. Every other length runs CUDA graphs of its own (a draft phase and a verify block per batch
    bucket), each capture costing dozens of rounds' worth of time in a call, for a gain over the nearer end that
    shows only where a draft pass costs nearly what the verify does. The refresh interval is `refresh_interval`, or
    chosen among `1..MAX_ADAPTIVE_REFRESH_INTERVAL` when None."""
    intervals = (refresh_interval,) if refresh_interval is not None else range(1, MAX_ADAPTIVE_REFRESH_INTERVAL + 1)
    lengths = (0, max_draft_len) if lengths is None else lengths
    return AdaptiveDraftLength(max_draft_len, lengths=lengths, refresh_intervals=tuple(intervals))
