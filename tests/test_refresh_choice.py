"""The adaptive rule's refresh interval on synthetic costs and acceptance (no model: the rule alone).

A drafting round's time is its drafts and verify, plus the score material when it refreshes the views, plus the
view update the round before it queued: a rebuild (top-K) after a refresh, an extension otherwise. Acceptance
depends on how many rounds old the views are.
"""

from __future__ import annotations

import random

import pytest

from s3r_hf.draft_policy import AdaptiveDraftLength, FixedDraftLength, RoundShape, ScriptedDraftLength, adaptive_for
from tests.test_draft_policy import kept_drafts

SHAPE = RoundShape(rows=64, context=8192)


def _drive(policy, alphas: list[float], rounds: int, dense: float = 1.0, round_base: float = 3.0,
           scored: float = 0.3, rebuild: float = 0.3, seed: int = 0):
    """Run `rounds` rounds as the engine would. A dense step costs `dense`; a drafting round `round_base`, plus
    `scored` when it refreshes and `rebuild` when the round before it refreshed. Drafts over views `age` rounds old
    are kept with probability `alphas[min(age, -1)]` each, until the first rejection. After dense steps the views
    are stale: the next drafting round is preceded by a refresh step (not costed). Returns the (k, refreshes, age)
    of every round."""
    rng = random.Random(seed)
    history = []
    previous_k, previous_refreshed, age, stale = None, False, 0, True
    for _ in range(rounds):
        k = policy.choose(SHAPE)
        if k and stale:  # a refresh step: a scored dense step; the round after it drafts over fresh views
            previous_k, previous_refreshed, age, stale = 0, True, 0, False
        refreshes = bool(k) and policy.refresh_due(SHAPE, k, age)
        if k:
            seconds = round_base + (scored if refreshes else 0.0) + (rebuild if previous_refreshed else 0.0)
        else:
            seconds = dense
        if previous_k == k:
            policy.observe_cost(SHAPE, k, seconds, refreshes, previous_refreshed)
        if k:
            alpha = alphas[min(age, len(alphas) - 1)]
            policy.observe_acceptance([k] * 64, [kept_drafts(rng, k, alpha) for _ in range(64)], age)
        history.append((k, refreshes, age))
        previous_k, previous_refreshed = k, refreshes
        if k:
            age = 0 if refreshes else age + 1
        else:
            stale = True
    return history


def _intervals(history) -> list[int]:
    """The lengths of the refresh cycles that ran (rounds from one refresh to the next, inclusive)."""
    cycles, length = [], 0
    for k, refreshes, _ in history:
        if not k:
            length = 0
            continue
        length += 1
        if refreshes:
            cycles.append(length)
            length = 0
    return cycles


def test_refreshes_that_cost_much_while_old_views_draft_as_well_are_spaced_out():
    policy = adaptive_for(6)
    history = _drive(policy, alphas=[0.93], rounds=1500)
    cycles = _intervals(history[500:])
    assert policy.buckets[SHAPE.bucket].interval == 4
    assert cycles.count(4) >= 0.8 * len(cycles)
    assert all(k == 6 for k, _, _ in history[-200:])


def test_views_that_age_fast_are_refreshed_every_round():
    policy = adaptive_for(6)
    history = _drive(policy, alphas=[0.93, 0.6], rounds=1500)
    cycles = _intervals(history[500:])
    assert policy.buckets[SHAPE.bucket].interval == 1
    assert cycles.count(1) >= 0.9 * len(cycles)


def test_free_refreshes_are_run_every_round():
    policy = adaptive_for(6)
    history = _drive(policy, alphas=[0.93, 0.92, 0.91], rounds=1500, scored=0.0, rebuild=0.0)
    assert policy.buckets[SHAPE.bucket].interval == 1
    assert _intervals(history[500:]).count(1) >= 0.9 * len(_intervals(history[500:]))


def test_an_intermediate_interval_wins_where_costs_and_acceptance_say_so():
    # Mean E[τ(6)] per round over time per round, refreshing costing 0.6 of a 3.0 round: interval 1: 5.80 / 3.6
    # = 1.61; 2: (5.80 + 5.55) / 2 / 3.3 = 1.72; 3: (5.80 + 5.55 + 3.47) / 3 / 3.2 = 1.54.
    policy = adaptive_for(6)
    history = _drive(policy, alphas=[0.93, 0.92, 0.75, 0.7], rounds=3000)
    assert policy.buckets[SHAPE.bucket].interval == 2
    cycles = _intervals(history[1000:])
    assert cycles.count(2) >= 0.8 * len(cycles)
    # Probes of the neighbouring intervals keep running now and then.
    assert {1, 3} <= set(cycles)


