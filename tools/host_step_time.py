"""The engine's host time per decode step, with a model forward that costs nothing.

On a small model (SmolLM2-135M) a dense step is bound by the engine's own Python: planning, staging metadata,
committing tokens, stop checks. This replaces the decode forwards of a tiny random model with one that returns
zero logits at once, so what is left of a step is the engine's host work (and, on CPU, the sampling kernels).
Prefill and scored forwards still run the model: index-view refreshes need their scores.

    python tools/host_step_time.py --mode ar --batch 64 --steps 400
    python tools/host_step_time.py --mode ar --profile      # cProfile of one call, by own time
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3r_hf import S3RConfig, enable  # noqa: E402
from s3r_hf.engine import model_runner  # noqa: E402


def free_decode_forwards(vocab_size: int) -> None:
    """Unscored decode forwards return zero logits at once; everything else runs the model."""
    real = model_runner.ModelRunner.forward

    def forward(self, input_ids, plan, keep=None, bucket_floor=0, precision="highest"):
        if keep is not None or plan.dense is None or plan.dense.score_starts is not None:
            return real(self, input_ids, plan, keep, bucket_floor, precision)
        return torch.zeros(input_ids.shape[0], vocab_size)

    model_runner.ModelRunner.forward = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["ar", "s3r"], default="ar", help="engine AR or (adaptive) S3R")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400, help="new tokens per request")
    parser.add_argument("--calls", type=int, default=5, help="timed calls; the fastest is reported")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--logprobs", action="store_true",
                        help="as S3RGRPOTrainer calls it: log-probabilities returned, the model in training mode")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).train(args.logprobs)
    enable(model)
    free_decode_forwards(config.vocab_size)
    ids = torch.randint(1, config.vocab_size, (args.batch, 16))
    extra = {"s3r_mode": "ar"} if args.mode == "ar" else {}

    def call():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=args.steps, pad_token_id=0, eos_token_id=None, return_dict_in_generate=args.logprobs,
            s3r_config=S3RConfig(min_budget=16, seed=1, return_logprobs=args.logprobs), **extra,
        )

    call()  # warm-up
    seconds = []
    for _ in range(args.calls):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    label = f"{args.mode}, log-probs" if args.logprobs else args.mode
    print(f"{label}, B={args.batch}: {min(seconds) / (args.steps - 1) * 1e3:.3f} ms per step "
          f"(fastest of {args.calls} calls of {args.steps - 1} decode steps)")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        call()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
