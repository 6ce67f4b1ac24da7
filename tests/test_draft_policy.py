"""The adaptive draft-length rule on synthetic costs and acceptance (no model: the rule alone)."""

from __future__ import annotations

import random

import pytest

from s3r_hf.draft_policy import AdaptiveDraftLength, FixedDraftLength, RoundShape, ScriptedDraftLength

SHAPE = RoundShape(rows=64, context=4096)


def kept_drafts(rng: random.Random, k: int, alpha: float | list[float]) -> int:
    """Drafts kept of `k`, each with probability `alpha` (draft `j`: `alpha[j - 1]` for a list), until the first
    rejection."""
    kept = 0
    while kept < k and rng.random() < (alpha[kept] if isinstance(alpha, list) else alpha):
        kept += 1
    return kept


def _drive(
    policy: AdaptiveDraftLength, cost, alpha: float | list[float], rounds: int, shape: RoundShape = SHAPE, seed: int = 0
):
    """Run `rounds` rounds as the engine would: choose k, then report its cost (only when the round before had the
    same k) and (for k > 0) 64 requests' acceptance tests, each draft kept with probability `alpha` until the first
    rejection. Returns the choices."""
    rng = random.Random(seed)
    choices = []
    for _ in range(rounds):
        k = policy.choose(shape)
        if choices and choices[-1] == k:
            policy.observe_cost(shape, k, cost(k))
        choices.append(k)
        if k > 0:
            policy.observe_acceptance([k] * 64, [kept_drafts(rng, k, alpha) for _ in range(64)])
    return choices


def test_drafts_that_cost_more_than_they_return_are_not_drafted():
    # A draft pass costs a dense step (a launch-bound small model): 7 forwards per round for ~3.7 tokens.
    policy = AdaptiveDraftLength(6)
    choices = _drive(policy, lambda k: 1.0 + 1.0 * k, alpha=0.8, rounds=1000)
    assert policy.best(SHAPE.bucket) == 0
    assert choices[-100:].count(0) >= 95
    # Probes back off: after the first rounds, drafting rounds are a small share of the whole.
    assert sum(1 for k in choices[50:] if k > 0) / len(choices[50:]) < 0.03


def test_cheap_drafts_are_drafted_at_full_length():
    policy = AdaptiveDraftLength(6)
    choices = _drive(policy, lambda k: 1.0 + 0.05 * k, alpha=0.9, rounds=500)
    assert policy.best(SHAPE.bucket) == 6
    assert choices[-100:].count(6) >= 95


def test_an_intermediate_length_wins_where_costs_and_acceptance_say_so():
    # E[τ(k)] / cost(k) with α = 0.7 and cost 1 + 0.3 k: 1, 1.31, 1.37, 1.33, ... -> k = 2.
    policy = AdaptiveDraftLength(6)
    _drive(policy, lambda k: 1.0 + 0.3 * k, alpha=0.7, rounds=2000)
    assert policy.best(SHAPE.bucket) == 2


def test_expected_tokens_follow_the_observed_conditional_acceptance():
    policy = AdaptiveDraftLength(3, prior_weight=0.0, acceptance_decay=1.0)
    # Ten requests drafted 3: four kept all, three kept one, three kept none.
    policy.observe_acceptance([3] * 10, [3] * 4 + [1] * 3 + [0] * 3)
    # Position 1: reached by 10, passed by 7; position 2: reached by 7, passed by 4; position 3: 4 of 4.
    assert policy.acceptance() == pytest.approx([0.7, 4 / 7, 1.0])
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.7 + 0.4 + 0.4)


def test_a_new_bucket_starts_from_its_neighbours_estimate():
    policy = AdaptiveDraftLength(6)
    _drive(policy, lambda k: 1.0 + 1.0 * k, alpha=0.8, rounds=300)
    # The tail of a rollout: fewer rows than any bucket measured so far. The neighbour says dense; no probe yet.
    tail = RoundShape(rows=3, context=4096)
    assert policy.choose(tail) == 0


def test_a_new_bucket_of_fewer_rows_probes_soon_and_one_of_longer_contexts_waits():
    """Drafting narrowly loses at 64 rows, so probes there grow far apart. At a rollout's tail (3 rows) a round
    costs fewer dense steps: the tail's bucket probes within `min_probe_gap` rounds and finds it, where the
    neighbour's gap would outlast the tail. Contexts growing at the same rows keep the neighbour's confidence."""
    costs = {SHAPE.bucket: lambda k: TOKENS / 0.8 if k else 1.0}
    tail, longer = RoundShape(rows=3, context=4096), RoundShape(rows=64, context=8192)
    costs[tail.bucket] = lambda k: TOKENS / 1.5 if k else 1.0
    costs[longer.bucket] = costs[SHAPE.bucket]
    for shape, drafts in ((tail, True), (longer, False)):
        policy = AdaptiveDraftLength(6, lengths=(0, 6))
        _drive(policy, costs[SHAPE.bucket], alpha=ALPHA, rounds=3000)
        assert policy.buckets[SHAPE.bucket].probe_gap > 100
        choices = _drive(policy, costs[shape.bucket], alpha=ALPHA, rounds=60, shape=shape, seed=1)
        assert (choices[-20:].count(6) >= 18) if drafts else (choices.count(6) == 0), shape


