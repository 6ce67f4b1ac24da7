"""Time one decoder layer's work around the attention at decode shapes (GPU only): the fused layer kernels
(`S3RConfig.fused_layers`) against the model's own ops, eager and compiled, and against the weight-read floor.

    python tools/layer_kernels.py [--shapes smollm2-135m,qwen3-1.7b] [--rows 16,32,64,448] [--sweep] [--tf32]
                                  [--dtype bfloat16|float32] [--lm-head] [--json PATH]

For each model shape and row count (64: a draft pass or an AR step at B=64; 448: a verify block of 64 requests x 7
queries; 32: GRPO's 32 rows, and the largest count run in 16-row blocks; 16: a rollout's tail) it times, replayed
from a CUDA graph as the engine runs them:
  torch      the layer's ops as transformers runs them (bf16 `F.linear`, RMSNorm, rotary, SiLU * up, residuals),
             with Q/K/V and gate/up each one GEMM over concatenated weights, as the compiled layers run them
  compiled   the same under `torch.compile` (what `compile_layers` gives)
  fused      the three kernels of `kernels/layer_triton.py` (four launches), and each kernel alone; then with
             `mlp_block` as one persistent launch (`layer_triton.PERSISTENT_MLP`: two launches)
The attention is left out: its input is a fixed tensor. The fused output is compared with the reference
(`kernels/layer_reference.py`); the floor is the layer's weight bytes at the measured copy bandwidth. `--sweep` also
times the fused kernels at other tile settings (K block, pipeline stages, warps, 16-row blocks) with and without split K
ranges, and `mlp_block`'s persistent launch alone at other K blocks, warps, norm passes and tile widths.

With `--lm-head` it times the LM head instead: cuBLAS (`F.linear`) against `layer_triton.lm_head` (what a float32
model's LM head runs with `fused_layers`), both against float64 products; `--sweep` then times the LM head's tiles.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from s3r_hf.bench_kernels import copy_bandwidth, graph_ms
from s3r_hf.kernels import layer_reference, layer_triton

SHAPES = {  # hidden, intermediate, query heads, KV heads, head dim, Qwen3's per-head norm
    "smollm2-135m": dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, head_norm=False),
    "qwen3-1.7b": dict(hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128, head_norm=True),
}
SWEEP = [  # layer_triton's LAUNCH_OVERRIDE (K block, stages, warps), MAX_SPLITS and BLOCK_M_OVERRIDE (rows)
    dict(LAUNCH_OVERRIDE=launch, MAX_SPLITS=splits, BLOCK_M_OVERRIDE=block_m)
    for launch, splits, block_m in itertools.product(
        ((64, 3, 4), (64, 3, 8), (128, 3, 4), (128, 3, 8), (128, 2, 8)), (1, 8), (None, 16)
    )
]

# `mlp_block`'s persistent launch under `--sweep`: layer_triton's LAUNCH_OVERRIDE, UNROLLED_NORM_MAX (0: the norm's
# pass as a loop, fewer registers) and MLP_BLOCK_N.
PERSISTENT_SWEEP = [
    dict(LAUNCH_OVERRIDE=launch, UNROLLED_NORM_MAX=norm_max, MLP_BLOCK_N=block_n)
    for launch, norm_max, block_n in itertools.product(
        (None, (64, 3, 4), (64, 3, 8), (128, 3, 4)), (layer_triton.UNROLLED_NORM_MAX, 0), (32, 64)
    )
]


def _weights(shape: dict, dtype: torch.dtype, generator: torch.Generator) -> dict:
    hidden, inter, dim = shape["hidden"], shape["intermediate"], shape["head_dim"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        scale = in_features**-0.5
        return torch.randn(out_features, in_features, generator=generator, device="cuda").mul(scale).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(size, generator=generator, device="cuda")).to(dtype)

    return dict(
        input_norm=norm(hidden), post_norm=norm(hidden),
        q=linear(shape["heads"] * dim, hidden), k=linear(shape["kv_heads"] * dim, hidden),
        v=linear(shape["kv_heads"] * dim, hidden), o=linear(hidden, shape["heads"] * dim),
        gate=linear(inter, hidden), up=linear(inter, hidden), down=linear(hidden, inter),
        q_norm=norm(dim) if shape["head_norm"] else None, k_norm=norm(dim) if shape["head_norm"] else None,
    )


def _fused_chain(ops, w: dict, shape: dict, x, attended, cos, sin):
    qkv = ops.norm_qkv_rope(x, w["input_norm"], 1e-6, w["q"], w["k"], w["v"], None, None, None, cos, sin,
                            shape["head_dim"], w["q_norm"], w["k_norm"], 1e-6)
    return qkv, ops.mlp_block(attended, w["o"], None, x, w["post_norm"], 1e-6, w["gate"], w["up"], w["down"])


def _torch_chain(w: dict, shape: dict, x, attended, cos, sin):
    """The layer's ops as transformers' Llama/Qwen3 modules run them (attention left out)."""

    def norm(h, weight):
        return layer_reference.rms_norm(h, weight, 1e-6)  # `LlamaRMSNorm`'s arithmetic

    def rotate(h):  # in the model dtype, as transformers' `apply_rotary_pos_emb` (the reference rotates in float32)
        half = h.shape[-1] // 2
        return h * cos[:, None] + torch.cat([-h[..., half:], h[..., :half]], -1) * sin[:, None]

    rows, dim = x.shape[0], shape["head_dim"]
    normed = norm(x, w["input_norm"])
    # One GEMM for Q/K/V and one for gate/up, as the compiled layers run them (`fused_projections`).
    q, k, v = F.linear(normed, w["qkv"]).view(rows, -1, dim).split([shape["heads"], *[shape["kv_heads"]] * 2], 1)
    if w["q_norm"] is not None:
        q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
    qkv = torch.cat([rotate(q), rotate(k), v], 1)
    mixed = x + F.linear(attended, w["o"])
    normed = norm(mixed, w["post_norm"])
    gate, up = F.linear(normed, w["gate_up"]).chunk(2, dim=-1)
    return qkv, mixed + F.linear(F.silu(gate) * up, w["down"])


def _ms(fn) -> float:
    return graph_ms(fn, repeats=50)  # a layer's kernels take tens of microseconds: more replays than the default


def time_point(name: str, rows: int, sweep: bool, bandwidth: float, dtype: torch.dtype) -> dict:
    shape = SHAPES[name]
    generator = torch.Generator(device="cuda").manual_seed(0)
    w = _weights(shape, dtype, generator)
    x = torch.randn(rows, shape["hidden"], generator=generator, device="cuda").to(dtype)
    attended = torch.randn(rows, shape["heads"] * shape["head_dim"], generator=generator, device="cuda").to(dtype)
    angles = torch.rand(rows, shape["head_dim"] // 2, generator=generator, device="cuda") * 100
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    weight_bytes = sum(t.numel() * t.element_size() for t in w.values() if t is not None)
    w = {**w, "qkv": torch.cat([w["q"], w["k"], w["v"]]), "gate_up": torch.cat([w["gate"], w["up"]])}
    args = (w, shape, x, attended, cos, sin)
    row = {"shape": name, "rows": rows, "floor_ms": weight_bytes / bandwidth * 1e3}

    reference = _fused_chain(layer_reference, *args)
    fused = _fused_chain(layer_triton, *args)
    row["max_abs_error"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused, reference))
    row["torch_ms"] = _ms(lambda: _torch_chain(*args))
    # Every point is a new shape of the same function: past dynamo's recompile limit the compiled baseline would
    # silently run eagerly, so each point compiles from a clean cache.
    torch._dynamo.reset()
    compiled = torch.compile(_torch_chain, dynamic=False)
    compiled(*args)
    row["compiled_ms"] = _ms(lambda: compiled(*args))
    row["fused_ms"] = _ms(lambda: _fused_chain(layer_triton, *args))
    # The same chain with `mlp_block` as one persistent launch, checked against the reference first.
    layer_triton.PERSISTENT_MLP = True
    try:
        persistent = _fused_chain(layer_triton, *args)
        row["persistent_max_abs_error"] = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(persistent, reference)
        )
        row["fused_persistent_ms"] = _ms(lambda: _fused_chain(layer_triton, *args))
        def block():
            return layer_triton.mlp_block(attended, w["o"], None, x, w["post_norm"], 1e-6, w["gate"], w["up"],
                                          w["down"])

        row["mlp_block_persistent_ms"] = _ms(block)
        if sweep:
            row["persistent_sweep"] = _sweep_persistent(block, reference[1])
    finally:
        layer_triton.PERSISTENT_MLP = False
    mixed = layer_triton.linear_residual(attended, w["o"], None, x)
    activated = layer_triton.norm_gate_up_silu(mixed, w["post_norm"], 1e-6, w["gate"], w["up"])
    row["kernels_ms"] = {
        "norm_qkv_rope": _ms(lambda: layer_triton.norm_qkv_rope(
            x, w["input_norm"], 1e-6, w["q"], w["k"], w["v"], None, None, None, cos, sin, shape["head_dim"],
            w["q_norm"], w["k_norm"], 1e-6)),
        "o_residual": _ms(lambda: layer_triton.linear_residual(attended, w["o"], None, x)),
        "norm_gate_up_silu": _ms(lambda: layer_triton.norm_gate_up_silu(
            mixed, w["post_norm"], 1e-6, w["gate"], w["up"])),
        "down_residual": _ms(lambda: layer_triton.linear_residual(activated, w["down"], None, mixed)),
    }
    if sweep:
        row["sweep"] = []
        chosen = {key: getattr(layer_triton, key) for key in SWEEP[0]}
        for setting in SWEEP:
            for key, value in setting.items():
                setattr(layer_triton, key, value)
            try:
                outputs = _fused_chain(layer_triton, *args)
                error = max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs, reference))
                ms = _ms(lambda: _fused_chain(layer_triton, *args))
                row["sweep"].append({**setting, "ms": ms, "max_abs_error": error})
            except Exception as error:  # a setting that does not fit the shared memory
                row["sweep"].append({**setting, "error": str(error).splitlines()[0][:120]})
        for key, value in chosen.items():
            setattr(layer_triton, key, value)
    return row


def _sweep_persistent(block: Callable[[], torch.Tensor], expected: torch.Tensor) -> list[dict]:
    """`block`, `mlp_block`'s persistent launch alone, at each of `PERSISTENT_SWEEP`'s settings, checked against
    `expected`."""
    results = []
    chosen = {key: getattr(layer_triton, key) for key in PERSISTENT_SWEEP[0]}
    for setting in PERSISTENT_SWEEP:
        for key, value in setting.items():
            setattr(layer_triton, key, value)
        try:
            error = (block().float() - expected.float()).abs().max().item()
            results.append({**setting, "ms": _ms(block), "max_abs_error": error})
        except Exception as error:  # a setting that does not fit the shared memory
            results.append({**setting, "error": str(error).splitlines()[0][:120]})
    for key, value in chosen.items():
        setattr(layer_triton, key, value)
    return results


VOCAB = {"smollm2-135m": 49152, "qwen3-1.7b": 151936}
LM_HEAD_SWEEP = [None] + [  # layer_triton's LM_HEAD_OVERRIDE: (BLOCK_N, K-tile bytes, warps, stages)
    (block_n, k_bytes, warps, stages)
    for block_n, k_bytes, warps, stages in itertools.product((64, 128, 256), (64, 128, 256), (4, 8), (3,))
]


def time_lm_head(name: str, rows: int, sweep: bool, bandwidth: float, dtype: torch.dtype) -> dict:
    """The LM head at `rows` rows: cuBLAS (`F.linear`, as the model's `lm_head` runs) against `layer_triton.lm_head`
    and the weights' read floor; errors against float64 products."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = SHAPES[name]["hidden"]
    weight = (torch.randn(VOCAB[name], hidden, generator=generator, device="cuda") * hidden**-0.5).to(dtype)
    x = torch.randn(rows, hidden, generator=generator, device="cuda").to(dtype)
    exact = x.double() @ weight.double().t()
    row = {"shape": name, "rows": rows, "floor_ms": weight.numel() * weight.element_size() / bandwidth * 1e3,
           "cublas_ms": _ms(lambda: F.linear(x, weight)), "fused_ms": _ms(lambda: layer_triton.lm_head(x, weight)),
           "cublas_error": (F.linear(x, weight).double() - exact).abs().max().item(),
           "fused_error": (layer_triton.lm_head(x, weight).double() - exact).abs().max().item()}
    if sweep:
        row["sweep"] = []
        for setting in LM_HEAD_SWEEP[1:]:
            layer_triton.LM_HEAD_OVERRIDE = setting
            try:
                error = (layer_triton.lm_head(x, weight).double() - exact).abs().max().item()
                row["sweep"].append({"setting": setting, "ms": _ms(lambda: layer_triton.lm_head(x, weight)),
                                     "max_abs_error": error})
            except Exception as error:  # a setting that does not fit the shared memory
                row["sweep"].append({"setting": setting, "error": str(error).splitlines()[0][:120]})
        layer_triton.LM_HEAD_OVERRIDE = None
    return row


def lm_head_rows(args: argparse.Namespace, bandwidth: float, dtype: torch.dtype) -> list[dict]:
    print(f"{'shape':14} {'rows':>5} {'floor':>7} {'cublas':>7} {'fused':>7}  max error vs float64 (cublas, fused)")
    rows = []
    for name in args.shapes.split(","):
        for count in (int(r) for r in args.rows.split(",")):
            row = time_lm_head(name, count, args.sweep, bandwidth, dtype)
            rows.append(row)
            print(f"{name:14} {count:5d} {row['floor_ms']:7.4f} {row['cublas_ms']:7.4f} {row['fused_ms']:7.4f}  "
                  f"{row['cublas_error']:.3g} {row['fused_error']:.3g}", flush=True)
            for setting in sorted(row.get("sweep", []), key=lambda s: s.get("ms", 1e9))[:4]:
                print("    sweep", setting, flush=True)
    return rows


def layer_rows(args: argparse.Namespace, bandwidth: float, dtype: torch.dtype) -> list[dict]:
    print(f"{'shape':14} {'rows':>5} {'floor':>7} {'torch':>7} {'compiled':>8} {'fused':>7} {'persist':>7}  "
          "per kernel (ms)")
    rows = []
    for name in args.shapes.split(","):
        for count in (int(r) for r in args.rows.split(",")):
            row = time_point(name, count, args.sweep, bandwidth, dtype)
            rows.append(row)
            kernels = " ".join(f"{k}={v:.4f}" for k, v in row["kernels_ms"].items())
            print(f"{name:14} {count:5d} {row['floor_ms']:7.4f} {row['torch_ms']:7.4f} {row['compiled_ms']:8.4f} "
                  f"{row['fused_ms']:7.4f} {row['fused_persistent_ms']:7.4f}  {kernels} "
                  f"mlp_block_persistent={row['mlp_block_persistent_ms']:.4f}  err={row['max_abs_error']:.3g} "
                  f"persistent err={row['persistent_max_abs_error']:.3g}", flush=True)
            for setting in sorted(row.get("sweep", []), key=lambda s: s.get("ms", 1e9))[:5]:
                print("    sweep", setting, flush=True)
            for setting in sorted(row.get("persistent_sweep", []), key=lambda s: s.get("ms", 1e9))[:5]:
                print("    persistent sweep", setting, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="16,32,64,448")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tf32", action="store_true",
                        help="float32 matmuls and the fused kernels' products in TF32, as in float32 draft passes "
                             "(S3RConfig.draft_matmul_precision='high')")
    parser.add_argument("--lm-head", action="store_true",
                        help="time the LM head instead (cuBLAS against layer_triton.lm_head; --sweep: its tiles)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tools/layer_kernels.py times CUDA kernels: it needs a GPU")
    bandwidth = copy_bandwidth()
    dtype = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32  # read by cuBLAS, inductor and the fused kernels alike
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.dtype}{' (TF32 products)' if args.tf32 else ''}")
    rows = (lm_head_rows if args.lm_head else layer_rows)(args, bandwidth, dtype)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)


if __name__ == "__main__":
    main()
