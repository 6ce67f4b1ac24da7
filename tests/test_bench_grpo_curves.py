"""tools/bench_grpo.py's training-curve path on CPU: the arithmetic dataset, several seeds, per-step records, the
two-panel plot, and concurrent runs placed one per device."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_tokenizer
from tests.test_trl_integration import tiny_policy

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_grpo.py"
TINY_S3R = '{"draft_len": 2, "min_budget": 2, "budget_ratio": 0.1, "page_size": 4}'


def bench_grpo():
    spec = importlib.util.spec_from_file_location("bench_grpo", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("policy")
    tiny_policy().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def test_two_steps_per_mode_and_seed_on_arithmetic_give_records_and_the_plot(tiny_model_dir, tmp_path):
    bench = bench_grpo()
    out, plot = tmp_path / "curves.json", tmp_path / "curves.png"
    results = bench.main([
        "--model", tiny_model_dir, "--dataset", "arithmetic", "--arithmetic-size", "16", "--arithmetic-seed", "5",
        "--modes", "s3r,trl", "--seeds", "1,2", "--max-steps", "2", "--num-generations", "4",
        "--per-device-batch", "4", "--max-completion-length", "6", "--learning-rate", "1e-2",
        "--s3r-config", TINY_S3R, "--in-process", "--output-dir", str(tmp_path / "trainer"),
        "--json", str(out), "--plot", str(plot),
    ])
    assert [(r["mode"], r["seed"], r["status"]) for r in results] == [
        ("s3r", 1, "ok"), ("s3r", 2, "ok"), ("trl", 1, "ok"), ("trl", 2, "ok")]
    for result in results:
        assert [row["step"] for row in result["steps"]] == [1, 2]
        for row in result["steps"]:
            assert {"reward", "mean_length", "step_seconds", "generate_seconds", "gc_seconds"} <= row.keys()
            assert row["step_seconds"] > 0 and row["generate_seconds"] > 0 and row["gc_seconds"] >= 0
        assert result["summary"]["steps"] == 2
    assert all("tau" in row for result in results if result["mode"] == "s3r" for row in result["steps"])
    # The adaptive rule's per-bucket record comes with each S3R run (the rollouts of all its steps).
    assert all(result["draft_policy"] and sum(b["rounds"] for b in result["draft_policy"]) > 0
               for result in results if result["mode"] == "s3r")
    saved = json.loads(out.read_text())
    assert saved["settings"]["seeds"] == "1,2" and saved["settings"]["dataset"] == "arithmetic"
    assert len(saved["results"]) == 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench.run_labels(results) == ["s3r seed 1", "s3r seed 2", "trl seed 1", "trl seed 2"]
    assert "trl seed 2: reward / len" in bench.curve_table(results)


def test_saved_results_re_render_into_a_plot_without_running(tmp_path):
    bench = bench_grpo()
    steps = [{"step": i, "reward": i / 10, "mean_length": 20.0 - i, "step_seconds": 1.0} for i in range(1, 41)]
    saved = tmp_path / "old.json"
    saved.write_text(json.dumps({"results": [{"mode": "trl", "status": "ok", "steps": steps}]}))  # no seed key
    plot = tmp_path / "again.png"
    results = bench.main(["--from-json", str(saved), "--plot", str(plot)])
    assert bench.run_labels(results) == ["trl"] and plot.is_file()
    assert bench.trailing_mean([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    table = bench.curve_table(results, max_rows=10)
    assert table.count("\n") - 1 <= 11 and "| 40 |" in table  # every 4th step, and the last


def test_warm_steps_are_compared_with_their_median_in_seconds_and_per_token():
    bench = bench_grpo()
    # A first step that compiles, then steps whose time follows their completion tokens, one of them slow.
    seconds = [40.0, 10.0, 12.0, 11.0, 15.0]
    tokens = [1000, 1000, 1200, 1100, 1000]
    steps = [{"step": i + 1, "step_seconds": s, "completion_tokens": t}
             for i, (s, t) in enumerate(zip(seconds, tokens))]
    summary = bench.summarise(steps)
    assert summary["warm_step_worst_over_median"] == pytest.approx(15.0 / 12.0 - 1)
    assert summary["warm_step_best_under_median"] == pytest.approx(1 - 10.0 / 12.0)
    assert summary["warm_step_per_token_worst_over_median"] == pytest.approx(0.015 / 0.01 - 1)
    table = bench.markdown_table([{"mode": "s3r", "status": "ok", "summary": summary}])
    assert "s3r: warm steps within +25% / -17% of their median step time" in table


def test_modes_are_compared_by_tokens_per_second_and_by_seconds_per_step():
    bench = bench_grpo()
    fast = {"generate_tokens_per_second_warm": 900.0, "step_tokens_per_second_warm": 600.0,
            "generate_seconds_warm": 9.0, "step_seconds_warm": 12.0}
    slow = {"generate_tokens_per_second_warm": 1000.0, "step_tokens_per_second_warm": 640.0,
            "generate_seconds_warm": 10.0, "step_seconds_warm": 13.2}
    table = bench.markdown_table([{"mode": "s3r", "status": "ok", "summary": fast},
                                  {"mode": "engine-ar", "status": "ok", "summary": slow}])
    assert "s3r vs engine-ar (what speculation adds to the engine; warm steps, tokens/s): generation x0.90" in table
    assert "s3r vs engine-ar (seconds per warm step): generation x1.11, whole step x1.10" in table


def test_paired_steps_compare_both_rollouts_of_each_step():
    bench = bench_grpo()
    # The first step compiles and is left out. Then S3R generates 1,000 tokens in 4 s and engine AR 1,100 in 5 s, and
    # each step also trains for 3 s: its logged time holds both rollouts.
    steps = [{"step": 1, "step_seconds": 60.0, "generate_seconds": 40.0, "completion_tokens": 900,
              "paired_ar_generate_seconds": 15.0, "paired_ar_completion_tokens": 900}]
    steps += [{"step": i, "step_seconds": 12.0, "generate_seconds": 4.0, "completion_tokens": 1000,
               "paired_ar_generate_seconds": 5.0, "paired_ar_completion_tokens": 1100} for i in (2, 3)]
    summary = bench.summarise(steps)
    assert summary["paired_steps"] == 2
    assert summary["paired_generate_by_seconds"] == pytest.approx(5 / 4)
    assert summary["paired_generate_by_tokens_per_second"] == pytest.approx((1000 / 4) / (1100 / 5))
    assert summary["paired_step_by_seconds"] == pytest.approx(8 / 7)  # 12 - 5 against 12 - 4
    assert summary["paired_step_by_tokens_per_second"] == pytest.approx((1000 / 7) / (1100 / 8))
    table = bench.markdown_table([{"mode": "s3r-paired", "status": "ok", "summary": summary}])
    assert ("S3R vs engine AR on the same weights and prompts (2 warm steps, 2,000 vs 2,200 tokens): generation "
            "x1.25 by seconds") in table
    unpaired = [{key: value for key, value in row.items() if not key.startswith("paired")} for row in steps]
    assert "paired_steps" not in bench.summarise(unpaired)


def test_a_paired_run_trains_on_s3r_and_times_engine_ar_on_the_same_prompts(tiny_model_dir, tmp_path):
    results = bench_grpo().main([
        "--model", tiny_model_dir, "--dataset", "arithmetic", "--arithmetic-size", "8", "--modes", "s3r-paired",
        "--max-steps", "2", "--num-generations", "4", "--per-device-batch", "4", "--max-completion-length", "6",
        "--s3r-config", TINY_S3R, "--in-process", "--output-dir", str(tmp_path / "trainer"),
    ])
    assert [(r["mode"], r["status"], len(r["steps"])) for r in results] == [("s3r-paired", "ok", 2)]
    for row in results[0]["steps"]:
        assert row["generate_seconds"] > 0 and row["paired_ar_generate_seconds"] > 0
        assert row["paired_ar_completion_tokens"] >= 4  # every completion has a token at least
        assert "tau" in row
    assert results[0]["summary"]["paired_steps"] == 1


def test_runs_go_one_per_device_at_a_time(monkeypatch):
    bench = bench_grpo()
    placed, running, most = [], [0], [0]
    lock = threading.Lock()

    def fake_child(args, argv, mode, seed, device=None):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            placed.append((mode, seed, device))
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        assert "--seeds" not in argv and "--devices" not in argv
        return {"mode": mode, "seed": seed, "status": "ok", "steps": []}

    monkeypatch.setattr(bench, "run_child", fake_child)
    results = bench.main(["--modes", "s3r,trl", "--seeds", "1,2,3", "--devices", "0,1"])
    assert [(r["mode"], r["seed"]) for r in results] == [(m, s) for m in ("s3r", "trl") for s in (1, 2, 3)]
    assert most[0] == 2 and {device for *_, device in placed} == {"0", "1"}


def test_child_command_lines_drop_the_parent_only_options():
    bench = bench_grpo()
    argv = ["--modes", "s3r", "--seeds=1,2", "--devices", "0,1", "--json", "x.json", "--in-process", "--seed", "3"]
    assert bench._child_argv(argv) == ["--seed", "3"]


@pytest.mark.parametrize("bad", [["--seeds", "1,1"], ["--seeds", "a"], ["--devices", "0", "--in-process"],
                                 ["--dataset", "arithmetic", "--limit", "3"]])
def test_bad_curve_options_are_refused(bad):
    with pytest.raises(SystemExit):
        bench_grpo().parse_args(bad)


def test_a_run_in_its_own_child_process_trains_with_its_seed(tiny_model_dir, tmp_path):
    results = bench_grpo().main([
        "--model", tiny_model_dir, "--dataset", "arithmetic", "--arithmetic-size", "8", "--modes", "trl",
        "--seeds", "7", "--max-steps", "1", "--num-generations", "4", "--per-device-batch", "4",
        "--max-completion-length", "4", "--output-dir", str(tmp_path / "trainer"),
    ])
    assert [(r["mode"], r["seed"], r["status"], len(r["steps"])) for r in results] == [("trl", 7, "ok", 1)]