def test_costs_ignore_a_single_outlier():
    policy = AdaptiveDraftLength(6)
    for seconds in (2.0, 50.0, 2.2, 1.8):  # a recompilation slipped into one sample
        policy.observe_cost(SHAPE, 6, seconds)
    policy.observe_cost(SHAPE, 0, 1.0)
    assert policy.cost_ratio(SHAPE.bucket, 6) == pytest.approx(2.0 / 1.0)


def test_a_dense_step_costs_the_least_of_its_samples():
    """Dense probes between drafting rounds pay for the pipeline catching up; their cost is their floor, so that an
    inflated dense cost does not make drafting look better than it is."""
    policy = AdaptiveDraftLength(6)
    for seconds in (1.3, 1.0, 1.4, 1.35, 50.0):
        policy.observe_cost(SHAPE, 0, seconds)
    policy.observe_cost(SHAPE, 6, 4.0)
    assert policy.cost_ratio(SHAPE.bucket, 6) == pytest.approx(4.0 / 1.0)


def test_a_dense_step_costs_no_more_than_in_a_bucket_of_more_rows_and_longer_contexts():
    """A bucket that drafts times its dense steps only in probes between drafting rounds, where they cost more than
    in a run of them; a bucket of more rows and longer contexts that decoded densely bounds them. By its own dense
    samples drafting wins here by 1.5x; by the bound it loses."""
    policy = AdaptiveDraftLength(6, lengths=(0, 6), prior_weight=0.0)
    policy.observe_acceptance([6] * 10, [6] * 10)  # 7 tokens a round
    drafting = RoundShape(rows=20, context=1000)
    for _ in range(3):
        policy.observe_cost(drafting, 0, 2.0)
        policy.observe_cost(drafting, 6, 9.3)
    assert policy.best(drafting.bucket) == 6
    policy.observe_cost(RoundShape(rows=20, context=300), 0, 1.0)  # shorter contexts bound nothing
    policy.observe_cost(RoundShape(rows=8, context=4000), 0, 1.0)  # nor do fewer rows
    assert policy.cost_ratio(drafting.bucket, 6) == pytest.approx(9.3 / 2.0)
    policy.observe_cost(RoundShape(rows=64, context=1500), 0, 1.5)
    assert policy.cost_ratio(drafting.bucket, 6) == pytest.approx(9.3 / 1.5)
    assert policy.best(drafting.bucket, current=6) == 6  # 7 tokens for 6.2 steps' time
    policy.observe_cost(RoundShape(rows=40, context=2500), 0, 1.2)
    assert policy.best(drafting.bucket, current=6) == 0  # 7 tokens for 7.75 steps' time


def test_the_first_bucket_times_several_dense_steps_before_it_drafts():
    """A single dense sample may hold a warm-up's work (twice a dense step's time here), which would make drafting
    look better than it is; the first bucket times `first_dense_samples` dense steps (the first step of a run is
    not timed) before its first drafting round, and their least is the cost."""
    policy = AdaptiveDraftLength(6, lengths=(0, 6))
    costs = iter([2.0, 1.0, 1.0] + [1.0] * 1000)
    choices = _drive(policy, lambda k: next(costs) if k == 0 else TOKENS / 1.1, alpha=ALPHA, rounds=200)
    assert choices[:5] == [0, 0, 0, 0, 6]
    assert choices[-100:].count(0) >= 95  # drafting would gain 10%, within the switch margin
    # A rule that keeps fewer samples than that drafts once it holds as many as it keeps.
    choices = _drive(AdaptiveDraftLength(6, lengths=(0, 6), samples=2), lambda k: 1.0, alpha=ALPHA, rounds=10)
    assert choices[:4] == [0, 0, 0, 6]


def test_fixed_and_scripted_lengths():
    assert FixedDraftLength(4).choose(SHAPE) == 4
    scripted = ScriptedDraftLength([2, 0, 1])
    assert [scripted.choose(SHAPE) for _ in range(5)] == [2, 0, 1, 2, 0]
    with pytest.raises(ValueError, match="draft lengths"):
        ScriptedDraftLength([])
    with pytest.raises(ValueError, match="max_draft_len"):
        AdaptiveDraftLength(0)


