"""Profile one S3R generate call and one engine-AR call with torch.profiler (GPU): top ops by CPU and CUDA time.

python tools/profile_engine.py --model qwen3-1.7b --batch 16 --seq 4096 --max-new-tokens 24 --acceptance 0.8
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from s3r_hf.bench import build_model, random_prompts
from s3r_hf.config import S3RConfig
from s3r_hf.generate import enable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--acceptance", type=float, default=0.8)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--python", action="store_true", help="profile host Python (cProfile) instead of ops")
    args = parser.parse_args()
    model, _ = build_model(args.model, torch.bfloat16, "cuda")
    enable(model)
    input_ids = random_prompts(model.config.vocab_size, args.batch, args.seq).cuda()
    config = S3RConfig(prefill_chunk_size=8192, cuda_graphs=args.cuda_graphs)
    common = dict(attention_mask=torch.ones_like(input_ids), do_sample=False, pad_token_id=0, eos_token_id=None,
                  s3r_config=config, s3r_timing=True)
    for mode, acceptance in (("ar", None), ("s3r", args.acceptance)):
        model.generate(input_ids, max_new_tokens=4, s3r_mode=mode, s3r_forced_acceptance=acceptance, **common)
        if args.python:
            profiler = cProfile.Profile()
            profiler.enable()
            out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, s3r_mode=mode,
                                 s3r_forced_acceptance=acceptance, **common)
            profiler.disable()
            stats = out.s3r_stats
            print(f"\n===== {mode}: steps {stats.steps}, decode {stats.decode_seconds:.3f}s, prefill "
                  f"{stats.prefill_seconds:.3f}s")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.rows)
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, s3r_mode=mode,
                                 s3r_forced_acceptance=acceptance, **common)
        stats = out.s3r_stats
        print(f"\n===== {mode}: steps {stats.steps}, decode {stats.decode_seconds:.3f}s "
              f"({stats.decode_seconds / max(stats.steps, 1) * 1e3:.1f} ms/step), prefill {stats.prefill_seconds:.3f}s")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
