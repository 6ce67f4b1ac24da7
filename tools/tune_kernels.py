"""Time launch settings of the Triton attention kernels at the benchmark shapes (GPU only).

    python tools/tune_kernels.py [--json PATH] [--chosen-only] [--points shape:B:S,...] [--dtype float32]
        [--precisions ieee,tf32x3] [--auto-splits] [--kernels dense,verify,...] [--min-budget 192] [--live N]
        [--graph-context N]

For the SmolLM2-135M shape (9 query heads, 3 KV heads, head dim 64) at B=64, S=4K and 7.7K, and the
Qwen3-1.7B shape (16/8 heads, head dim 128) at B=64, S=8K (or the `--points` given), it times one layer of dense
decode, the scored verify block (7 queries per request, the score reduction included), the same block unscored,
and sparse decode over a 5% index view (at least `--min-budget` keys, as `S3RConfig.min_budget` sizes the engine's
views; 0 by default), for every combination of key splits and launch settings
(`triton_backend.launch_settings` chooses one, `sparse_launch_settings` the sparse kernel's; `--chosen-only` times
just that one), each replayed from a CUDA graph as the engine runs it. Each variant's output is compared with the
chosen setting's, so a setting that changes results shows up. The floor is the K/V bytes the kernel must read at
the measured copy bandwidth.

In float32 the dot products' precision is a setting too (`--precisions`): "ieee" (full-precision products, no
tensor cores) and "tf32x3" (three TF32 tensor-core products per product, about float32's accuracy); each variant is
also compared with the float32 torch reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch

from s3r_hf.bench_kernels import _paged_setup, copy_bandwidth, graph_ms, step_metadata
from s3r_hf.kernels import reference, triton_backend

SHAPES = {
    "smollm2-135m": dict(num_heads=9, num_kv_heads=3, head_dim=64),
    "qwen3-1.7b": dict(num_heads=16, num_kv_heads=8, head_dim=128),
}
POINTS = [("smollm2-135m", 64, 4096), ("smollm2-135m", 64, 7680), ("qwen3-1.7b", 64, 8192)]
LAUNCHES = [
    {"BLOCK_N": 16, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 32, "num_warps": 2, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3},
    {"BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    # Two stages with smaller tiles or more warps: the float32 verify kernels' variants without spills (compiled
    # offline for sm_90 by tools/kernel_registers.py, where the chosen one spills 40-64 bytes).
    {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    {"BLOCK_N": 32, "num_warps": 2, "num_stages": 2},
    {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
]
BLOCK = 7  # verify queries per request (draft_len 6 + 1)


def tune_point(
    name: str, batch: int, seq: int, bandwidth: float, generator: torch.Generator, chosen_only: bool = False,
    dtype: torch.dtype = torch.bfloat16, precisions: tuple[str | None, ...] = (None,), auto_splits: bool = False,
    only: tuple[str, ...] | None = None, min_budget: int = 0, live: int | None = None,
    graph_context: int | None = None,
) -> dict:
    shape = SHAPES[name]
    key_pool, value_pool, tables, heads, kv_heads, dim = _paged_setup(batch, seq, 16, dtype, generator, shape)
    scale = dim**-0.5
    kv_bytes = 2 * (live or batch) * seq * kv_heads * dim * key_pool.element_size()
    budget = min(seq - BLOCK, max(min_budget, math.ceil(0.05 * seq)))
    cu1, pos1, cuv, posv, starts, lens, tails, pos_s = step_metadata(batch, seq, BLOCK, budget)
    graph_context = max(graph_context or seq, seq)  # a CUDA graph's grid serves contexts up to its `max_context`
    live_segments = None
    # The verify blocks' queries; with `live`, those past them are one padding segment, of which a graph computes
    # only the first query block (rows nothing reads).
    real_queries = (live or batch) * BLOCK
    if live is not None:  # a graph of `batch` rows replayed for `live`: the rest padding, as `DecodeGraphs` fills it
        live_segments = torch.tensor([live], dtype=torch.int32, device="cuda")
        pos1[live:] = 0
        posv[live * BLOCK:] = 0
        cuv[live + 1:] = batch * BLOCK  # the unused token slots form one padding segment
        starts[live:] = -1
    q1 = torch.randn(batch, heads, dim, device="cuda", dtype=dtype, generator=generator)
    qv = torch.randn(batch * BLOCK, heads, dim, device="cuda", dtype=dtype, generator=generator)
    view = torch.stack([
        torch.randperm(seq - BLOCK, device="cuda", generator=generator)[:budget].sort().values
        for _ in range(batch * kv_heads)
    ]).view(batch, kv_heads, budget).int()

    # Split option "live": the count chosen on the device for `live` rows of the grid (`live_segments`).
    def split_args(splits):
        return {"live_segments": live_segments} if splits == "live" else {"num_splits": splits}

    counts = (None, "live") if live is not None else (None, 1, 2, 4, 8, 16)
    kernels = {
        "dense": (lambda splits: triton_backend.paged_dense_attention(
            q1, key_pool, value_pool, tables, cu1, pos1, scale, max_query_len=1, max_context=graph_context,
            **split_args(splits))[0], counts, kv_bytes),
        "verify": (lambda splits: triton_backend.paged_dense_attention(
            qv, key_pool, value_pool, tables, cuv, posv, scale, starts, max_query_len=BLOCK, max_context=graph_context,
            max_scored_queries=BLOCK, **split_args(splits))[2][..., :seq], counts, kv_bytes),
        # The same block without scores: what the score material costs the verify.
        "verify-unscored": (lambda splits: triton_backend.paged_dense_attention(
            qv, key_pool, value_pool, tables, cuv, posv, scale, max_query_len=BLOCK, max_context=graph_context,
            num_splits=splits)[0][:real_queries], (None, 1, 2, 4, 8), kv_bytes),
        "sparse": (lambda splits: triton_backend.paged_sparse_attention(
            q1, key_pool, value_pool, tables, view, lens, tails, pos_s, scale, max_keys=budget + 3,
            num_splits=splits)[0], (None, 1, 2, 4, 8), kv_bytes * budget / seq),
    }
    pools = (key_pool, value_pool, tables)
    references = {
        "dense": lambda: reference.paged_dense_attention(q1, *pools, cu1, pos1, scale)[0],
        "verify": lambda: reference.paged_dense_attention(qv, *pools, cuv, posv, scale, starts)[2],
        "verify-unscored": lambda: reference.paged_dense_attention(qv, *pools, cuv, posv, scale)[0][:real_queries],
        "sparse": lambda: reference.paged_sparse_attention(q1, *pools, view, lens, tails, pos_s, scale)[0],
    }
    results = {"model": name, "batch": batch, "seq": seq, "dtype": str(dtype), "floor_ms": kv_bytes / bandwidth * 1e3,
               "sparse_view_keys": budget, "kernels": {}}
    chosen, chosen_precision = triton_backend.launch_settings, triton_backend._dot_precision
    chosen_sparse = triton_backend.SPARSE_LAUNCH_OVERRIDE
    for kernel, (run, split_options, bytes_read) in kernels.items():
        if only is not None and kernel not in only:
            continue
        scored_rows = BLOCK * heads // kv_heads
        stored = kernel == "verify" and triton_backend.stores_logits(scored_rows, dim, key_pool.element_size())
        default = (triton_backend.sparse_launch_settings(dim, key_pool.element_size()) if kernel == "sparse"
                   else chosen(dim, stores_logits=stored, element_size=key_pool.element_size()))
        baseline = None
        expected = references[kernel]().float()
        rows = []
        launches = [default] + ([] if chosen_only else [v for v in LAUNCHES if v != default])
        splits_tried = (None,) if auto_splits and live is None else split_options
        for precision, launch, splits in itertools.product(precisions, launches, splits_tried):
            triton_backend.launch_settings = lambda head_dim, stores_logits=False, element_size=2, launch=launch: launch
            triton_backend.SPARSE_LAUNCH_OVERRIDE = launch  # the sparse kernel's own settings (read by it alone)
            if precision is not None:
                triton_backend._dot_precision = lambda dtype, precision=precision: precision
            try:
                output = run(splits)
                if baseline is None:
                    baseline = output.float()
                diff = float((output.float() - baseline).abs().max())
                ref_diff = float((output.float() - expected).abs().max())
                ms = graph_ms(lambda run=run, splits=splits: run(splits))
            finally:
                triton_backend.launch_settings, triton_backend._dot_precision = chosen, chosen_precision
                triton_backend.SPARSE_LAUNCH_OVERRIDE = chosen_sparse
            rows.append({**launch, "splits": splits, "precision": precision or chosen_precision(dtype), "ms": ms,
                         "max_abs_diff_vs_chosen": diff, "max_abs_diff_vs_reference": ref_diff})
        rows.sort(key=lambda row: row["ms"])
        results["kernels"][kernel] = {"floor_ms": bytes_read / bandwidth * 1e3, "chosen": default, "variants": rows}
        best = rows[0]
        # `splits` None: the count the kernel chooses for this grid, as the engine's graphs run it.
        precision_now = chosen_precision(dtype)
        mine = [r for r in rows if r.items() >= default.items() and r["precision"] == precision_now]
        chosen_row = next((r for r in mine if r["splits"] is None), None)
        unsplit = next((r for r in mine if r["splits"] == 1), None)
        live_row = next((r for r in mine if r["splits"] == "live"), None)
        rows_note = f" ({live} live)" if live is not None else ""
        print(f"{name} B={batch}{rows_note} S={seq} {dtype} {kernel:>6}: floor {bytes_read / bandwidth * 1e3:.3f} ms, "
              f"chosen {_ms(chosen_row)}, unsplit {_ms(unsplit)}, live-sized {_ms(live_row)}, best {best['ms']:.3f} ms "
              f"with {best}")
        for precision in precisions if len(precisions) > 1 else ():
            top = min((r for r in rows if r["precision"] == precision), key=lambda r: r["ms"])
            print(f"    best with {precision}: {top}")
    return results


def _ms(row: dict | None) -> str:
    return "-" if row is None else f"{row['ms']:.3f} ms"


def _points(text: str) -> list[tuple[str, int, int]]:
    """`shape:B:S,...` as `(shape, B, S)` tuples."""
    points = []
    for item in text.split(","):
        name, batch, seq = item.split(":")
        if name not in SHAPES:
            raise argparse.ArgumentTypeError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
        points.append((name, int(batch), int(seq)))
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--chosen-only", action="store_true",
                        help="time only the settings launch_settings chooses (every split count), not the sweep")
    parser.add_argument("--points", type=_points, default=POINTS,
                        help="shape:B:S,... (shapes: " + ", ".join(SHAPES) + "); default: the engine benchmarks' "
                        "points. The issue's Qwen3-1.7B grid: qwen3-1.7b:16:4096,qwen3-1.7b:16:16384,"
                        "qwen3-1.7b:64:8192,qwen3-1.7b:32:16384")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--precisions", default=None,
                        help="float32 dot-product precisions to sweep, e.g. ieee,tf32x3 (default: the chosen one)")
    parser.add_argument("--auto-splits", action="store_true",
                        help="time only the key-split count the kernel chooses, not every count")
    parser.add_argument("--kernels", default=None, help="a subset of dense,verify,verify-unscored,sparse")
    parser.add_argument("--live", type=int, default=None,
                        help="only this many of each point's B rows are real, the rest padding (a CUDA graph replayed "
                        "for a tail): dense and verify with the split count sized for all B rows and for the live ones")
    parser.add_argument("--graph-context", type=int, default=None,
                        help="the longest context the kernels' grids are sized for, as a CUDA graph's (the engine's "
                        "are 1.25x a call's longest request); default: S")
    parser.add_argument("--min-budget", type=int, default=0,
                        help="sparse decode reads at least this many view keys (the engine's default is 192)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_kernels needs a CUDA GPU")
    generator = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9, "points": []}
    for name, batch, seq in args.points:
        precisions = tuple(args.precisions.split(",")) if args.precisions else (None,)
        results["points"].append(tune_point(name, batch, seq, bandwidth, generator, args.chosen_only,
                                            getattr(torch, args.dtype), precisions, args.auto_splits,
                                            tuple(args.kernels.split(",")) if args.kernels else None,
                                            args.min_budget, args.live, args.graph_context))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
