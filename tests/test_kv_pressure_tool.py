"""tools/kv_pressure.py (the paper's Table 2) on CPU with a tiny shape: every run completes, the constrained runs
move pages and keep every token, and the AIMD limit moves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "kv_pressure.py"


def test_the_table_runs_every_mode_under_kv_pressure(tmp_path):
    spec = importlib.util.spec_from_file_location("kv_pressure", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main([
        "--model", "qwen3-tiny", "--requests", "16", "--prompt-len", "8", "--mean-length", "12",
        "--max-new-tokens", "32", "--concurrency-min", "4", "--concurrency-max", "8", "--fixed", "4",
        "--dtype", "float32", "--admission-sigmas", "none,2", "--json", str(tmp_path / "kv.json"),
    ])
    assert (tmp_path / "kv.json").exists()
    runs = result["runs"]
    # Admissions take whatever fits now in every run but one, which forecasts with two deviations of margin.
    assert list(runs) == ["S3R ample pool", "AR, AIMD", "S3R offload-4", "S3R AIMD, admission z=2.0", "S3R AIMD",
                          "S3R AIMD, mixed steps", "AR, AIMD, mixed steps"]
    assert all("error" not in record for record in runs.values()), runs
    assert runs["S3R ample pool"]["offload_episodes"] == 0
    assert result["num_pages"] == round(0.5 * result["peak_pages"])
    for name in ("AR, AIMD", "S3R AIMD", "S3R AIMD, mixed steps", "AR, AIMD, mixed steps"):
        record = runs[name]
        assert record["stats"]["peak_kv_pages"] <= result["num_pages"]
        low, high, _ = record["concurrency"]
        assert low < high == 8, (name, record["concurrency"])
    assert any(record["pages_moved_per_1k_tokens"] > 0 for record in runs.values())
    assert runs["S3R offload-4"]["concurrency"] == [4, 4, 4]
    assert runs["S3R AIMD, admission z=2.0"]["stats"]["peak_kv_pages"] <= result["num_pages"]