def test_round_shapes_bucket_by_powers_of_two():
    assert RoundShape(64, 4096).bucket == RoundShape(40, 5000).bucket
    assert RoundShape(64, 4096).bucket != RoundShape(65, 4096).bucket
    assert RoundShape(1, 0).bucket == (0, 0)


def test_the_engine_rule_chooses_between_a_dense_step_and_a_full_round():
    from s3r_hf.draft_policy import adaptive_for

    policy = adaptive_for(6)
    choices = _drive(policy, lambda k: 1.0 + 0.3 * k, alpha=0.7, rounds=300)
    assert set(choices) <= {0, 6}
    with pytest.raises(ValueError, match="must include 0"):
        AdaptiveDraftLength(6, lengths=(1, 6))


def test_the_engine_rule_takes_the_configured_lengths_and_probes_the_next_one_up_or_down():
    from s3r_hf.draft_policy import adaptive_for

    # α falling along the draft and a pass costing nearly what the verify does (float32 at a few rows): the
    # middle length commits the most tokens per unit of time, E[τ(3)] / cost(3) against E[τ(6)] / cost(6).
    alphas = [0.92 * 0.96**j for j in range(6)]
    cost = lambda k: 1.0 if k == 0 else 1.2 + 0.47 * k  # noqa: E731
    choices = _drive(adaptive_for(6, lengths=(0, 3, 6)), cost, alphas, rounds=1500)
    assert set(choices) == {0, 3, 6}
    assert choices[-300:].count(3) >= 270
    # With every even length: it settles on 4 (4: 1.29, 2: 1.28, 6: 1.18 tokens per dense-step time) and goes on
    # probing both neighbours of its choice in the configured set, not the lengths one up and down (3 and 5). A
    # probe of 6 from 4 loses little, so it waits long: 3,000 rounds hold a few.
    policy = adaptive_for(6, lengths=(0, 2, 4, 6))
    choices = _drive(policy, cost, alphas, rounds=3000)
    assert policy.best(SHAPE.bucket) in (2, 4)
    after = choices[choices.index(policy.best(SHAPE.bucket)):]
    assert {0, 2, 4, 6} == set(after)


def test_drafting_that_barely_pays_does_not_replace_dense_decoding():
    """Switching to drafting costs a refresh step and overlap, and requests that accept at different rates part; a
    gain within `switch_margin` (20%) is not worth it."""
    from s3r_hf.draft_policy import adaptive_for

    alpha = 0.8
    tokens = 1 + sum(alpha**i for i in range(1, 7))  # E[τ(6)] at this acceptance
    barely = adaptive_for(6)
    choices = barely_choices = _drive(barely, lambda k: tokens / 1.15 if k else 1.0, alpha=alpha, rounds=600)
    assert choices[-200:].count(0) >= 190
    clearly = adaptive_for(6)
    choices = _drive(clearly, lambda k: tokens / 1.35 if k else 1.0, alpha=alpha, rounds=600)
    assert choices[-200:].count(6) >= 190
    report = clearly.report()
    assert report and report[0]["choice"] == 6 and set(report[0]["seconds"]) == {0, 6}
    # The report counts the probes started in a bucket: every switch from dense decoding to drafting but the first,
    # which measures drafting before any choice is made.
    probes = barely.report()[0]["probes"]
    assert probes > 0 and probes == _probe_starts(barely_choices) - 1


def test_drafting_goes_on_while_it_wins_by_half_the_switch_margin():
    """Drafting must promise `switch_margin` (20%) more tokens per second to replace dense decoding, and half of it
    to go on: a 15% gain keeps a bucket drafting but does not start it, a 5% gain stops it."""
    policy = AdaptiveDraftLength(6, lengths=(0, 6), prior_weight=0.0)
    policy.observe_acceptance([6] * 10, [6] * 10)  # 7 tokens a round
    policy.observe_cost(SHAPE, 0, 1.0)
    policy.observe_cost(SHAPE, 6, 7 / 1.15)
    assert policy.best(SHAPE.bucket, current=0) == 0
    assert policy.best(SHAPE.bucket, current=None) == 0
    assert policy.best(SHAPE.bucket, current=6) == 6
    policy.observe_cost(SHAPE, 6, 7 / 1.05)
    policy.observe_cost(SHAPE, 6, 7 / 1.05)
    assert policy.best(SHAPE.bucket, current=6) == 0


ALPHA = 0.8
TOKENS = 1 + sum(ALPHA**i for i in range(1, 7))  # E[τ(6)] when each draft is kept with probability ALPHA




def _probe_starts(choices: list[int]) -> int:
    return sum(1 for before, now in zip(choices, choices[1:]) if before == 0 and now > 0)


