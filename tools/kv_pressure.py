"""The paper's Table 2 on one GPU: long rollouts whose KV outgrows the pool, run by S3R with offload at fixed
concurrency limits, by S3R under the KV-aware AIMD limit, and by the engine's dense decoding. Also mixed-stage steps
against lockstep ones on the same queue, where requests arrive as others finish.

Workload: a random-weight model shape (by default Qwen3-1.7B) with a forced acceptance (NOT exact: it times the
cost side at a set acceptance, as `s3r-hf bench --acceptance` does). `--requests` random prompts of `--prompt-len`
tokens are sampled at T=1. A response ends when it samples any of a set of token ids standing in for EOS. The set
takes `vocab / --mean-length` ids, so lengths come out roughly geometric around that mean, capped at
`--max-new-tokens`: a few responses run long, as in RL rollouts.

The KV pool: a first run ("ample pool") at a fixed limit of `--concurrency-max` with a pool that holds everything
records its peak KV pages and warms up compilation and graph captures. Every run after it gets `--pool-fraction`
(by default half) of that peak. Each run is one whole `generate` call over all requests, timed from the host. The
runs share the model's kept state, so admissions after the first run forecast from the response lengths of the
runs before (`engine/kv_forecast.py`), as in an RL loop's later steps.
Reported: generation tokens/s, decode time without CUDA-graph captures, pages moved per 1,000 generated tokens
(offloaded plus restored: the paper's measure), offload episodes, peak host KV, the concurrency limit's range and
back-offs, tau, decode steps, and the mixed steps that packed prompt chunks into the round's forward or ran them
beside a dense step launched early (`engine/mixed_step.py`).

    python tools/kv_pressure.py --json kv_pressure.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch
from rich.console import Console
from rich.table import Table

from s3r_hf.bench import build_model, random_prompts
from s3r_hf.cache.s3r_cache import page_bytes
from s3r_hf.config import S3RConfig
from s3r_hf.demo import timed_generate
from s3r_hf.generate import enable
from s3r_hf.rollout_bench import release_memory


def runs(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(name, engine mode, S3RConfig overrides) of every run after the ample-pool one, in order."""
    low, high = args.concurrency_min, args.concurrency_max
    aimd = dict(concurrency_min=low, concurrency_max=high)
    table = [("AR, AIMD", "ar", aimd)]
    table += [(f"S3R offload-{c}", "s3r", dict(concurrency_min=c, concurrency_max=c)) for c in args.fixed]
    for sigmas in args.admission_sigmas[1:]:  # the first is every run's (`base`)
        table.append((f"S3R AIMD, admission z={sigmas}", "s3r", {**aimd, "admission_sigmas": sigmas}))
    table += [("S3R AIMD", "s3r", aimd), ("S3R AIMD, mixed steps", "s3r", {**aimd, "mixed_steps": True})]
    # Engine AR's mixed steps too: in the dense regime the adaptive rule is in, they are what S3R's mixed steps run.
    table.append(("AR, AIMD, mixed steps", "ar", {**aimd, "mixed_steps": True}))
    return table


def run(model, batch: dict, common: dict, config: S3RConfig, mode: str, acceptance: float, seed: int) -> dict:
    """One timed `generate` call; its figures."""
    release_memory(model.device)
    torch.manual_seed(seed)
    output, seconds = timed_generate(
        model, batch, **common, s3r_config=config, s3r_mode=mode, s3r_timing=True,
        s3r_forced_acceptance=acceptance if mode == "s3r" else None,
    )
    stats = output.s3r_stats
    decode = stats.decode_seconds - stats.graph_capture_seconds
    bytes_per_page = page_bytes(model.config, config.page_size, model.dtype)
    return {
        "seconds": seconds,
        "tokens": stats.committed,
        "tokens_per_s": stats.committed / seconds,
        "decode_s": decode,
        "decode_tokens_per_s": stats.committed / decode if decode > 0 else 0.0,
        "prefill_s": stats.prefill_seconds,
        "graph_capture_s": stats.graph_capture_seconds,
        "mean_length": stats.committed / batch["input_ids"].shape[0],
        "pages_moved_per_1k_tokens": stats.pages_moved_per_1k_tokens,
        "offload_episodes": stats.offload_episodes,
        "peak_kv_pages": stats.peak_kv_pages,
        "peak_host_kv_gib": stats.peak_host_kv_pages * bytes_per_page / 2**30,
        "concurrency": [stats.concurrency_limit_min, stats.concurrency_limit_max, stats.concurrency_limit_final],
        "concurrency_backoffs": stats.concurrency_backoffs,
        "tau": stats.tau,
        "stats": stats.to_dict(),
    }


