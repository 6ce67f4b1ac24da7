"""How often drafts are accepted with 8-bit draft weights (`S3RConfig.draft_weights`), on a real model's text.

One sampled S3R `generate` call (T=1, fixed draft length) per setting, over the same prompts and seed: the model's own
weights, the offered int8 copies (a scale per output feature, per 64 and per 128 weights along a row), and a rounding
the option does not offer, emulated by rounding the decoder layers' weights in place around each draft phase: float8
(e4m3) with a scale per output feature. Only the proposals change; the samples stay exact, so what moves is τ and the
acceptance per draft position.

    python tools/draft_weights_acceptance.py --data math_train.json --prompts 8 --generations 2 --max-new-tokens 384
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3r_hf import S3RConfig, enable  # noqa: E402
from s3r_hf import draft_phase as draft_phase_module  # noqa: E402
from s3r_hf.compiled_layers import decoder_layers  # noqa: E402
from s3r_hf.config import DRAFT_WEIGHT_FORMATS  # noqa: E402
from s3r_hf.demo import build_batch  # noqa: E402
from s3r_hf.kernels.decode_linear_reference import FP8, quantize_rows  # noqa: E402
from s3r_hf.models import load_model_and_tokenizer  # noqa: E402
from s3r_hf.rollout_bench import load_problems  # noqa: E402

SETTINGS = ("model", *DRAFT_WEIGHT_FORMATS, "float8-emulated")


def rounded(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as the float8-emulated setting's draft passes see it: `quantize_rows` over its rows."""
    quantized, scale = quantize_rows(weight, FP8)
    return (quantized.float() * scale[:, None]).to(weight.dtype)


@contextlib.contextmanager
def emulated(model, setting: str):
    """Every draft phase runs with the decoder layers' linear weights rounded as `setting` rounds them."""
    if not setting.endswith("-emulated"):
        yield
        return
    linears = [m for layer in decoder_layers(model) for m in layer.modules() if type(m) is torch.nn.Linear]
    copies = [rounded(m.weight.detach()) for m in linears]
    run = draft_phase_module.DraftPhase.__call__

    def with_rounded_weights(self, *args, **kwargs):
        own = [m.weight.data for m in linears]
        for m, copy in zip(linears, copies):
            m.weight.data = copy
        try:
            return run(self, *args, **kwargs)
        finally:
            for m, weight in zip(linears, own):
                m.weight.data = weight

    draft_phase_module.DraftPhase.__call__ = with_rounded_weights
    try:
        yield
    finally:
        draft_phase_module.DraftPhase.__call__ = run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=None, help="MATH-style JSON or JSONL (default: the packaged problems)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--draft-len", type=int, default=6)
    parser.add_argument("--min-budget", type=int, default=192)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = args.settings.split(",")
    if unknown := set(settings) - set(SETTINGS):
        raise SystemExit(f"unknown settings {sorted(unknown)}; choose from {', '.join(SETTINGS)}")
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    enable(model)
    problems = load_problems(args.data)[: args.prompts]
    batch = build_batch(tokenizer, [p for p in problems for _ in range(args.generations)], device=args.device)
    print(f"{args.model}, {len(problems)} prompts x {args.generations}, <= {args.max_new_tokens} new tokens, T=1, "
          f"draft_len {args.draft_len}, min_budget {args.min_budget}")
    for setting in settings:
        config = S3RConfig(draft_len=args.draft_len, adaptive=False, min_budget=args.min_budget, seed=args.seed,
                           draft_weights=setting if setting in DRAFT_WEIGHT_FORMATS else "model")
        started = time.perf_counter()
        with emulated(model, setting):
            stats = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0,
                                   top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id, s3r_config=config,
                                   return_dict_in_generate=True).s3r_stats
        positions = " ".join(f"{a / max(d, 1):.3f}" for a, d in zip(stats.position_accepted, stats.position_drafted))
        print(f"{setting:>22}: tau {stats.tau:.3f}  accepted {stats.accepted / max(stats.drafted, 1):.3f}  "
              f"by position {positions}  ({stats.request_rounds} request-rounds, "
              f"{time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
