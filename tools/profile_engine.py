"""Profile engine AR and S3R generate calls with torch.profiler (GPU): the CUDA kernels a step launches.

Prints, per mode, every kernel with its launches per step, µs per launch and ms per step (kernels inside CUDA
graphs included), so per-layer launch counts and their cost show directly, and the same call's unprofiled wall
time per step, whose excess over the kernels' device time is time the device runs no kernel: waiting for the host,
or in the gaps between kernels (inside a CUDA graph too).

python tools/profile_engine.py --model qwen3-1.7b --batch 16 --seq 4096 --acceptance 0.8
python tools/profile_engine.py --model SmolLM2-135M-Instruct.Q4_1.gguf --data math_train.json --batch 64 \\
    --seq 4096 --budget 0.05 --min-budget 64 --cuda-graphs --compile-layers

`--prefill` profiles the prompts' prefill instead: S3R calls that generate one token, every kernel of the call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from s3r_hf.bench import build_model, load_texts, random_prompts, text_prompts
from s3r_hf.config import S3RConfig
from s3r_hf.generate import enable


def kernel_totals(prof, decode_only: bool = True) -> dict[str, list[float]]:
    """Launches and device µs per CUDA kernel name (kernels replayed inside CUDA graphs included) from the first
    decode round on (`decode_only`: prefill kernels are left out even where the profiler keeps only some of a long
    prefill's), or of the whole call."""
    events = prof.events()
    rounds = [event.time_range.start for event in events if event.name == "s3r_hf.decode_round"]
    decode_start = min(rounds, default=float("inf")) if decode_only else float("-inf")
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in events:
        # The marker itself also shows on the device timeline, as an annotation spanning the round.
        if (event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0
                and event.time_range.start >= decode_start and event.name != "s3r_hf.decode_round"):
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time_total
    return totals


def kernel_table(call: dict, baseline: dict, steps: int, rows: int) -> tuple[str, float]:
    """Kernels of `call` minus those of `baseline` (a shorter call), per decode step of the difference: the table
    and the kernels' total device ms per step."""
    per_step = {}
    for name, (count, us) in call.items():
        count -= baseline.get(name, (0, 0.0))[0]
        us -= baseline.get(name, (0, 0.0))[1]
        if count > 0:
            per_step[name] = (count / steps, us / steps)
    launches = sum(count for count, _ in per_step.values())
    total_us = sum(us for _, us in per_step.values())
    lines = [f"{'launches/step':>14}{'us/launch':>11}{'ms/step':>9}  kernel",
             f"{launches:>14.1f}{total_us / max(launches, 1):>11.2f}{total_us / 1e3:>9.3f}  (all)"]
    for name, (count, us) in sorted(per_step.items(), key=lambda item: -item[1][1])[:rows]:
        lines.append(f"{count:>14.1f}{us / count:>11.2f}{us / 1e3:>9.3f}  {name[:110]}")
    return "\n".join(lines), total_us / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--data", default=None,
                        help="MATH-style JSON/JSONL for a real model's prompts (default: the packaged problems)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=112)
    parser.add_argument("--acceptance", type=float, default=None, help="forced acceptance (random-weight shapes)")
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--min-budget", type=int, default=192)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--compile-layers", action="store_true")
    parser.add_argument("--fused-layers", action="store_true")
    parser.add_argument("--python", action="store_true", help="profile host Python (cProfile) instead of kernels")
    parser.add_argument("--prefill", action="store_true", help="profile the prefill (S3R calls of one new token)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the model's dtype (float32: GRPO's default for small models)")
    args = parser.parse_args()
    model, tokenizer = build_model(args.model, getattr(torch, args.dtype), "cuda")
    enable(model)
    if tokenizer is not None:
        input_ids = text_prompts(tokenizer, args.batch, args.seq, load_texts(args.data)[0])[0].cuda()
    else:
        input_ids = random_prompts(model.config.vocab_size, args.batch, args.seq).cuda()
    # S3R's rounds at the fixed draft length (adaptive off): the adaptive rule may decode densely where drafting does
    # not pay, and a profile of its dense steps would show AR's kernels again.
    config = S3RConfig(prefill_chunk_size=8192, cuda_graphs=args.cuda_graphs, compile_layers=args.compile_layers,
                       fused_layers=args.fused_layers, budget_ratio=args.budget, min_budget=args.min_budget,
                       adaptive=False)
    common = dict(attention_mask=torch.ones_like(input_ids), do_sample=False, pad_token_id=0, eos_token_id=None,
                  s3r_config=config, s3r_timing=True)
    if args.prefill:
        profile_prefill(model, input_ids, common, args.rows)
        return
    per_token = {}  # mode -> (wall µs, kernel µs) per committed token
    for mode, acceptance in (("ar", None), ("s3r", args.acceptance)):
        # Warm-up: compilation and graph captures of this shape happen here, not in the profiled call.
        model.generate(input_ids, max_new_tokens=args.max_new_tokens, s3r_mode=mode,
                       s3r_forced_acceptance=acceptance, **common)
        if args.python:
            profiler = cProfile.Profile()
            profiler.enable()
            out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, s3r_mode=mode,
                                 s3r_forced_acceptance=acceptance, **common)
            profiler.disable()
            stats = out.s3r_stats
            print(f"\n===== {mode}: steps {stats.decode_steps}, decode {stats.decode_seconds:.3f}s, prefill "
                  f"{stats.prefill_seconds:.3f}s")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)
            continue
        # The same call unprofiled: its wall time per step minus the kernels' device time below is time without a
        # kernel running (host waits, gaps between kernels).
        stats = model.generate(input_ids, max_new_tokens=args.max_new_tokens, s3r_mode=mode,
                               s3r_forced_acceptance=acceptance, **common).s3r_stats
        wall_ms = (stats.decode_seconds - stats.graph_capture_seconds) * 1e3 / max(stats.decode_steps, 1)
        totals, steps, committed = [], [], []
        # Two calls that differ only in decode steps: their difference leaves out the graph captures (each call's
        # engine captures its own).
        for max_new_tokens in (16, args.max_new_tokens):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = model.generate(input_ids, max_new_tokens=max_new_tokens, s3r_mode=mode,
                                     s3r_forced_acceptance=acceptance, **common)
            totals.append(kernel_totals(prof))
            steps.append(out.s3r_stats.decode_steps)
            committed.append(out.s3r_stats.committed)
        stats = out.s3r_stats
        ms_per_step = stats.decode_seconds * 1e3 / max(stats.decode_steps, 1)
        print(f"\n===== {mode}: steps {stats.decode_steps}, decode {ms_per_step:.2f} ms/step (profiled), "
              f"tau {stats.tau:.2f}")
        step_count = max(steps[1] - steps[0], 1)
        table, kernel_ms = kernel_table(totals[1], totals[0], step_count, args.rows)
        print(f"unprofiled: {wall_ms:.2f} ms/step wall, {kernel_ms:.2f} ms/step of kernels, so the device runs no "
              f"kernel for {wall_ms - kernel_ms:.2f} ms/step (host waits and gaps between kernels)")
        print(table)
        # Tokens committed per step over the profiled window (all requests together).
        tokens_per_step = max(committed[1] - committed[0], 1) / step_count
        per_token[mode] = (wall_ms / tokens_per_step * 1e3, kernel_ms / tokens_per_step * 1e3)
    if len(per_token) == 2:
        (ar_wall, ar_kernels), (s3r_wall, s3r_kernels) = per_token["ar"], per_token["s3r"]
        print(f"\nper committed token: AR {ar_wall:.1f} us wall, {ar_kernels:.1f} us of kernels; S3R {s3r_wall:.1f} us "
              f"wall, {s3r_kernels:.1f} us of kernels; S3R / AR speed {ar_wall / s3r_wall:.2f}x by wall time, "
              f"{ar_kernels / s3r_kernels:.2f}x by kernel time")


def profile_prefill(model, input_ids: torch.Tensor, common: dict, rows: int) -> None:
    """The kernels of an S3R call that generates one token (its prefill, the index views' first build and one
    sample), after a warm-up call, next to the same call's unprofiled prefill seconds."""
    kwargs = dict(max_new_tokens=1, s3r_mode="s3r", **common)
    model.generate(input_ids, **kwargs)  # compiles and builds kernel variants for these shapes
    stats = model.generate(input_ids, **kwargs).s3r_stats
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(input_ids, **kwargs)
    table, kernel_ms = kernel_table(kernel_totals(prof, decode_only=False), {}, 1, rows)
    print(f"\n===== prefill of {input_ids.shape[0]} x {input_ids.shape[1]} tokens: {stats.prefill_seconds:.3f} s "
          f"unprofiled, {kernel_ms / 1e3:.3f} s of kernels in the profiled call")
    print(table)


if __name__ == "__main__":
    main()