def print_table(result: dict, console: Console) -> None:
    table = Table(title=f"{result['model']}: {result['requests']} requests, pool {result['num_pages']} pages "
                        f"({result['pool_fraction']:.0%} of the ample run's peak {result['peak_pages']})")
    for column in ("run", "s/call", "tok/s", "÷ AR", "decode tok/s", "pages moved / 1K", "offloads",
                   "peak host KV GiB", "limit min-max (final)", "back-offs", "tau", "steps",
                   "mixed: packed / beside"):
        table.add_column(column, justify="left" if column == "run" else "right")
    ar = result["runs"].get("AR, AIMD", {}).get("tokens_per_s")
    for name, record in result["runs"].items():
        if "error" in record:
            table.add_row(name, record["error"])
            continue
        low, high, final = record["concurrency"]
        table.add_row(
            name, f"{record['seconds']:.2f}", f"{record['tokens_per_s']:,.0f}",
            f"{record['tokens_per_s'] / ar:.2f}x" if ar else "-", f"{record['decode_tokens_per_s']:,.0f}",
            f"{record['pages_moved_per_1k_tokens']:.2f}", str(record["offload_episodes"]),
            f"{record['peak_host_kv_gib']:.2f}", f"{low}-{high} ({final})", str(record["concurrency_backoffs"]),
            f"{record['tau']:.2f}", str(record["stats"]["decode_steps"]),
            f"{record['stats']['mixed_steps_packed']} / {record['stats']['mixed_steps_beside_queued']}",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", help="a random-weight shape of s3r-hf bench (%(default)s)")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--mean-length", type=int, default=1024, help="mean response length the EOS set aims at")
    parser.add_argument("--max-new-tokens", type=int, default=3072)
    parser.add_argument("--acceptance", type=float, default=0.93, help="forced acceptance per position (NOT exact)")
    parser.add_argument("--pool-fraction", type=float, default=0.5, help="pool / the ample run's peak KV pages")
    parser.add_argument("--pool-pages", type=int, default=None, help="the pool in pages (instead of --pool-fraction)")
    parser.add_argument("--concurrency-min", type=int, default=160)
    parser.add_argument("--concurrency-max", type=int, default=256)
    parser.add_argument("--fixed", default="128,160,256", help="fixed concurrency limits to run with offload")
    parser.add_argument("--adaptive", action="store_true", help="S3R with adaptive draft lengths (default: fixed k)")
    parser.add_argument("--utilization-low", type=float, default=S3RConfig.utilization_low,
                        help="S3RConfig.utilization_low: the AIMD limit grows below it")
    parser.add_argument("--admission-sigmas", default=str(S3RConfig.admission_sigmas),
                        help="S3RConfig.admission_sigmas of every run ('none': whatever fits now); more values "
                             "(comma-separated) add S3R AIMD runs")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-graphs", dest="graphs", action="store_false", help="no CUDA graphs or compiled layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.fixed = [int(c) for c in args.fixed.split(",") if c]
    args.admission_sigmas = [None if z == "none" else float(z) for z in args.admission_sigmas.split(",") if z]
    console = Console(width=160)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = build_model(args.model, getattr(torch, args.dtype), device)
    enable(model)
    vocab = model.config.vocab_size
    eos = torch.randperm(vocab, generator=torch.Generator().manual_seed(args.seed))[: max(1, vocab // args.mean_length)]
    prompts = random_prompts(vocab, args.requests, args.prompt_len).to(device)
    batch = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}
    common = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                  eos_token_id=eos.tolist(), pad_token_id=int(eos[0]), return_dict_in_generate=True)
    on_gpu = args.graphs and device == "cuda"
    base = S3RConfig(adaptive=args.adaptive, cuda_graphs=on_gpu, compile_layers=on_gpu, seed=args.seed,
                     utilization_low=args.utilization_low, admission_sigmas=args.admission_sigmas[0])

    high = args.concurrency_max
    console.print(f"ample pool, fixed limit {high}: sizing and warm-up", highlight=False)
    ample = run(model, batch, common, replace(base, concurrency_min=high, concurrency_max=high), "s3r",
                args.acceptance, args.seed)
    num_pages = args.pool_pages or max(1, round(args.pool_fraction * ample["peak_kv_pages"]))
    result = {"model": args.model, "dtype": args.dtype, "requests": args.requests, "prompt_len": args.prompt_len,
              "max_new_tokens": args.max_new_tokens, "mean_length_aimed": args.mean_length,
              "acceptance_forced": args.acceptance, "adaptive": args.adaptive, "peak_pages": ample["peak_kv_pages"],
              "pool_fraction": num_pages / ample["peak_kv_pages"], "num_pages": num_pages,
              "runs": {"S3R ample pool": ample}}
    for name, mode, overrides in runs(args):
        config = replace(base, num_pages=num_pages, **overrides)
        console.print(f"{name}: pool {num_pages} pages", highlight=False)
        try:
            result["runs"][name] = run(model, batch, common, config, mode, args.acceptance, args.seed)
        except (torch.OutOfMemoryError, RuntimeError) as error:  # the other runs' numbers still stand
            result["runs"][name] = {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
    print_table(result, console)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
