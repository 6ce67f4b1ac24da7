"""Kernel microbenchmarks and GPU correctness checks: `python -m s3r_hf.bench_kernels [--json PATH]`.

For each (B, S) of the Qwen3-1.7B attention shape (16 query heads, 8 KV heads, head dim 128, bf16) it times
one layer of: dense decode over the paged cache (Triton), the verify block (k+1 queries, scored), sparse
decode over a 5% index view (Triton), PyTorch SDPA over contiguous K/V, `torch.gather` + SDPA over the same
5% (the copy an index-view kernel avoids), and the index-view refresh from the verify's scores
(`select_index_views`, one layer); and reports the bandwidth floor (all K/V
bytes the dense step must read at the measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from s3r_hf.cuda_graphs import capture_graph
from s3r_hf.kernels import reference

SHAPE = dict(num_heads=16, num_kv_heads=8, head_dim=128)
POINTS = [(16, 4096), (16, 16384), (64, 8192), (32, 16384)]


def _time_ms(fn, repeats: int = 20) -> float:
    """Median CUDA-event time of `fn` in ms (after two warm-up calls)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, repeats: int = 20) -> float:
    """Mean time of `fn` replayed from a CUDA graph, as the engine runs it: no host launch cost is counted (an
    eager timing of a 0.1 ms kernel measures mostly its Python launch)."""
    graph, _ = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def _paged_setup(
    batch: int, seq: int, page_size: int, dtype: torch.dtype, generator: torch.Generator, shape: dict = SHAPE
):
    heads, kv_heads, dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    pages_per = math.ceil((seq + 8) / page_size)
    num_pages = batch * pages_per
    key_pool = torch.randn(num_pages, page_size, kv_heads, dim, device="cuda", dtype=dtype, generator=generator)
    value_pool = torch.randn_like(key_pool)
    order = torch.randperm(num_pages, device="cuda", generator=generator).int()
    block_tables = order.view(batch, pages_per)
    return key_pool, value_pool, block_tables, heads, kv_heads, dim


class StepMetadata(NamedTuple):
    """One layer's kernel metadata at context `seq`: a decode step (one query per request), a verify block of
    `block` queries per request (scored from its first), and sparse decode over `view_keys`-key index views with
    the block's provisional tail, as the engine's plans hold it: in int32 (int64 would time a conversion kernel
    with every launch, several microseconds next to a sparse kernel's few)."""

    decode_cu: torch.Tensor
    decode_positions: torch.Tensor
    verify_cu: torch.Tensor
    verify_positions: torch.Tensor
    score_starts: torch.Tensor
    view_lens: torch.Tensor
    tail_starts: torch.Tensor
    sparse_positions: torch.Tensor


def step_metadata(batch: int, seq: int, block: int, view_keys: int) -> StepMetadata:
    int32 = dict(dtype=torch.int32, device="cuda")
    tails = torch.full((batch,), seq - block, **int32)
    return StepMetadata(
        decode_cu=torch.arange(batch + 1, **int32),
        decode_positions=torch.full((batch,), seq - 1, **int32),
        verify_cu=torch.arange(0, batch * block + 1, block, **int32),
        verify_positions=torch.cat([torch.arange(seq - block, seq) for _ in range(batch)]).to(**int32),
        score_starts=torch.zeros(batch, **int32),
        view_lens=torch.full((batch,), view_keys, **int32),
        tail_starts=tails,
        sparse_positions=tails + 2,
    )


