"""The adaptive draft-length rule on a simulated rollout: how much slower than pure dense decoding (or faster) it is.

A rollout call of `--batch` responses, each of a sampled length (a share `--capped-share`, by default a fifth, run to
`--max-new-tokens`, the rest are uniform below it, as SmolLM2's MATH rollouts roughly do), decoded step by step: a
dense step costs `--dense-ms` and commits one token per running request, a drafting round costs `--round-ms` (or
`--tail-round-ms` while at most `--tail-rows` requests run: at a few rows both kinds of step are launch-bound, and
a round costs fewer dense steps than at many) and commits 1 + the drafts kept
(each with probability `--alpha` until the first rejection), a refresh step before drafting costs `--refresh-ms`,
and the first dense step after drafting `--switch-back-ms` more. `--lengths` lets the rule choose draft lengths
between 0 and `--draft-len` (the engine's rule chooses the two ends); a round of `k` costs `--round-ms` less
`--draft-pass-ms` for each pass short of `--draft-len`, and draft `j` is accepted with `--alpha` times
`--alpha-decay` to the `j - 1` (acceptance falls along a draft); with `--alpha-spread` each request has its own
`--alpha`, drawn uniformly within that distance of it, so the requests of a call advance at different rates. The
rule sees the round costs the engine would report (rounds that follow a round of the same length) and the
acceptance of every drafting round, and keeps what it learned from call to call, as the engine's kept state does.
Costs get ±10% noise. Two of the engine's timing artefacts can be added: `--probe-dense-ms` more for each of the
three dense steps after a drafting round (the rule's dense samples in probes from drafting ran high on the H200),
and `--first-dense-ms` more for the first dense step the rule times (a warm-up in the first call).

    python tools/simulate_policy.py --round-ms 7.9     # SmolLM2 B=64 in bf16: drafting near break-even
    python tools/simulate_policy.py --dense-ms 3 --round-ms 90 --batch 32 --max-new-tokens 4096   # fp32
    python tools/simulate_policy.py --dense-ms 3 --round-ms 20 --tail-rows 32 --tail-round-ms 11 --alpha 0.85 \
        --batch 256 --max-new-tokens 4096 --capped-share 0.02     # SmolLM2 B=256, bf16: drafting pays in the tail
    python tools/simulate_policy.py --dense-ms 5.5 --round-ms 22 --draft-pass-ms 2.6 --alpha 0.95 \
        --alpha-decay 0.97 --batch 32 --max-new-tokens 4096 --capped-share 0.45 --lengths 0,2,3,4,6   # fp32 GRPO
    python tools/simulate_policy.py --dense-ms 3.3 --round-ms 16.3 --tail-rows 8 --tail-round-ms 14.9 --alpha 0.95 \
        --alpha-decay 0.98 --batch 16 --max-new-tokens 4096 --capped-share 1 --alpha-spread 0.1  # rows that part
    python tools/simulate_policy.py --dense-ms 1.7 --round-ms 9.7 --alpha 0.95 --alpha-spread 0.05 \
        --capped-share 0.35 --probe-dense-ms 0.4 --first-dense-ms 1.4   # SmolLM2 bf16 B=64, near break-even
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3r_hf.draft_policy import RoundShape, adaptive_for  # noqa: E402

CATCH_UP_STEPS = 3
"""Dense steps after a drafting round that cost `--probe-dense-ms` more."""


def simulate(
    policy, lengths: list[int], alphas: list[float], args: argparse.Namespace, rng: random.Random,
    first_dense_ms: float = 0.0,
) -> tuple[float, int]:
    """Seconds of one call under `policy` (None: dense steps only), and the drafting rounds it ran; request `i` has
    `lengths[i]` tokens to commit and accepts each first draft with probability `alphas[i]`. The first dense step the
    rule times costs `first_dense_ms` more."""
    remaining, contexts = list(lengths), [args.prompt_len] * len(lengths)
    seconds, previous, stale, drafting = 0.0, None, True, 0
    since_drafting = CATCH_UP_STEPS  # dense steps since the last drafting round
    while remaining:
        shape = RoundShape(len(remaining), sum(contexts) // len(contexts))
        k = policy.choose(shape) if policy is not None else 0
        noise = 0.9 + 0.2 * rng.random()
        if k and stale:  # a refresh step first: a scored dense step
            seconds += args.refresh_ms / 1e3
            remaining = [r - 1 for r in remaining]
            contexts = [c + 1 for c in contexts]
            stale = False
        if k:
            round_ms = args.tail_round_ms if len(remaining) <= args.tail_rows else args.round_ms
            round_ms -= (args.draft_len - k) * args.draft_pass_ms
            cost = round_ms / 1e3 * noise
            kept = []
            for alpha in alphas:
                n = 0
                while n < k and rng.random() < alpha * args.alpha_decay**n:
                    n += 1
                kept.append(n)
            if args.observe == "lagging":  # only the requests with the most left to commit: those that end the call
                lagging = sorted(remaining)[len(remaining) // 2]
                seen = [n for r, n in zip(remaining, kept) if r >= lagging]
            else:
                seen = kept
            remaining = [r - n - 1 for r, n in zip(remaining, kept)]
            contexts = [c + n + 1 for c, n in zip(contexts, kept)]
            policy.observe_acceptance([k] * len(seen), seen)
            drafting += 1
            since_drafting = 0
        else:
            cost = args.dense_ms / 1e3 * noise + (args.switch_back_ms / 1e3 if previous else 0.0)
            if since_drafting < CATCH_UP_STEPS:
                cost += args.probe_dense_ms / 1e3
                since_drafting += 1
            if policy is not None and previous == 0 and first_dense_ms:
                cost, first_dense_ms = cost + first_dense_ms / 1e3, 0.0
            remaining = [r - 1 for r in remaining]
            contexts = [c + 1 for c in contexts]
            stale = True
        if policy is not None and previous == k:
            policy.observe_cost(shape, k, cost)
        previous, seconds = k, seconds + cost
        running = [i for i, r in enumerate(remaining) if r > 0]
        remaining, contexts = [remaining[i] for i in running], [contexts[i] for i in running]
        alphas = [alphas[i] for i in running]
    return seconds, drafting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dense-ms", type=float, default=1.8)
    parser.add_argument("--round-ms", type=float, default=10.0)
    parser.add_argument("--refresh-ms", type=float, default=2.6)
    parser.add_argument("--switch-back-ms", type=float, default=0.7)
    parser.add_argument("--probe-dense-ms", type=float, default=0.0,
                        help=f"what each of the {CATCH_UP_STEPS} dense steps after a drafting round costs more")
    parser.add_argument("--first-dense-ms", type=float, default=0.0,
                        help="what the first dense step the rule times costs more (first call)")
    parser.add_argument("--alpha", type=float, default=0.8)
    parser.add_argument("--alpha-spread", type=float, default=0.0,
                        help="each request's alpha is drawn uniformly from alpha ± this (at most 1)")
    parser.add_argument("--alpha-decay", type=float, default=1.0, help="draft j is accepted with alpha * decay^(j-1)")
    parser.add_argument("--draft-pass-ms", type=float, default=0.0,
                        help="what a round saves per draft pass short of --draft-len (with --lengths)")
    parser.add_argument("--lengths", default=None,
                        help="draft lengths the rule may choose, e.g. 0,2,4,6 (default: 0 and --draft-len)")
    parser.add_argument("--observe", choices=["all", "lagging"], default="all",
                        help="the requests whose acceptance the rule sees: all (the engine's rule), or the half with "
                        "the most tokens left (a rule that weighs the requests that end the call; it knows the "
                        "lengths, which the engine does not)")
    parser.add_argument("--draft-len", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--tail-rows", type=int, default=0)
    parser.add_argument("--tail-round-ms", type=float, default=None, help="default: --round-ms")
    parser.add_argument("--capped-share", type=float, default=0.2,
                        help="share of the responses that run to --max-new-tokens")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--switch-margin", type=float, default=None,
                        help="AdaptiveDraftLength.switch_margin (default: the rule's own)")
    parser.add_argument("--probe-budget", type=float, default=None,
                        help="AdaptiveDraftLength.probe_budget (default: the rule's own)")
    args = parser.parse_args()
    if args.tail_round_ms is None:
        args.tail_round_ms = args.round_ms
    rng = random.Random(args.seed)
    lengths = None if args.lengths is None else tuple(int(k) for k in args.lengths.split(","))
    policy = adaptive_for(args.draft_len, lengths=lengths)
    if args.switch_margin is not None:
        policy.switch_margin = args.switch_margin
    if args.probe_budget is not None:
        policy.probe_budget = args.probe_budget
    for call in range(args.calls):
        lengths = [
            args.max_new_tokens if rng.random() < args.capped_share else rng.randint(100, args.max_new_tokens - 200)
            for _ in range(args.batch)
        ]
        alphas = [min(1.0, args.alpha + args.alpha_spread * (2 * rng.random() - 1)) for _ in lengths]
        adaptive, drafting = simulate(policy, lengths, alphas, args, rng, args.first_dense_ms if call == 0 else 0.0)
        dense, _ = simulate(None, lengths, alphas, args, rng)
        print(f"call {call + 1}: adaptive {adaptive:.3f} s, dense {dense:.3f} s, adaptive ÷ dense speed "
              f"{dense / adaptive:.3f}, drafting rounds {drafting}")


if __name__ == "__main__":
    main()
