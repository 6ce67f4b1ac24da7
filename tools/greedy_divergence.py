"""Where greedy outputs part, and whether the parting is a near-tie (GPU).

    python tools/greedy_divergence.py --model PATH.gguf --data math_train.json [--seq 4096] [--dtype bfloat16]

Runs `model.generate` (transformers' own loop, the reference), engine AR and S3R, each with and without
`compile_layers` (CUDA graphs on), on the same real-text prompts. For every engine variant it reports the rows
whose greedy tokens differ from the reference, the first generated index where they part, and the reference's
top-1 minus top-2 logit gap at that index: a gap within bf16 rounding (a few hundredths) means two correct
kernels rounded a near-tie differently; a wide gap means a variant computed something else.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from s3r_hf.bench import build_model, greedy_agreement, load_texts, text_prompts
from s3r_hf.config import S3RConfig
from s3r_hf.generate import enable


def reference_run(model, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy `model.generate` tokens and its logits `[B, T, V]`."""
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, pad_token_id=0,
                         eos_token_id=None, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1).float()


def engine_run(model, input_ids: torch.Tensor, max_new_tokens: int, mode: str, compile_layers: bool) -> torch.Tensor:
    config = S3RConfig(min_budget=64, page_size=16, prefill_chunk_size=8192, cuda_graphs=True,
                       compile_layers=compile_layers)
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, pad_token_id=0,
                          eos_token_id=None, max_new_tokens=max_new_tokens, s3r_config=config, s3r_mode=mode)


def tie_gaps(logits: torch.Tensor, differs: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 reference logit at each differing row's first differing index."""
    rows = differs.any(dim=1).nonzero().flatten()
    first = differs.int().argmax(dim=1)
    top2 = logits[rows, first[rows]].topk(2, dim=-1).values
    return [round(float(gap), 4) for gap in top2[:, 0] - top2[:, 1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default=None, help="MATH-style JSON/JSONL (default: the packaged problems)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", default="4096")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json")
    args = parser.parse_args()
    model, tokenizer = build_model(args.model, getattr(torch, args.dtype), "cuda")
    enable(model)
    texts = load_texts(args.data)[0]
    results = []
    for seq in (int(v) for v in args.seq.split(",")):
        input_ids = text_prompts(tokenizer, args.batch, seq, texts)[0].cuda()
        reference, logits = reference_run(model, input_ids, args.max_new_tokens)
        for mode in ("ar", "s3r"):
            for compiled in (False, True):
                tokens = engine_run(model, input_ids, args.max_new_tokens, mode, compiled)
                differs = tokens[:, seq:] != reference[:, seq:]
                row = {"seq": seq, "dtype": args.dtype, "mode": mode, "compile_layers": compiled,
                       **greedy_agreement(tokens, reference, seq), "top2_gaps": tie_gaps(logits, differs)}
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
