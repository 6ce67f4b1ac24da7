"""The sparse draft kernel's launch settings in the engine (GPU only): the kernel swept at one layer, then S3R and
engine AR on the Qwen3-1.7B shape with the chosen setting and with the sweep's fastest unsplit one.

    python tools/sparse_launch_ab.py [--point qwen3-1.7b:64:8192] [--max-new-tokens 96] [--json PATH]

The kernel sweep is `tools/tune_kernels.py --kernels sparse` at the point (graph-timed, each setting checked against
the chosen one's output). Each engine run is `s3r-hf bench` in a child process of its own with
`triton_backend.SPARSE_LAUNCH_OVERRIDE` set, so the two share one machine and nothing else: forced acceptance
(random weights; it times the cost side), graphs and compiled layers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tune_kernels  # noqa: E402

from s3r_hf.bench_kernels import copy_bandwidth  # noqa: E402

CHILD = """
import json, sys
from s3r_hf.kernels import triton_backend
triton_backend.SPARSE_LAUNCH_OVERRIDE = json.loads(sys.argv[1])
from s3r_hf.cli import main
sys.exit(main(sys.argv[2:]))
"""


def fastest_unsplit(point: dict) -> dict:
    rows = [r for r in point["kernels"]["sparse"]["variants"] if r["splits"] in (None, 1)]
    best = min(rows, key=lambda r: r["ms"])
    return {key: best[key] for key in ("BLOCK_N", "num_warps", "num_stages")}


def engine_run(launch: dict | None, name: str, model: str, batch: int, seq: int, tokens: int, out: Path) -> dict:
    args = ["bench", "--model", model, "--batch", str(batch), "--seq", str(seq), "--max-new-tokens", str(tokens),
            "--acceptance", "0.93", "--skip-generate", "--cuda-graphs", "--compile-layers", "--json", str(out)]
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(launch), *args], capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if "warn" not in line.lower()]
    print(f"== {name}: sparse launch {launch or 'chosen'}\n" + "\n".join(lines[-8:]), flush=True)
    if done.returncode != 0:
        print(done.stderr[-2000:], flush=True)
    return json.loads(out.read_text()) if out.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--point", default="qwen3-1.7b:64:8192",
                        help="qwen3-1.7b:B:S, the point of the sweep and of the engine runs")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", default="sparse_launch_ab.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sparse_launch_ab.py times CUDA kernels: no CUDA device here")
    (name, batch, seq), = tune_kernels._points(args.point)
    point = tune_kernels.tune_point(name, batch, seq, copy_bandwidth(), torch.Generator(device="cuda").manual_seed(0),
                                    only=("sparse",), min_budget=192)
    best = fastest_unsplit(point)
    chosen = dict(point["kernels"]["sparse"]["chosen"])
    results = {"sweep": point, "fastest_unsplit": best, "engine": {}}
    out = Path(args.json)
    runs = [("chosen", None)] + ([("fastest", best)] if best != chosen else [])
    for label, launch in runs:
        results["engine"][label] = engine_run(launch, label, name, batch, seq, args.max_new_tokens,
                                              out.with_name(f"{out.stem}_{label}.json"))
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
