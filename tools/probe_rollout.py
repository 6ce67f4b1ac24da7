"""Where one GRPO-shaped rollout call's time goes: S3R `generate` calls timed by phase, then one under the profiler.

A GRPO step generates `--rows` completions (prompts x generations) of up to `--max-new-tokens` tokens from short
chat prompts, sampled at temperature 1, with the model in training mode and the dense log-probabilities returned,
as `S3RGRPOTrainer` asks. This reruns that call outside TRL, so its time can be split without the trainer:
per call the prefill, decode and CUDA-graph capture seconds and the engine steps; then, for one more call, the
CUDA kernels' device time, how many kernels the host launched one by one against the graphs it replayed, and
the kernels and host functions that took the most time.

    python tools/probe_rollout.py --model SmolLM2-135M-Instruct.Q4_1.gguf --data math_train.json \\
        --s3r-config '{"cuda_graphs": true, "compile_layers": true}'

`--mode ar` runs the engine's dense decoding instead, `--no-logprobs` a plain rollout, and `--host` profiles the
last call's host Python (cProfile) instead of its kernels: where a host-bound step's time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import pstats
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from s3r_hf.demo import build_batch, timed_generate
from s3r_hf.generate import enable
from s3r_hf.models import load_model_and_tokenizer
from s3r_hf.rollout_bench import load_problems


def grpo_prompts(data: str | None, prompts: int, generations: int) -> list[str]:
    """The first `prompts` problems, each repeated `generations` times (as a GRPO step asks for them)."""
    return [problem for problem in load_problems(data)[:prompts] for _ in range(generations)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default=None, help="MATH-style JSON/JSONL (default: the packaged problems)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--calls", type=int, default=3, help="timed calls before the profiled one")
    parser.add_argument("--eval-mode", action="store_true", help="generate in eval mode (GRPO: training mode)")
    parser.add_argument("--s3r-config", default="{}", help="S3RConfig fields as JSON")
    parser.add_argument("--rows", type=int, default=25, help="kernels and host functions listed")
    parser.add_argument("--mode", default="s3r", choices=["s3r", "ar"], help="S3R or the engine's dense decoding")
    parser.add_argument("--no-logprobs", action="store_true", help="as a plain rollout: no log-probabilities")
    parser.add_argument("--no-profile", action="store_true", help="only the timed calls: no profiled call after them")
    parser.add_argument("--host", action="store_true",
                        help="profile the last call's host Python (cProfile, by own time) instead of its kernels")
    args = parser.parse_args()

    # The engine logs each CUDA-graph capture (kind, bucket, seconds) at info level.
    logging.basicConfig(format="  %(name)s: %(message)s")
    logging.getLogger("s3r_hf").setLevel(logging.INFO)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=getattr(torch, args.dtype), device=str(device))
    enable(model)
    model.train(not args.eval_mode)
    batch = build_batch(tokenizer, grpo_prompts(args.data, args.prompts, args.generations), device)
    config = {"return_logprobs": not args.no_logprobs, **json.loads(args.s3r_config)}
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=tokenizer.pad_token_id, s3r_config=config, s3r_timing=True,
                  return_dict_in_generate=True, s3r_mode=args.mode)
    print(f"{batch['input_ids'].shape[0]} rows, prompts {batch['attention_mask'].sum(1).min().item()}-"
          f"{batch['attention_mask'].sum(1).max().item()} tokens, {args.dtype}, "
          f"{'eval' if args.eval_mode else 'train'} mode, {config}")
    for call in range(args.calls):
        torch.manual_seed(call)
        output, wall = timed_generate(model, batch, **kwargs)
        stats = output.s3r_stats
        committed = stats.committed
        print(f"call {call}: {wall:.2f} s, {committed} tokens ({committed / wall:.0f} tok/s), "
              f"prefill {stats.prefill_seconds:.2f} s, decode {stats.decode_seconds:.2f} s "
              f"(captures {stats.graph_captures}: {stats.graph_capture_seconds:.2f} s), {stats.steps} steps "
              f"({1e3 * (stats.decode_seconds - stats.graph_capture_seconds) / max(stats.steps, 1):.1f} ms each), "
              f"tau {stats.tau:.2f}")
        # What a step costs as responses finish: drafting pays where a step is dear, not at the call's mean.
        print("  by running rows (steps, ms per step, tokens per step): " + "; ".join(
            f"<={rows}: {entry['steps']}, {1e3 * entry['seconds'] / entry['steps']:.2f}, "
            f"{entry['tokens'] / entry['steps']:.1f}"
            for rows, entry in sorted(stats.decode_by_rows.items(), reverse=True) if entry["steps"]))

    if args.no_profile:
        return
    if args.host:
        torch.manual_seed(args.calls)
        profiler = cProfile.Profile()
        profiler.enable()
        output, wall = timed_generate(model, batch, **kwargs)
        profiler.disable()
        print(f"profiled call (cProfile): {wall:.2f} s wall, {output.s3r_stats.steps} steps")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    torch.manual_seed(args.calls)
    with profile(activities=activities) as prof:
        output, wall = timed_generate(model, batch, **kwargs)
    events = prof.events()
    runtime = Counter(e.name for e in events if e.name in ("cudaLaunchKernel", "cudaGraphLaunch",
                                                           "cudaLaunchKernelExC", "cuLaunchKernel",
                                                           "cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                           "cudaMemcpyAsync", "cudaEventSynchronize"))
    device_ms = sum(e.device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    print(f"profiled call: {wall:.2f} s wall (profiler on), CUDA kernels {device_ms:.0f} ms of device time, "
          f"{output.s3r_stats.steps} steps; runtime calls: {dict(runtime)}")
    averages = prof.key_averages()
    if device.type == "cuda":  # the kernels first: what an fp32 round spends its device time on
        print(averages.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