def check_correctness(triton_backend, generator: torch.Generator) -> dict:
    """Max abs differences Triton vs reference at a moderate shape, fp32 and bf16."""
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        batch, seq, page = 4, 2048, 16
        key_pool, value_pool, tables, heads, kv_heads, dim = _paged_setup(batch, seq, page, dtype, generator)
        block = 7
        positions = torch.cat([torch.arange(seq - block, seq) for _ in range(batch)]).cuda()
        cu = torch.arange(0, batch * block + 1, block, device="cuda")
        query = torch.randn(batch * block, heads, dim, device="cuda", dtype=dtype, generator=generator)
        starts = torch.zeros(batch, dtype=torch.long, device="cuda")
        ref = reference.paged_dense_attention(query, key_pool, value_pool, tables, cu, positions, dim**-0.5, starts)
        tri = triton_backend.paged_dense_attention(query, key_pool, value_pool, tables, cu, positions, dim**-0.5,
                                                   starts)
        budget = 128
        view = torch.stack([
            torch.randperm(seq - 8, device="cuda", generator=generator)[:budget].sort().values
            for _ in range(batch * kv_heads)
        ]).view(batch, kv_heads, budget).int()
        lens = torch.full((batch,), budget, device="cuda")
        tails = torch.full((batch,), seq - 8, device="cuda")
        pos = tails + 3
        q1 = torch.randn(batch, heads, dim, device="cuda", dtype=dtype, generator=generator)
        sref = reference.paged_sparse_attention(q1, key_pool, value_pool, tables, view, lens, tails, pos, dim**-0.5)
        stri = triton_backend.paged_sparse_attention(q1, key_pool, value_pool, tables, view, lens, tails, pos,
                                                     dim**-0.5)
        name = str(dtype).replace("torch.", "")
        results[name] = {
            "dense_out": float((ref[0].float() - tri[0].float()).abs().max()),
            "dense_lse": float((ref[1] - tri[1]).abs().max()),
            "dense_scores": float((ref[2] - tri[2]).abs().max()),
            "sparse_out": float((sref[0].float() - stri[0].float()).abs().max()),
            "sparse_lse": float((sref[1] - stri[1]).abs().max()),
        }
    return results


def bench_point(triton_backend, batch: int, seq: int, bandwidth: float, generator: torch.Generator) -> dict:
    """One (B, S) point, with the key split chosen automatically and, as a variant, without splitting."""
    automatic = _bench_point(triton_backend, batch, seq, bandwidth, generator)
    choose_splits = triton_backend._num_splits
    triton_backend._num_splits = lambda programs, keys, min_keys, **_: 1
    try:
        unsplit = _bench_point(triton_backend, batch, seq, bandwidth, generator)
    finally:
        triton_backend._num_splits = choose_splits
    for name in ("dense_decode_ms", "verify_scored_ms", "verify_unscored_ms", "sparse_decode_ms"):
        automatic[f"{name}_unsplit"] = unsplit[name]
    return automatic


