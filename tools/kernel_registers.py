"""Registers, spill stack and shared memory of the attention kernels and the index-view kernel (`view-select`, by
the scores' length it is launched for), compiled for a GPU architecture without a GPU.

Triton compiles a kernel ahead of time for a target (here sm_90, the H100/H200) with the ptxas it ships, and
`cuobjdump` reads the registers from the cubin. Registers set how many programs an SM holds at once: at 128 threads
a program of 128 registers leaves room for four, one of 168 for three, so a grid of 512 programs (Qwen3-1.7B's
verify at 64 rows) runs in one wave or in two. A change to a kernel's code can cross such a step with no change to
what it computes; this shows it before any GPU time is spent.

    python tools/kernel_registers.py                          # every shape and kind below, as the engine launches them
    python tools/kernel_registers.py --shapes qwen3-1.7b-bf16 --kinds verify-logits

The integer arguments are given the specializations a real launch gets (strides divisible by 16, except the
arguments a kernel marks `do_not_specialize`), so the code is the one the GPU runs. Needs only `triton` with its
NVIDIA backend (the bundled ptxas and cuobjdump), and TRITON_INTERPRET unset (the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from s3r_hf.kernels import triton_backend as tb  # noqa: E402
from s3r_hf.kernels import view_select_triton as vs  # noqa: E402

SHAPES = {  # heads, KV heads, head dim, bytes per element
    "qwen3-1.7b-bf16": (16, 8, 128, 2),
    "smollm2-135m-bf16": (9, 3, 64, 2),
    "smollm2-135m-fp32": (9, 3, 64, 4),
}
KINDS = ("decode", "verify", "verify-logits", "sparse", "view-select")
DRAFT_LEN = 6
PAGE_SIZE = 16


def _signature(fn, constants: dict, element_size: int) -> tuple[dict, dict, dict]:
    """Triton's signature, constants and argument attributes for `fn`, as a launch specializes them."""
    names = fn.arg_names
    not_specialized = {names[i] if isinstance(i, int) else i for i in (fn.do_not_specialize or ())}
    data = "*bf16" if element_size == 2 else "*fp32"
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr"):
                signature[name] = data
            else:
                signature[name] = "*fp32" if name in ("lse_ptr", "logit_ptr", "scores_ptr") else "*i32"
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    aligned = [
        name for name in names
        if name.endswith("_ptr") or (name.startswith("stride") and name not in not_specialized)
    ]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return signature, {name: value for name, value in constants.items() if name in names}, attrs


KEY_RANGES = ("whole", "split", "live")
"""How a dense launch's programs find their keys: the whole context (an unsplit launch storing logits), a share of
a fixed split count, or a share of a count read on the device (a CUDA graph counting its live requests)."""


def _kernel(shape: str, kind: str, keys: str) -> tuple:
    """The kernel of `kind` at `shape` with key range `keys`, and its constants and launch options as the engine's
    launch passes them (`triton_backend.sparse_constants` / `dense_constants`)."""
    heads, kv_heads, head_dim, element_size = SHAPES[shape]
    group, dtype = heads // kv_heads, torch.bfloat16 if element_size == 2 else torch.float32
    if kind == "view-select":  # the same kernel at every shape; `keys`: the scores' length it is chosen for
        row, block, warps, thresholds = vs._launch(int(keys))
        constants = {"UNUSED": vs.UNUSED_POSITION, "ROW": row, "BLOCK": block, "THRESHOLDS": thresholds,
                     "num_warps": warps, "num_stages": 3}
        return vs._select_views_kernel, constants
    if kind == "sparse":
        return tb._sparse_decode_kernel, tb.sparse_constants(group, head_dim, PAGE_SIZE, dtype)
    stores = kind == "verify-logits"
    max_len = 1 if kind == "decode" else DRAFT_LEN + 1
    block_m, rows, settings = tb.query_tiling(max_len, group, head_dim, stores, element_size)
    splits = 1 if keys == "whole" else 2
    constants = tb.dense_constants(group, head_dim, PAGE_SIZE, dtype, block_m, rows, settings, stores,
                                   triton.cdiv(max_len, block_m) == 1, keys == "live", splits)
    return tb._dense_varlen_kernel, constants


def resources(shape: str, kind: str, keys: str = "split", arch: int = 90) -> dict:
    """Registers, spill stack (bytes per thread) and shared memory (bytes) of one kernel variant."""
    fn, constants = _kernel(shape, kind, keys)
    options = {name: constants.pop(name) for name in ("num_warps", "num_stages")}
    signature, constants, attrs = _signature(fn, constants, SHAPES[shape][3])
    compiled = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                              options=options)
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    registers, shared = int(match.group(1)), compiled.metadata.shared
    # An SM holds 64K registers, allocated in steps of eight per thread, and about 227 KiB of shared memory.
    by_registers = 65536 // (32 * options["num_warps"] * (-(-registers // 8) * 8))
    return {
        "registers": registers, "stack": int(match.group(2)), "shared": shared, "warps": options["num_warps"],
        "programs_per_sm": min(by_registers, 232448 // max(shared, 1)),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--arch", type=int, default=90, help="compute capability times ten (default 90)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    shapes, kinds = args.shapes.split(","), args.kinds.split(",")
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r} (known: {', '.join(SHAPES)})")
    for name in kinds:
        if name not in KINDS:
            parser.error(f"unknown kind {name!r} (known: {', '.join(KINDS)})")
    print(f"triton {triton.__version__}, sm_{args.arch}")
    rows = []
    print(f"{'shape':18s} {'kind':14s} {'keys':6s} {'regs':>5s} {'stack':>6s} {'shared':>7s} {'per SM':>6s}")
    for shape in shapes:
        for kind in kinds:
            # Only a launch storing logits reads the whole context by a variant of its own (`WHOLE_CONTEXT`); only
            # block graphs (the verify kinds) count live requests; the sparse kernel has one variant.
            ranges = {"verify-logits": KEY_RANGES, "verify": ("split", "live"), "decode": ("split",),
                      "view-select": ("4096", "8192", "16384") if shape == shapes[0] else ()}
            for keys in ranges.get(kind, ("any",)):
                r = resources(shape, kind, keys, args.arch)
                rows.append({"shape": shape, "kind": kind, "keys": keys, **r})
                print(f"{shape:18s} {kind:14s} {keys:6s} {r['registers']:5d} {r['stack']:6d} {r['shared']:7d} "
                      f"{r['programs_per_sm']:6d}", flush=True)
    if args.json:
        record = {"triton": triton.__version__, "arch": args.arch, "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1))
    return rows


if __name__ == "__main__":
    main()
