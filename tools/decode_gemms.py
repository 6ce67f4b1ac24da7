"""Time a decoder layer's GEMMs at decode row counts (GPU only): cuBLAS as the compiled layers run it, cuBLASLt's
heuristics, inductor's max-autotune (its Triton templates against ATen) and the fused layers' split-K kernel,
each against the weight-read floor.

    python tools/decode_gemms.py [--shapes smollm2-135m,qwen3-1.7b] [--rows 64,448] [--no-autotune] [--json PATH]

At a draft pass's or a dense step's row count a GEMM reads its weight once and does little arithmetic, so its
floor is the weight's bytes at the measured copy bandwidth. Each GEMM is timed over enough copies of its weight
to overflow the L2 cache, one after another from a CUDA graph, as a forward's 28-30 layers run: timing one weight
over and over would read it from L2. Outputs are compared with cuBLAS's.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from s3r_hf.bench_kernels import copy_bandwidth, graph_ms
from s3r_hf.kernels import layer_triton

SHAPES = {  # name: {GEMM: (out features, in features)}, Q/K/V and gate/up one GEMM each, as the compiled layers run
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "qwen3-1.7b": {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)},
}
L2_OVERFLOW_BYTES = 256 * 2**20  # the weights a timed chain reads: five times the H100's and H200's 50 MiB of L2
BLAS_LIBRARY = {"cublaslt": "cublaslt"}  # variants timed under another `torch.backends.cuda.preferred_blas_library`


def _autotuned(backends: str, x: torch.Tensor, w: torch.Tensor):
    """`F.linear` compiled for these shapes with max-autotune over `backends`: inductor benchmarks its choices in
    this first call, and later calls with the same shapes run the chosen kernel."""
    import torch._inductor.config as inductor_config

    # A new code object per variant and shape: dynamo caches compiled code per code object, so each compiles afresh
    # under its own options and no shape counts towards another's recompile limit.
    linear = eval("lambda x, w: F.linear(x, w)", {"F": F})  # noqa: S307
    compiled = torch.compile(linear, dynamic=False)
    with inductor_config.patch(max_autotune=True, max_autotune_gemm_backends=backends):
        compiled(x, w)
    return compiled


def time_gemm(rows: int, out_features: int, in_features: int, bandwidth: float, autotune: bool) -> dict:
    weight_bytes = out_features * in_features * 2
    copies = max(2, math.ceil(L2_OVERFLOW_BYTES / weight_bytes))
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
               * in_features**-0.5 for _ in range(copies)]
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    residual = torch.zeros(rows, out_features, device="cuda", dtype=torch.bfloat16)
    variants = {
        "cublas": lambda w: F.linear(x, w),
        "cublaslt": lambda w: F.linear(x, w),  # the same call under cuBLASLt's heuristics (`BLAS_LIBRARY`)
        "split_k": lambda w: layer_triton.linear_residual(x, w, None, residual),
    }
    if autotune:
        for backends in ("ATEN,TRITON", "TRITON"):
            name = f"autotune_{backends.lower().replace(',', '_')}"
            try:
                compiled = _autotuned(backends, x, weights[0])
                variants[name] = lambda w, compiled=compiled: compiled(x, w)
            except Exception as error:  # reported beside the others
                variants[name] = error
    expected = F.linear(x, weights[0]).float()
    result = {"rows": rows, "out": out_features, "in": in_features, "copies": copies,
              "floor_us": weight_bytes / bandwidth * 1e6, "us": {}, "max_abs_diff": {}}
    for name, gemm in variants.items():
        if isinstance(gemm, Exception):
            result["us"][name], result["max_abs_diff"][name] = None, f"{type(gemm).__name__}: {str(gemm)[:120]}"
            continue
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(BLAS_LIBRARY.get(name, previous))
        try:
            out = gemm(weights[0])
            result["max_abs_diff"][name] = float((out.float() - expected).abs().max())
            ms = graph_ms(lambda gemm=gemm: [gemm(w) for w in weights], repeats=10)
            result["us"][name] = ms / copies * 1e3
        except Exception as error:  # a variant that fails to build is reported, the others still run
            result["us"][name] = None
            result["max_abs_diff"][name] = f"{type(error).__name__}: {str(error)[:120]}"
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="64,448")
    parser.add_argument("--no-autotune", action="store_true", help="leave out inductor's max-autotune variants")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemms.py times CUDA kernels: no CUDA device here")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    results = []
    for shape in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for gemm, (out_features, in_features) in SHAPES[shape].items():
                r = time_gemm(rows, out_features, in_features, bandwidth, not args.no_autotune)
                r.update(shape=shape, gemm=gemm)
                results.append(r)
                cells = "  ".join(f"{k} {v:.1f}" if v is not None else f"{k} failed" for k, v in r["us"].items())
                print(f"{shape:>13} {gemm:>7} M={rows:<4} floor {r['floor_us']:.1f} us | {cells}", flush=True)
                bad = {k: v for k, v in r["max_abs_diff"].items() if isinstance(v, str) or v > 0.05}
                if bad:
                    print(f"    differs from cuBLAS or failed: {bad}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