def test_drafting_that_loses_is_not_rescued_by_longer_intervals():
    # A drafting round costs seven dense steps for ~5.8 tokens, and skipping every refresh saves only 0.6 of them.
    policy = adaptive_for(6)
    history = _drive(policy, alphas=[0.93], rounds=1500, round_base=7.0)
    assert [k for k, _, _ in history[-300:]].count(0) >= 290


def test_round_costs_by_refresh_pattern():
    policy = adaptive_for(6)
    for _ in range(3):
        policy.observe_cost(SHAPE, 0, 1.0)
        policy.observe_cost(SHAPE, 6, 4.0, refreshes=True, follows_refresh=True)
    bucket = policy.buckets[SHAPE.bucket]
    assert bucket.round_cost(6, 1) == 4.0
    assert bucket.round_cost(6, 2) is None  # no extending round measured yet
    policy.observe_cost(SHAPE, 6, 3.5, refreshes=False, follows_refresh=True)
    # Unmeasured patterns are taken from ones that cost at least as much.
    assert bucket.round_cost(6, 2) == pytest.approx((4.0 + 3.5) / 2)
    assert bucket.round_cost(6, 3) == pytest.approx((4.0 + 3.5 + 3.5) / 3)
    policy.observe_cost(SHAPE, 6, 3.7, refreshes=True, follows_refresh=False)
    policy.observe_cost(SHAPE, 6, 3.0, refreshes=False, follows_refresh=False)
    assert bucket.round_cost(6, 3) == pytest.approx((3.7 + 3.5 + 3.0) / 3)
    assert bucket.round_cost(0, 3) == 1.0
    # A dense step has no refresh pattern, whatever it is reported with.
    policy.observe_cost(SHAPE, 0, 1.0, refreshes=True, follows_refresh=True)
    assert (0, True, True) not in bucket.medians


def test_acceptance_by_view_age_falls_back_on_the_younger_age():
    policy = AdaptiveDraftLength(2, prior_weight=1.0, acceptance_decay=1.0, refresh_intervals=(1, 2, 3))
    policy.observe_acceptance([2] * 4, [2, 2, 2, 2], age=0)
    assert policy.acceptance(0) == pytest.approx([(4 + 0.7) / 5] * 2)
    assert policy.acceptance(1) == pytest.approx(policy.acceptance(0))  # nothing seen at age 1: no decline assumed
    policy.observe_acceptance([2] * 4, [0, 0, 0, 0], age=1)
    first = (0 + policy.acceptance(0)[0]) / 5
    assert policy.acceptance(1) == pytest.approx([first, policy.acceptance(0)[1]])
    assert policy.acceptance(2) == policy.acceptance(5) == pytest.approx(policy.acceptance(1))
    assert policy.mean_tokens(2, 2) == pytest.approx((policy.expected_tokens(2, 0) + policy.expected_tokens(2, 1)) / 2)


def test_fixed_and_scripted_refreshes():
    every_third = FixedDraftLength(4, refresh_interval=3)
    assert [every_third.refresh_due(SHAPE, 4, age) for age in range(4)] == [False, False, True, True]
    assert FixedDraftLength(4).refresh_due(SHAPE, 4, 0)
    scripted = ScriptedDraftLength([3], refreshes=[False, True, True])
    assert [scripted.refresh_due(SHAPE, 3, 0) for _ in range(5)] == [False, True, True, False, True]
    assert adaptive_for(6, refresh_interval=2).refresh_intervals == (2,)
    with pytest.raises(ValueError, match="refresh_intervals"):
        AdaptiveDraftLength(6, refresh_intervals=(0, 2))
    with pytest.raises(ValueError, match="refreshes"):
        ScriptedDraftLength([3], refreshes=[])


def test_probes_from_dense_decoding_refresh_every_round():
    """Where drafting loses, the rule decodes densely and probes drafting now and then: every such round refreshes
    the views. Extending rounds there would need CUDA graphs of their own, which a later call with every other graph
    kept would capture for a probe that rarely changes the choice."""
    policy = adaptive_for(6)
    history = _drive(policy, alphas=[0.93], rounds=6000, round_base=7.0)
    drafting = [refreshes for k, refreshes, _ in history if k]
    assert len(drafting) >= 10 and all(drafting)
    assert [k for k, _, _ in history[-300:]].count(0) >= 290