@pytest.mark.parametrize("name, cost, drafts", [
    ("loses a little", lambda k: TOKENS / 0.95 if k else 1.0, False),
    ("loses", lambda k: 1.0 + 1.0 * k, False),
    ("loses thirtyfold", lambda k: 30.0 if k else 1.0, False),  # fp32 on a launch-bound model
    ("wins", lambda k: TOKENS / 1.5 if k else 1.0, True),
])
def test_probes_cost_about_the_probe_budget(name, cost, drafts):
    """Probes of the losing length are spaced so that, by the estimates, they lose about `probe_budget` (0.5%) of
    the time: past the first rounds, the rule's time per token stays within 1.5% of always choosing the winner."""
    from s3r_hf.draft_policy import adaptive_for

    choices = _drive(adaptive_for(6), cost, alpha=ALPHA, rounds=3000)
    assert choices[-500:].count(6 if drafts else 0) >= 490, name
    steady = choices[20:]
    tokens = sum(TOKENS if k else 1.0 for k in steady)
    best = min(cost(0), cost(6) / TOKENS)
    assert sum(cost(k) for k in steady) / tokens <= 1.015 * best, name
    if name == "loses thirtyfold":  # a probe would cost ~80 dense steps: none is worth it within 3,000 rounds
        assert _probe_starts(steady) == 0


def test_choices_follow_new_observations():
    """The medians, expected tokens and neighbour lists are cached; each observation must still reach the choice."""
    policy = AdaptiveDraftLength(6, lengths=(0, 6))
    for _ in range(3):
        policy.observe_cost(SHAPE, 0, 1.0)
        policy.observe_cost(SHAPE, 6, 2.0)
    policy.observe_acceptance([6] * 10, [6] * 10)
    assert policy.best(SHAPE.bucket) == 6  # ~6.6 tokens for two steps' time
    for _ in range(3):  # drafts got dearer: the median moves
        policy.observe_cost(SHAPE, 6, 20.0)
    assert policy.best(SHAPE.bucket) == 0
    for _ in range(5):
        policy.observe_cost(SHAPE, 6, 2.0)
    assert policy.best(SHAPE.bucket) == 6
    policy.observe_acceptance([6] * 1000, [0] * 1000)  # then nothing is accepted any more
    assert policy.best(SHAPE.bucket) == 0
    # A bucket added later is found as a neighbour of one measured earlier.
    tail = RoundShape(rows=2, context=4096)
    assert policy.cost_ratio(tail.bucket, 6) == pytest.approx(2.0)
    policy.observe_cost(tail, 0, 1.0)
    policy.observe_cost(tail, 6, 9.0)
    assert policy.cost_ratio(tail.bucket, 6) == pytest.approx(9.0)


def test_a_bucket_reviews_its_choice_every_review_rounds(monkeypatch):
    """Between reviews a choice costs no comparison of estimates; at the next review new evidence takes effect."""
    policy = AdaptiveDraftLength(6, lengths=(0, 6), review_rounds=8, min_probe_gap=1000)
    for _ in range(3):
        policy.observe_cost(SHAPE, 0, 1.0)
        policy.observe_cost(SHAPE, 6, 20.0)
    policy.observe_acceptance([6] * 10, [6] * 10)
    reviews = []
    best = AdaptiveDraftLength._best
    monkeypatch.setattr(AdaptiveDraftLength, "_best", lambda self, *a: reviews.append(1) or best(self, *a))
    assert policy.choose(SHAPE) == 0 and len(reviews) == 1  # the bucket's first choice: reviewed at once
    for _ in range(5):  # drafts got cheap
        policy.observe_cost(SHAPE, 6, 2.0)
    assert [policy.choose(SHAPE) for _ in range(7)] == [0] * 7 and len(reviews) == 1
    assert policy.choose(SHAPE) == 6 and len(reviews) == 2  # the eighth round after the first: reviewed


def test_new_buckets_keep_the_choice_their_neighbours_learned():
    """Contexts grow through many buckets in a long rollout. Where drafting loses thirtyfold, a bucket met for the
    first time starts from its neighbour's choice and probe gap instead of probing drafting again within a few
    rounds (each such probe costs ~80 dense steps)."""
    from s3r_hf.draft_policy import adaptive_for

    policy = adaptive_for(6)
    rng = random.Random(0)
    choices = []
    for context in range(64, 64 + 4000):  # a new context bucket at every doubling
        shape = RoundShape(rows=24, context=context)
        k = policy.choose(shape)
        if choices and choices[-1] == k:
            policy.observe_cost(shape, k, 30.0 if k else 1.0)
        choices.append(k)
        if k:
            policy.observe_acceptance([k] * 24, [kept_drafts(rng, k, ALPHA) for _ in range(24)])
    assert len(policy.buckets) >= 6
    assert _probe_starts(choices[20:]) == 0