def _bench_point(triton_backend, batch: int, seq: int, bandwidth: float, generator: torch.Generator) -> dict:
    dtype, page, ratio, block = torch.bfloat16, 16, 0.05, 7
    key_pool, value_pool, tables, heads, kv_heads, dim = _paged_setup(batch, seq, page, dtype, generator)
    scale = dim**-0.5
    kv_bytes = 2 * batch * seq * kv_heads * dim * key_pool.element_size()
    floor_ms = kv_bytes / bandwidth * 1e3

    budget = math.ceil(ratio * seq)
    cu1, pos1, cuv, posv, starts, lens, tails, pos_s = step_metadata(batch, seq, block, budget)
    # Dense decode: one query per request at position seq-1.
    q1 = torch.randn(batch, heads, dim, device="cuda", dtype=dtype, generator=generator)
    decode_hints = dict(max_query_len=1, max_context=seq)
    dense_ms = _time_ms(lambda: triton_backend.paged_dense_attention(q1, key_pool, value_pool, tables, cu1, pos1,
                                                                     scale, **decode_hints))
    # Verify block: k+1 queries per request, scored.
    qv = torch.randn(batch * block, heads, dim, device="cuda", dtype=dtype, generator=generator)
    hints = dict(max_query_len=block, max_context=seq, max_scored_queries=block)
    verify_ms = _time_ms(lambda: triton_backend.paged_dense_attention(qv, key_pool, value_pool, tables, cuv, posv,
                                                                      scale, starts, **hints))
    verify_plain_ms = _time_ms(lambda: triton_backend.paged_dense_attention(qv, key_pool, value_pool, tables, cuv,
                                                                            posv, scale, **hints))
    _, _, scores = triton_backend.paged_dense_attention(qv, key_pool, value_pool, tables, cuv, posv, scale, starts)
    history = torch.full((batch,), seq - block, device="cuda")
    segments, budgets = torch.arange(batch, device="cuda"), torch.full((batch,), budget, device="cuda")
    views_ms = _time_ms(lambda: triton_backend.select_index_views(
        scores[None], segments, history, history + block, budgets, budget
    ))
    # Sparse decode over a 5% view (+ 3 provisional tail positions).
    view = triton_backend.select_topk_candidates(scores, history, budget).sort(dim=-1).values.int()
    sparse_ms = _time_ms(lambda: triton_backend.paged_sparse_attention(q1, key_pool, value_pool, tables, view, lens,
                                                                       tails, pos_s, scale, max_keys=budget + 3))
    # Baselines on contiguous tensors: SDPA dense, and gather + SDPA over the same 5%.
    k_dense = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=dtype, generator=generator)
    v_dense = torch.randn_like(k_dense)
    q_sdpa = q1.view(batch, heads, 1, dim)
    sdpa_ms = _time_ms(lambda: F.scaled_dot_product_attention(q_sdpa, k_dense, v_dense, enable_gqa=True))
    index = view.long().clamp(min=0)[..., None].expand(-1, -1, -1, dim)

    def gather_sdpa():
        k_sel = torch.gather(k_dense, 2, index)
        v_sel = torch.gather(v_dense, 2, index)
        return F.scaled_dot_product_attention(q_sdpa, k_sel, v_sel, enable_gqa=True)

    gather_ms = _time_ms(gather_sdpa)
    return {
        "batch": batch, "seq": seq, "kv_bytes_per_layer": kv_bytes, "floor_ms": floor_ms,
        "dense_decode_ms": dense_ms, "dense_vs_floor": dense_ms / floor_ms,
        "verify_scored_ms": verify_ms, "verify_unscored_ms": verify_plain_ms,
        "sparse_decode_ms": sparse_ms, "sparse_vs_dense": sparse_ms / dense_ms,
        "view_refresh_ms": views_ms, "sdpa_dense_ms": sdpa_ms, "gather_sdpa_ms": gather_ms,
        "budget": budget,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU")
    from s3r_hf.kernels import triton_backend

    generator = torch.Generator(device="cuda").manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "correctness": check_correctness(triton_backend, generator)}
    print("correctness (max abs diff, Triton vs reference):", json.dumps(results["correctness"], indent=1))
    bandwidth = copy_bandwidth()
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    results["points"] = []
    header = ("B", "S", "floor", "dense", "x floor", "dense 1sp", "verify+sc", "verify", "sparse", "sparse 1sp",
              "sp/dense", "views", "sdpa", "gather+sdpa")
    print(" | ".join(f"{h:>9}" for h in header))
    for batch, seq in POINTS:
        point = bench_point(triton_backend, batch, seq, bandwidth, generator)
        results["points"].append(point)
        row = (batch, seq, point["floor_ms"], point["dense_decode_ms"], point["dense_vs_floor"],
               point["dense_decode_ms_unsplit"], point["verify_scored_ms"], point["verify_unscored_ms"],
               point["sparse_decode_ms"], point["sparse_decode_ms_unsplit"], point["sparse_vs_dense"],
               point["view_refresh_ms"], point["sdpa_dense_ms"], point["gather_sdpa_ms"])
        print(" | ".join(f"{v:>9.3f}" if isinstance(v, float) else f"{v:>9}" for v in row))
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
