"""The index-view refresh on the GPU: `select_index_views` (one Triton launch) against the torch path it replaced
(`torch.topk` over the stacked scores, then the merge with the recent window and its sort).

Part 1 times both paths over synthetic verify scores at the shapes of the benchmarks (every layer of B requests
at context S, 5% budgets) and checks that the Triton views equal the reference's exactly. Its "triton path" stacks
per-layer scores first, as the engine did before the verify wrote every layer into one tensor; the engine now pays the
"kernel" column alone. Part 2 (`--engine`) times S3R rounds of the Qwen3-1.7B shape that refresh every round
(forced acceptance), once with each path, in one process, with engine AR for scale.

    python tools/view_refresh.py [--sweep] [--engine] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from s3r_hf.bench_kernels import _time_ms
from s3r_hf.kernels import reference

# (name, layers, KV heads, batch, context)
POINTS = [
    ("smollm2", 30, 3, 64, 4096),
    ("smollm2", 30, 3, 64, 7936),
    ("qwen3-1.7b", 28, 8, 16, 4096),
    ("qwen3-1.7b", 28, 8, 64, 8192),
    ("qwen3-1.7b", 28, 8, 32, 16384),
]
BLOCK = 7  # verify queries per request: the history ends this far before the scored context


def torch_path(backend, per_layer, segments, history, contexts, budgets, width):
    """The refresh before `select_index_views`: stack, `torch.topk` over every scored segment, merge and sort."""
    scores = torch.stack(per_layer)
    layers, num_segments, heads, _ = scores.shape
    candidates = backend.select_topk_candidates(scores.flatten(0, 1), history.repeat(layers), width)
    candidates = candidates.view(layers, num_segments, heads, width)[:, segments]
    return reference.merge_index_views(candidates, history, contexts, budgets, width)


def triton_path(backend, per_layer, segments, history, contexts, budgets, width):
    return backend.select_index_views(torch.stack(per_layer), segments, history, contexts, budgets, width)


def refresh_inputs(layers, heads, batch, context, generator) -> tuple:
    """`(per-layer scores, segments, history, contexts, budgets, width)` of a refresh of every request after a
    verify block: mean softmax weights (positive, summing to about 1 over the keys, a few keys heavy), 5% budgets."""
    per_layer = []
    for _ in range(layers):
        logits = torch.randn(batch, heads, context, device="cuda", generator=generator) * 2.0
        per_layer.append(torch.softmax(logits, dim=-1))
    history = torch.full((batch,), context - BLOCK, device="cuda")
    contexts = history + torch.randint(1, BLOCK + 1, (batch,), device="cuda", generator=generator)
    budgets = torch.clamp((contexts.float() * 0.05).ceil().long(), min=64)
    width = math.ceil(0.05 * context) + BLOCK
    return per_layer, torch.arange(batch, device="cuda"), history, contexts, budgets, width


def kernel_point(backend, name, layers, heads, batch, context, generator) -> dict:
    args = refresh_inputs(layers, heads, batch, context, generator)
    per_layer, _, _, _, budgets, width = args
    expected = reference.select_index_views(torch.stack(per_layer), *args[1:])
    got = triton_path(backend, *args)
    old = torch_path(backend, *args)
    in_budget = torch.arange(width, device="cuda")[None, :] < budgets[:, None]
    point = {
        "model": name, "layers": layers, "kv_heads": heads, "batch": batch, "context": context, "width": width,
        "equal_to_reference": bool(torch.equal(got, expected)),
        "torch_path_rows_differing": int(((old != got) & in_budget[None, :, None, :]).any(-1).sum()),
        "torch_path_ms": _time_ms(lambda: torch_path(backend, *args)),
        "triton_path_ms": _time_ms(lambda: triton_path(backend, *args)),
        "stack_ms": _time_ms(lambda: torch.stack(per_layer)),
    }
    stacked = torch.stack(per_layer)
    point["kernel_ms"] = _time_ms(lambda: backend.select_index_views(stacked, *args[1:]))
    point["scores_read_floor_ms"] = stacked.numel() * 4 / 4.0e12 * 1e3  # one read of the scores at ~4 TB/s
    torch.cuda.empty_cache()
    return point


def sweep_point(name, layers, heads, batch, context, generator) -> list[dict]:
    """The kernel alone at other launch settings (`view_select_triton.LAUNCH_OVERRIDE`) of the register row the
    context needs: warps, keys tested a search step, output block; each checked against the reference."""
    from s3r_hf.kernels import view_select_triton

    per_layer, *rest = refresh_inputs(layers, heads, batch, context, generator)
    args = (torch.stack(per_layer), *rest)
    expected = reference.select_index_views(*args)
    chosen, rows = view_select_triton.LAUNCH_OVERRIDE, []
    row = view_select_triton._launch(context)[0]  # the register row the context needs
    warps = {4096: (4,), 8192: (8, 16), 16384: (16,)}[row]
    launches = [(row, 1024, w, thresholds) for w in warps for thresholds in (1, 2, 3, 4)] + [(row, 512, warps[0], 3)]
    try:
        for launch in launches:
            view_select_triton.LAUNCH_OVERRIDE = launch
            equal = bool(torch.equal(view_select_triton.select_index_views(*args), expected))
            ms = _time_ms(lambda: view_select_triton.select_index_views(*args))
            rows.append({"model": name, "batch": batch, "context": context, "row": launch[0], "block": launch[1],
                         "warps": launch[2], "thresholds": launch[3], "equal_to_reference": equal, "kernel_ms": ms})
            print(f"  sweep {name} B={batch} S={context}: row {launch[0]:5d}, block {launch[1]:4d}, {launch[2]:2d} "
                  f"warps, {launch[3]} keys a step: {ms:.3f} ms (equal: {equal})", flush=True)
    finally:
        view_select_triton.LAUNCH_OVERRIDE = chosen
    return rows


def engine_ab(reps: int, new_tokens: int) -> dict:
    """S3R rounds that refresh every round, with each refresh path, and engine AR, at the Qwen3-1.7B shape."""
    from s3r_hf import enable
    from s3r_hf.bench import build_model, random_prompts, time_engine
    from s3r_hf.config import S3RConfig
    from s3r_hf.engine.view_updates import IndexViewUpdates
    from s3r_hf.kernels import triton_backend

    new_rebuild = IndexViewUpdates.rebuild

    def old_rebuild(self, plan, segments, requests, contexts, width, keep_scores=False):
        seg_index = self.runner.tensor(segments)
        slots = self.runner.tensor([r.slot for r in requests])
        history = plan.dense.history_lens
        budgets = self.config.budgets(contexts)
        scores = plan.scores
        layers, num_segments, heads, _ = scores.shape
        candidates = triton_backend.select_topk_candidates(
            scores.flatten(0, 1), history.repeat(layers), plan.dense.num_candidates
        ).view(layers, num_segments, heads, -1)[:, seg_index]
        self.cache.index_views.build(None, slots, candidates, history[seg_index], contexts, budgets, width=width)
        if not keep_scores:
            plan.scores = None

    model = enable(build_model("qwen3-1.7b", torch.bfloat16, "cuda")[0])
    batch, seq = 64, 8192
    input_ids = random_prompts(model.config.vocab_size, batch, seq).cuda()
    base = S3RConfig(page_size=16, cuda_graphs=True, compile_layers=True, concurrency_min=batch,
                     concurrency_max=batch)
    s3r = S3RConfig(**{**base.to_dict(), "adaptive": False, "refresh_interval": 1})
    runs: dict[str, list[dict]] = {"ar": [], "s3r_triton_views": [], "s3r_torch_views": []}
    time_engine(model, input_ids, 16, base, "ar", None)  # warm-up: compiles, graphs
    time_engine(model, input_ids, 16, s3r, "s3r", 0.93)
    keep = ("ms_per_step", "tokens_per_s", "tau", "graph_captures")
    for _ in range(reps):
        timed = time_engine(model, input_ids, new_tokens, base, "ar", None)
        runs["ar"].append({k: timed[k] for k in keep})
        for key, rebuild in (("s3r_triton_views", new_rebuild), ("s3r_torch_views", old_rebuild)):
            IndexViewUpdates.rebuild = rebuild
            timed = time_engine(model, input_ids, new_tokens, s3r, "s3r", 0.93)
            runs[key].append({k: timed[k] for k in keep})
        IndexViewUpdates.rebuild = new_rebuild
    summary = {"runs": runs}
    for key, values in runs.items():  # the best of the runs: the machine's noise only adds time
        summary[f"{key}_ms_per_step"] = min(v["ms_per_step"] for v in values)
        summary[f"{key}_tokens_per_s"] = max(v["tokens_per_s"] for v in values)
    for key in ("s3r_triton_views", "s3r_torch_views"):
        summary[f"{key}_over_ar"] = summary[f"{key}_tokens_per_s"] / summary["ar_tokens_per_s"]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", action="store_true", help="also the Qwen3-1.7B engine A/B (part 2)")
    parser.add_argument("--engine-reps", type=int, default=3)
    parser.add_argument("--engine-tokens", type=int, default=128, help="new tokens per engine call")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel at other launch settings")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from s3r_hf.kernels import triton_backend

    generator = torch.Generator(device="cuda").manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "points": []}
    print(f"{'model':>11} {'B':>3} {'S':>6} | equal | torch path | triton path | stack | kernel | floor (ms)")
    for point in POINTS:
        row = kernel_point(triton_backend, *point, generator)
        results["points"].append(row)
        print(f"{row['model']:>11} {row['batch']:>3} {row['context']:>6} | {row['equal_to_reference']!s:>5} | "
              f"{row['torch_path_ms']:10.3f} | {row['triton_path_ms']:11.3f} | {row['stack_ms']:5.3f} | "
              f"{row['kernel_ms']:6.3f} | {row['scores_read_floor_ms']:.3f}   (torch path rows differing: "
              f"{row['torch_path_rows_differing']})", flush=True)
    if args.sweep:
        points = (POINTS[0], POINTS[3], POINTS[4])
        results["sweep"] = [row for point in points for row in sweep_point(*point, generator)]
    if args.engine:
        results["engine"] = engine_ab(args.engine_reps, args.engine_tokens)
        print("engine, Qwen3-1.7B shape, B=64, S=8K, refresh every round, ms per step:",
              json.dumps({k: v for k, v in results["engine"].items() if k != "runs"}), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
