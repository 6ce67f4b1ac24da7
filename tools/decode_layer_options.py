"""What existing tools make a decode forward cheaper: engine AR and S3R time per step with the decoder layers run
several ways, before any fused kernel of our own is written.

Variants (each in a child process of its own, so patches and compile caches do not leak between them):
  eager          the model's own layers (`compile_layers=False`)
  compiled       S3R's per-layer `torch.compile` (`compile_layers=True`, the current setting)
  max-autotune   the same with inductor's max-autotune (Triton GEMM templates with fused prologues and epilogues)
  compiled-pdl   compiled per layer with inductor's programmatic dependent launch (Hopper: each generated kernel
                 launches while the one before it finishes and waits for its data, cutting the gaps between the
                 dozen small kernels of a layer)
  compiled-cdt   compiled per layer with inductor's coordinate-descent tuning of its pointwise and reduction kernels'
                 block sizes
  liger          liger-kernel's RMSNorm, RoPE and SwiGLU patched into the model (`pip install liger-kernel`)
  liger-compiled the same, then compiled per layer
  fused          S3R's fused decoder layers (`fused_layers=True`: five Triton kernels per layer around the attention);
                 prefill chunks eager
  fused-compiled the same, prefill chunks through the compiled layers

Every variant runs engine AR and S3R (k = 6, acceptance forced to `--acceptance`: NOT exact, it times the cost
side) on the same greedy batch of random prompts and reports ms per step, and how many AR output tokens agree with
the eager variant's (bf16 numerics differ a little between kernels; agreement far below the others' flags a wrong
kernel). CUDA graphs are on where there is
CUDA. Meant for a GPU; on a CPU only `--model qwen3-tiny` as a smoke test.

    python tools/decode_layer_options.py --model qwen3-1.7b --batch 64 --seq 8192 --json layers.json
    python tools/decode_layer_options.py --model SmolLM2-135M-Instruct.Q4_1.gguf --batch 64 --seq 4096
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = ("eager", "compiled", "max-autotune", "compiled-pdl", "compiled-cdt", "liger", "liger-compiled", "fused",
            "fused-compiled")
# Inductor options of the variants compiled with options other than S3R's own.
INDUCTOR_OPTIONS = {
    "max-autotune": {"max_autotune": True, "triton.cudagraphs": False},
    "compiled-pdl": {"triton.enable_pdl": True},
    "compiled-cdt": {"coordinate_descent_tuning": True},
}


def apply_variant(model, variant: str) -> dict:
    """Patch `model` (or the compiled-layer cache) for `variant`; returns the S3RConfig fields it sets."""
    import torch

    from s3r_hf import compiled_layers
    from s3r_hf.fused_projections import MergeIdenticalGemms

    if variant.startswith("liger"):
        try:
            import liger_kernel.transformers as liger
        except ImportError as error:
            raise SystemExit("the liger variants need liger-kernel: pip install liger-kernel") from error
        patch = liger.apply_liger_kernel_to_qwen3 if "qwen3" in model.config.model_type else (
            liger.apply_liger_kernel_to_llama)
        patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False,
              model=model)
    if variant in INDUCTOR_OPTIONS:
        options = {**INDUCTOR_OPTIONS[variant], "post_grad_custom_pre_pass": MergeIdenticalGemms()}
        for cls in {type(layer) for layer in compiled_layers.decoder_layers(model)}:
            compiled_layers._compiled_forwards[cls] = torch.compile(cls.forward, options=options)
    return {
        "compile_layers": variant in ("compiled", *INDUCTOR_OPTIONS, "liger-compiled", "fused-compiled"),
        "fused_layers": variant.startswith("fused"),
    }


def run_variant(args: argparse.Namespace) -> dict:
    """One variant, in this process: engine AR and S3R timings and the AR greedy tokens."""
    import torch

    import s3r_hf
    from s3r_hf.bench import build_model, random_prompts, time_engine
    from s3r_hf.config import S3RConfig

    dtype = getattr(torch, args.dtype)
    model, _ = build_model(args.model, dtype, args.device)
    layer_settings = apply_variant(model, args.variant)
    s3r_hf.enable(model)
    torch.manual_seed(0)
    prompts = random_prompts(model.config.vocab_size, args.batch, args.seq).to(args.device)
    config = S3RConfig(adaptive=False, cuda_graphs=args.device.startswith("cuda"), min_budget=args.min_budget,
                       **layer_settings)
    record = {"variant": args.variant}
    # Random prompts (and random weights) accept little of their own; a set acceptance times the cost side alike.
    forced = args.acceptance
    for mode in ("ar", "s3r"):
        acceptance = forced if mode == "s3r" else None
        time_engine(model, prompts, args.max_new_tokens, config, mode, acceptance)  # compiles, captures
        timed = time_engine(model, prompts, args.max_new_tokens, config, mode, acceptance)
        record[mode] = {key: timed[key] for key in ("ms_per_step", "tokens_per_s", "tau")}
        if mode == "ar":
            record["ar_tokens"] = timed["sequences"][:, prompts.shape[1]:].tolist()
    return record


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Share of positions where two greedy outputs agree, up to each row's first difference (rows part for good
    once they differ)."""
    agreed = total = 0
    for row, ref in zip(tokens, reference):
        total += len(ref)
        for a, b in zip(row, ref):
            if a != b:
                break
            agreed += 1
    return agreed / max(total, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", help="a random-weight shape of s3r_hf.bench or a model path")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--acceptance", type=float, default=0.93,
                        help="forced per-draft acceptance for S3R (benchmark-only, NOT exact)")
    parser.add_argument("--min-budget", type=int, default=192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant")
    parser.add_argument("--json", default=None)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.variant is not None:
        record = run_variant(args)
        print("RESULT " + json.dumps(record), flush=True)
        return
    settings = ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq), "--max-new-tokens",
                str(args.max_new_tokens), "--acceptance", str(args.acceptance), "--min-budget", str(args.min_budget),
                "--dtype", args.dtype, "--device", args.device]
    # Each variant's row is printed, and the JSON rewritten, as soon as it finishes: a caller's time limit that cuts
    # the run short still leaves the variants already timed.
    print(f"{args.model}, B={args.batch}, S={args.seq}, {args.max_new_tokens} new tokens, {args.dtype}")
    print(f"{'variant':<16}{'AR ms/step':>12}{'S3R ms/step':>13}{'S3R / AR':>10}{'agree':>8}", flush=True)
    results, reference = [], None
    for variant in args.variants.split(","):
        record = run_child(args, settings, variant)
        if variant == "eager" and "ar_tokens" in record:
            reference = record["ar_tokens"]
        if "ar_tokens" in record and reference is not None:
            record["agreement_with_eager"] = agreement(record["ar_tokens"], reference)
        record.pop("ar_tokens", None)
        results.append(record)
        print_row(record)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


def run_child(args: argparse.Namespace, settings: list[str], variant: str) -> dict:
    """One variant in a child process of its own: its record, or the error that stopped it."""
    command = [sys.executable, __file__, *settings, "--variant", variant]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"variant": variant, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1][len("RESULT "):])


def print_row(record: dict) -> None:
    if "error" in record:
        print(f"{record['variant']:<16}  {record['error']}", flush=True)
        return
    ar, s3r = record["ar"]["ms_per_step"], record["s3r"]["ms_per_step"]
    speed = (s3r and ar / s3r * record["s3r"]["tau"]) or 0.0
    agree = record.get("agreement_with_eager")
    print(f"{record['variant']:<16}{ar:>12.2f}{s3r:>13.2f}{speed:>9.2f}x"
          f"{'' if agree is None else f'{agree:>8.3f}'}", flush=True)


if __name__ == "__main__":
    main()
