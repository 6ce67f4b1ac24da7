"""Time a decoder layer's GEMMs at decode row counts (GPU only): cuBLAS as the compiled layers run it, cuBLASLt's
heuristics, inductor's max-autotune (its Triton templates against ATen) and the fused layers' split-K kernel,
each against the weight-read floor; with `--triton-sweep` also `decode_linear` (bf16, int8 and float8 weights, and
int8 with a scale per group of 64 or 128 weights; the draft passes' kernel of `S3RConfig.draft_weights`) over its
launch settings, and float8 cuBLASLt.

    python tools/decode_gemms.py [--shapes smollm2-135m,qwen3-1.7b] [--rows 64,448] [--no-autotune]
                                 [--triton-sweep] [--json PATH]

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
from s3r_hf.kernels import decode_linear_reference, decode_linear_triton, layer_triton

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


def _sweep_launches(rows: int, out_features: int, in_features: int) -> list[tuple[int, int, int, int, int]]:
    """`decode_linear` launch settings around its default: tile widths, K tiles, half and twice the splits, stages."""
    _, _, splits, _, _ = decode_linear_triton.default_launch(rows, out_features, in_features, torch.device("cuda"))
    return [(block_n, block_k, s, 4, stages) for block_n in (64, 128) for block_k in (128, 256)
            for s in sorted({max(1, splits // 2), splits, splits * 2}) for stages in (3, 4)]


def _best(variants: dict, name: str, launches: list, make) -> None:
    """One variant per launch setting, `name@BN,BK,S,W,ST`; `main` reports the fastest of each name."""
    for launch in launches:
        variants[f"{name}@{','.join(map(str, launch))}"] = make(launch)


def time_gemm(rows: int, out_features: int, in_features: int, bandwidth: float, autotune: bool,
              triton_sweep: bool = False) -> dict:
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
    if triton_sweep:  # `decode_linear`: bf16 weights, float8 and int8 weights with a scale per output feature, and
        # int8 weights with a scale per group
        quantized = {id(w): decode_linear_reference.quantize_rows(w) for w in weights}
        launches = _sweep_launches(rows, out_features, in_features)
        _best(variants, "triton_bf16", launches,
              lambda launch: lambda w: decode_linear_triton.decode_linear(x, w, launch=launch))
        _best(variants, "triton_fp8", launches,
              lambda launch: lambda w: decode_linear_triton.decode_linear(x, *quantized[id(w)], launch=launch))
        int8 = {id(w): decode_linear_reference.quantize_rows(w, torch.int8) for w in weights}
        _best(variants, "triton_int8", launches,
              lambda launch: lambda w: decode_linear_triton.decode_linear(x, *int8[id(w)], launch=launch))
        for group in decode_linear_triton.GROUPS:  # int8 with a scale per group: the group is the K tile
            by_group = {id(w): decode_linear_reference.quantize_rows(w, torch.int8, group=group) for w in weights}
            _best(variants, f"triton_int8_g{group}", sorted({(n, group, *rest) for n, _, *rest in launches}),
                  lambda launch, copies=by_group: lambda weight: decode_linear_triton.decode_linear(
                      x, *copies[id(weight)], launch=launch))
        # cuBLASLt's float8 GEMM with the activations already quantized by row: a lower bound of that path, which
        # would quantize them in the kernel before it
        x8, x_scale = decode_linear_reference.quantize_rows(x)
        variants["scaled_mm_fp8"] = lambda w: torch._scaled_mm(
            x8, quantized[id(w)][0].t(), scale_a=x_scale[:, None], scale_b=quantized[id(w)][1][None, :],
            out_dtype=torch.bfloat16)
    if autotune:
        for backends in ("ATEN,TRITON", "TRITON"):
            name = f"autotune_{backends.lower().replace(',', '_')}"
            try:
                compiled = _autotuned(backends, x, weights[0])
                variants[name] = lambda w, compiled=compiled: compiled(x, w)
            except Exception as error:  # reported beside the others
                variants[name] = error
    expected = F.linear(x, weights[0]).float()  # 8-bit variants differ by their weights' rounding (~0.1)
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
    parser.add_argument("--triton-sweep", action="store_true",
                        help="also time decode_linear (bf16, int8 and float8 weights; the 8-bit ones read half the "
                        "bytes the printed floor counts) over launch settings, and float8 cuBLASLt")
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
                r = time_gemm(rows, out_features, in_features, bandwidth, not args.no_autotune, args.triton_sweep)
                r.update(shape=shape, gemm=gemm)
                results.append(r)
                best: dict[str, tuple[float, str]] = {}  # the fastest launch of each swept variant
                for k, v in r["us"].items():
                    name, _, launch = k.partition("@")
                    if v is not None and (name not in best or v < best[name][0]):
                        best[name] = (v, launch)
                cells = "  ".join(f"{k} {v:.1f}" + (f" [{at}]" if at else "") for k, (v, at) in best.items())
                failed = [k for k, v in r["us"].items() if v is None]
                print(f"{shape:>13} {gemm:>7} M={rows:<4} floor {r['floor_us']:.1f} us | {cells}"
                      + (f" | failed: {', '.join(failed)}" if failed else ""), flush=True)
                tolerance = {"triton_fp8": 0.5, "scaled_mm_fp8": 0.5, "triton_int8": 0.2, "triton_int8_g64": 0.2,
                             "triton_int8_g128": 0.2}
                bad = {k: v for k, v in r["max_abs_diff"].items()
                       if isinstance(v, str) or v > tolerance.get(k.partition("@")[0], 0.05)}
                if bad:
                    print(f"    differs from cuBLAS or failed: {bad}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
