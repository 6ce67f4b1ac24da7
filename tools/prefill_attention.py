"""Time the dense paged kernel on prefill chunks under several tilings, next to torch's flash attention (GPU only).

    python tools/prefill_attention.py [--shapes qwen3-1.7b:8:8192,smollm2-135m:8:4096] [--json PATH]

One layer of a prefill step: `B` prompts of `S` tokens each, causal, over paged K/V, the last `draft_len + 1` queries
of each prompt scored (as `PromptChunks` asks, for the prompt's first index views). For every tiling in the grid
(`triton_backend.PREFILL_TILING`: (query, head) rows per program, keys per tile, warps, pipeline stages) it prints
the kernel's time, its arithmetic rate and its largest difference from the first tiling's output; then
`torch.nn.functional.scaled_dot_product_attention` on the same K/V gathered into contiguous tensors (what a
well-tuned flash kernel does at this shape, without pages or scores).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from s3r_hf.bench_kernels import _paged_setup
from s3r_hf.kernels import triton_backend
from tools.tune_kernels import SHAPES

GRID = {"ROWS": (64, 128), "BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}
SCORED = 7  # draft_len + 1 scored queries at the end of each prompt


def event_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def run_shape(name: str, batch: int, seq: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = SHAPES[name]
    key_pool, value_pool, tables, heads, kv_heads, dim = _paged_setup(batch, seq, 16, torch.bfloat16, generator, shape)
    query = torch.randn(batch * seq, heads, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    positions = torch.arange(seq, device="cuda").repeat(batch)
    cu = torch.arange(0, batch * seq + 1, seq, device="cuda")
    starts = torch.full((batch,), seq - SCORED, device="cuda")
    # Causal attention FLOPs: QK^T and PV over the visible half of the square.
    flops = 4 * batch * heads * dim * seq * (seq + 1) / 2

    def attend():
        return triton_backend.paged_dense_attention(
            query, key_pool, value_pool, tables, cu, positions, dim**-0.5, starts,
            max_query_len=seq, max_context=seq, max_scored_queries=SCORED,
        )

    rows, first = [], None
    default = dict(triton_backend.PREFILL_TILING)
    for values in itertools.product(*GRID.values()):
        tiling = dict(zip(GRID, values))
        triton_backend.PREFILL_TILING = tiling
        try:
            out, _, scores = attend()
            ms = event_ms(attend)
        except Exception as error:  # a tiling that does not fit the SM's shared memory or registers
            print(f"{name} {tiling}: {type(error).__name__}: {str(error)[:80]}")
            continue
        if first is None:
            first = (out.float(), scores)
        diff = (out.float() - first[0]).abs().max().item()
        score_diff = (scores - first[1]).abs().max().item()
        rows.append({**tiling, "ms": ms, "tflops": flops / ms / 1e9, "max_diff": diff, "score_diff": score_diff})
        print(f"{name} B={batch} S={seq} {tiling}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
              f"out diff {diff:.2e}, score diff {score_diff:.2e}", flush=True)
    triton_backend.PREFILL_TILING = default

    # The same attention contiguous, through torch's fused kernels.
    pages = tables.long()
    keys = key_pool[pages].flatten(1, 2)[:, :seq].transpose(1, 2)  # [B, Hkv, S, D]
    values = value_pool[pages].flatten(1, 2)[:, :seq].transpose(1, 2)
    q = query.view(batch, seq, heads, dim).transpose(1, 2)
    sdpa_ms = event_ms(lambda: F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True))
    reference = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
    best = min(rows, key=lambda r: r["ms"]) if rows else None
    triton_backend.PREFILL_TILING = {key: best[key] for key in GRID} if best else default
    best_out = attend()[0].view(batch, seq, heads, dim).transpose(1, 2).float()
    triton_backend.PREFILL_TILING = default
    sdpa_diff = (best_out - reference.float()).abs().max().item()
    print(f"{name} B={batch} S={seq} torch SDPA: {sdpa_ms:.3f} ms, {flops / sdpa_ms / 1e9:.0f} TFLOP/s; the fastest "
          f"tiling's output differs from it by {sdpa_diff:.2e}", flush=True)
    print(f"{name}: fastest {best}")
    return {"shape": name, "batch": batch, "seq": seq, "rows": rows, "sdpa_ms": sdpa_ms, "sdpa_diff": sdpa_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-1.7b:8:8192,smollm2-135m:8:4096",
                        help="comma-separated name:B:S (names: " + ", ".join(SHAPES) + ")")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = []
    for point in args.shapes.split(","):
        name, batch, seq = point.split(":")
        results.append(run_shape(name, int(batch), int(seq)))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
