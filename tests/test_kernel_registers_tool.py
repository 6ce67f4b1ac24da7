"""tools/kernel_registers.py compiles the attention kernels for sm_90 without a GPU and reads their registers. The
unsplit launch that stores verify logits (`WHOLE_CONTEXT`) at Qwen3-1.7B's heads must fit four programs per SM:
with the split arithmetic in it, it held 168 registers instead of 128 (Triton 3.6 and 3.9 alike), three programs
per SM, and S3R's rounds at 64 rows ran 15% slower on the H200 (docs/benchmarks.md). A new Triton that changes this
fails here on purpose: the occupancy step is worth knowing before the GPU shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "kernel_registers.py"


def test_the_unsplit_logit_storing_verify_fits_four_programs_per_sm(tmp_path):
    # A process of its own: the suite runs Triton under its interpreter, which compiles nothing.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = tmp_path / "registers.json"
    subprocess.run([sys.executable, str(TOOL), "--shapes", "qwen3-1.7b-bf16", "--kinds", "verify-logits",
                    "--json", str(out)], env=env, check=True, capture_output=True, timeout=300)
    rows = {row["keys"]: row for row in json.loads(out.read_text())["rows"]}
    whole, split = rows["whole"], rows["split"]
    for usage in (whole, split):
        assert 16 <= usage["registers"] <= 255 and usage["shared"] > 0 and usage["programs_per_sm"] >= 1, usage
    assert whole["registers"] <= 128 and whole["programs_per_sm"] >= 4, whole
    assert whole["registers"] <= split["registers"], (whole, split)


def test_the_view_select_kernel_keeps_its_warps_in_flight(tmp_path):
    """Each register-row variant of the index-view kernel, as `_launch` picks it for 4K, 8K and 16K scores, keeps 16
    warps or more in flight per SM, with nothing spilled: the output pass over the register row at once (its scans'
    arrays beside the row) took 202 registers at 8K, one program of eight warps per SM; in blocks it takes 80,
    three programs. Testing three keys a search step takes no more there, four would take 124 (two programs)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = tmp_path / "registers.json"
    subprocess.run([sys.executable, str(TOOL), "--shapes", "qwen3-1.7b-bf16", "--kinds", "view-select",
                    "--json", str(out)], env=env, check=True, capture_output=True, timeout=300)
    rows = {row["keys"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"4096", "8192", "16384"}
    for usage in rows.values():
        assert usage["stack"] == 0 and usage["programs_per_sm"] * usage["warps"] >= 16, usage
