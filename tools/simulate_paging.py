"""The engine's paging on a simulated long rollout: pages moved per 1K tokens and rows per round, in seconds on a CPU.

Drives the engine's own `Scheduler` (admission, AIMD, pausing and restoring) and `S3RCache` page bookkeeping with
no model: a prefill step takes each admitted prompt whole, and a round commits, for every running request, one
token plus the drafts kept (each kept with probability `--acceptance` until the first rejection, as the benchmarks'
forced acceptance does). With `--probe-every N` rounds are dense steps (k = 0) but for a probe of three drafting
rounds every N, as the adaptive rule decodes where drafting does not pay. Response lengths are drawn as
`tools/kv_pressure.py`'s EOS set makes them: geometric around `--mean-length`, capped at `--max-new-tokens`. The
pool is `--pool-fraction` of the peak KV of a run at the fixed limit `--concurrency-max` with a pool that holds
everything, as `kv_pressure.py` sizes it.

Pages moved are the paper's measure (offloaded plus restored) and do not depend on the device; rows per round stand
in for throughput (the GPU run, `gpu kv-pressure`, is the judge of that). Several seeds, since a run has only a
handful of pause episodes and the spread between seeds is as large as most rule changes.

    python tools/simulate_paging.py --seeds 8        # the Table 2 workload of docs/benchmarks.md
    python tools/simulate_paging.py --seeds 4 --warm --fixed 160 --probe-every 300   # adaptive k, dense there
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3r_hf.cache.s3r_cache import S3RCache  # noqa: E402
from s3r_hf.config import S3RConfig  # noqa: E402
from s3r_hf.engine.kv_forecast import KVForecast  # noqa: E402
from s3r_hf.engine.scheduler import Scheduler  # noqa: E402
from s3r_hf.request import Request, RequestStatus  # noqa: E402
from s3r_hf.stats import S3RStats  # noqa: E402

PROBE_ROUNDS = 3  # AdaptiveDraftLength.probe_rounds
# One layer of one KV head of width one: the pages are counted, their contents never read.
TINY_KV = LlamaConfig(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, hidden_size=1, head_dim=1)


def response_lengths(args: argparse.Namespace, rng: random.Random) -> list[int]:
    """Geometric lengths around the mean (an EOS hit with probability 1 / mean per token), capped."""
    p = 1.0 / args.mean_length
    lengths = []
    for _ in range(args.requests):
        length = 1
        while length < args.max_new_tokens and rng.random() >= p:
            length += 1
        lengths.append(length)
    return lengths


def simulate(
    config: S3RConfig, lengths: list[int], num_pages: int, args: argparse.Namespace, seed: int,
    forecast: KVForecast | None = None,
) -> dict:
    """One rollout call of `lengths` under `config` with a pool of `num_pages`; its paging figures. `forecast`: the
    response-length model kept from earlier calls, as the engine's runtime keeps it (none: a cold start)."""
    rng = random.Random(seed)
    cache = S3RCache(TINY_KV, num_pages, config.page_size, max_requests=config.concurrency_max + 1)
    stats = S3RStats()
    scheduler = Scheduler(cache, config, stats, forecast)
    requests = [
        Request(row, torch.zeros(args.prompt_len, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1,
                args.max_new_tokens)
        for row in range(len(lengths))
    ]
    ends = {request.row: length for request, length in zip(requests, lengths)}  # where each samples its EOS
    scheduler.add(requests)
    rounds, rows = 0, 0
    while scheduler.has_work():
        probing = args.probe_every is None or rounds % args.probe_every < PROBE_ROUNDS
        k = config.draft_len if probing else 0
        step = scheduler.schedule()
        prefilling = step.prefilling if step.kind == "mixed" else step.requests if step.kind == "prefill" else []
        for request in prefilling:  # the whole prompt in one step, then its first token
            cache.reserve(request.slot, request.prompt_len)
            cache.set_length(request.slot, request.prompt_len)
            request.prefilled = request.committed = request.prompt_len
            request.generated.append(0)
            if len(request.generated) >= ends[request.row]:
                request.status = RequestStatus.FINISHED
        if step.kind != "prefill":
            decoding = step.requests if step.kind == "mixed" else scheduler.running
            decoding = [r for r in decoding if r.status is RequestStatus.RUNNING]
            if decoding:
                scheduler.make_room_for_round(decoding, lambda r, k=k: k)
                rounds += 1
                rows += len(decoding)
            for request in decoding:
                kept = 0
                while kept < k and rng.random() < args.acceptance:
                    kept += 1
                new = min(kept + 1, ends[request.row] - len(request.generated))
                request.committed += new
                request.generated.extend([0] * new)
                cache.set_length(request.slot, request.committed, release_pages=False)
                if len(request.generated) >= ends[request.row]:
                    request.status = RequestStatus.FINISHED
        scheduler.finish_step()
    stats.committed = sum(lengths)
    return {
        "pages_per_1k": stats.pages_moved_per_1k_tokens,
        "episodes": stats.offload_episodes,
        "rounds": rounds,
        "rows_per_round": rows / max(rounds, 1),
        "peak_pages": stats.peak_kv_pages,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--mean-length", type=int, default=768)
    parser.add_argument("--max-new-tokens", type=int, default=2048)
    parser.add_argument("--acceptance", type=float, default=0.93)
    parser.add_argument("--pool-fraction", type=float, default=0.5)
    parser.add_argument("--concurrency-min", type=int, default=160)
    parser.add_argument("--concurrency-max", type=int, default=256)
    parser.add_argument("--fixed", default="128,160,256", help="fixed concurrency limits to run as well")
    parser.add_argument("--probe-every", type=int, default=None,
                        help="dense steps but for three drafting rounds every this many (default: draft every round)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--warm", action="store_true",
                        help="also AIMD runs whose length forecast was kept from a call before (an RL loop's steps)")
    parser.add_argument("--admission-sigmas", default=str(S3RConfig.admission_sigmas),
                        help="S3RConfig.admission_sigmas of the AIMD runs, comma-separated to compare several")
    args = parser.parse_args()
    base = S3RConfig(concurrency_min=args.concurrency_min, concurrency_max=args.concurrency_max)
    runs = {f"fixed {c}": replace(base, concurrency_min=c, concurrency_max=c) for c in map(int, args.fixed.split(","))}
    for sigmas in map(float, args.admission_sigmas.split(",")):
        runs[f"AIMD z={sigmas:g}"] = replace(base, admission_sigmas=sigmas)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for seed in range(args.seeds):
        lengths = response_lengths(args, random.Random(seed))
        high = args.concurrency_max
        ample = simulate(replace(base, concurrency_min=high, concurrency_max=high), lengths, 10**6, args, seed)
        num_pages = max(1, round(args.pool_fraction * ample["peak_pages"]))
        for name, config in runs.items():
            results[name].append(simulate(config, lengths, num_pages, args, seed))
            if args.warm and name.startswith("AIMD"):  # the call after one of other responses, as in an RL loop
                forecast = KVForecast(config.page_size)
                earlier = response_lengths(args, random.Random(seed + 10_000))
                simulate(config, earlier, num_pages, args, seed + 10_000, forecast)
                results.setdefault(f"{name}, warm", []).append(
                    simulate(config, lengths, num_pages, args, seed, forecast)
                )
    print(f"{args.requests} requests, mean length {args.mean_length} (cap {args.max_new_tokens}), pool "
          f"{args.pool_fraction:.0%} of the ample peak, {args.seeds} seeds")
    print(f"{'run':<22} {'pages/1K mean':>14} {'median':>7} {'max':>7} {'episodes':>9} {'rows/round':>11} "
          f"{'rounds':>7}")
    for name, records in results.items():
        pages = [r["pages_per_1k"] for r in records]
        print(f"{name:<22} {statistics.mean(pages):>14.2f} {statistics.median(pages):>7.2f} {max(pages):>7.2f} "
              f"{statistics.mean(r['episodes'] for r in records):>9.1f} "
              f"{statistics.mean(r['rows_per_round'] for r in records):>11.1f} "
              f"{statistics.mean(r['rounds'] for r in records):>7.0f}")


if __name__ == "__main__":
    main()
