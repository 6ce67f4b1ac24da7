"""`s3r-hf bench --rollout` on a CPU: every mode runs on the same batch and the JSON counts add up (timings are only
checked to exist). A random shape covers forced acceptance; a tiny word-level model saved to disk covers the real
path (chat template, EOS, responses of different lengths)."""

from __future__ import annotations

import argparse
import json

import pytest

from s3r_hf.cli import build_parser, main
from s3r_hf.rollout_bench import MODES, PRESETS, RolloutUsageError, load_problems, mode_kwargs, rollout_settings
from tests.conftest import tiny_tokenizer, word_model

ENGINE_MODES = ("ar", "s3r-fixed", "s3r-adaptive")
SMALL = ["--min-budget", "4", "--draft-len", "3", "--dtype", "float32", "--device", "cpu"]


def check_engine_counts(mode: str, calls: list[dict], batch: int, draft_len: int) -> None:
    for call in calls:
        stats = call["stats"]
        # The first token of every response is sampled at prefill; the engine's rounds commit the rest.
        assert stats["committed"] + batch == call["tokens"]
        assert stats["num_drafts"] + stats["dense_steps"] == stats["request_rounds"]
        assert call["prefill_s"] >= 0 and call["decode_s"] > 0 and call["seconds"] > 0
        if mode == "ar":
            assert stats["num_drafts"] == 0 and stats["tau"] == 1.0
        else:
            assert stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
            assert 1.0 <= stats["tau"] <= draft_len + 1


def test_rollout_runs_every_mode_on_a_random_shape(tmp_path, capsys):
    json_path, plot_path = tmp_path / "rollout.json", tmp_path / "rollout.png"
    main(["bench", "--rollout", "--model", "qwen3-tiny", "--prompts", "2", "--generations", "2", "--seq", "16",
          "--max-new-tokens", "10", "--calls", "2", "--acceptance", "0.9", *SMALL,
          "--json", str(json_path), "--plot", str(plot_path)])
    result = json.loads(json_path.read_text())
    (point,) = result["points"]
    assert (point["batch"], point["prompt_tokens"]["max"], point["acceptance_forced"]) == (4, 16, 0.9)
    assert list(point["modes"]) == list(MODES)
    for mode, run in point["modes"].items():
        assert len(run["calls"]) == 2 and "error" not in run
        for call in run["calls"]:  # random weights have no EOS: every response runs to max_new_tokens
            assert call["tokens"] == 4 * 10 and call["max_length"] == 10
        summary = run["summary"]
        assert summary["warm_tokens_per_s"] > 0 and summary["cold_tokens_per_s"] > 0
        if mode in ENGINE_MODES:
            check_engine_counts(mode, run["calls"], 4, 3)
            assert {"warm_prefill_s", "warm_decode_s", "warm_graph_capture_s", "tau"} <= set(summary)
            # Four rows decode together until requests reach max_new_tokens, which drafting ones may do at
            # different rounds; every token after the first (sampled in prefill) is counted once.
            by_rows = summary["warm_decode_by_rows"]
            assert list(by_rows)[0] == "4" and set(by_rows) <= {"4", "2", "1"}
            assert sum(bucket["tokens"] for bucket in by_rows.values()) == 4 * 10 - 4
    assert point["modes"]["s3r-fixed"]["summary"]["num_drafts"] > 0
    # Each adaptive call records the probes the kept rule has started so far, per bucket: never fewer than before.
    first, second = (call["policy_probes"] for call in point["modes"]["s3r-adaptive"]["calls"])
    assert first and all(second[bucket] >= count for bucket, count in first.items())
    assert sum(second.values()) == sum(bucket["probes"] for bucket in point["modes"]["s3r-adaptive"]["policy"])
    assert set(point["ratios"]["s3r-adaptive"]) == {
        "warm_vs_ar", "cold_vs_ar", "warm_time_vs_ar", "warm_vs_generate", "cold_vs_generate"}
    # Random shapes run every response to max_new_tokens: both ratios compare the same tokens.
    adaptive, ar = point["modes"]["s3r-adaptive"]["summary"], point["modes"]["ar"]["summary"]
    ratios = point["ratios"]["s3r-adaptive"]
    assert ratios["warm_time_vs_ar"] == pytest.approx(ar["warm_seconds_per_call"] / adaptive["warm_seconds_per_call"])
    assert ratios["warm_time_vs_ar"] == pytest.approx(ratios["warm_vs_ar"])
    assert plot_path.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "speed" in printed and "decoding by running rows" in printed


def saved_word_model(tmp_path) -> tuple:
    """The word-level model and its tokenizer saved as a checkpoint, and two questions as a JSONL prompt file."""
    model_dir, data = tmp_path / "model", tmp_path / "problems.jsonl"
    word_model().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    data.write_text("\n".join(json.dumps({"question": q}) for q in ["how many eggs ?", "how many books is 3 and 4 ?"]))
    return model_dir, data


def test_rollout_of_a_real_model_applies_the_chat_template_and_ends_at_eos(tmp_path):
    model_dir, data = saved_word_model(tmp_path)
    json_path = tmp_path / "rollout.json"
    main(["bench", "--rollout", "--model", str(model_dir), "--data", str(data), "--prompts", "3", "--generations",
          "2", "--max-new-tokens", "24", "--calls", "1", "--modes", "generate,ar,s3r-fixed", *SMALL,
          "--json", str(json_path)])
    (point,) = json.loads(json_path.read_text())["points"]
    assert point["batch"] == 6 and point["acceptance_forced"] is None
    assert point["prompt_tokens"]["min"] == 1 + 4 + 1  # "<user> how many eggs ? <assistant>"
    for mode in ("generate", "ar", "s3r-fixed"):
        (call,) = point["modes"][mode]["calls"]
        # Seeded: some responses of the word model end at <eos> well before the limit, so lengths differ.
        assert 1 <= call["mean_length"] < call["max_length"] <= 24
        assert len(call["lengths"]) == 6 and sum(call["lengths"]) == call["tokens"]
        if mode != "generate":
            check_engine_counts(mode, [call], 6, 3)


def test_greedy_rollouts_report_that_every_mode_generated_ar_s_responses(tmp_path, capsys):
    """`--greedy`: the exact modes' responses are the engine AR's, row for row (fp32), and the report says so."""
    model_dir, data = saved_word_model(tmp_path)
    json_path = tmp_path / "rollout.json"
    main(["bench", "--rollout", "--greedy", "--model", str(model_dir), "--data", str(data), "--prompts", "2",
          "--generations", "2", "--max-new-tokens", "20", "--calls", "2", *SMALL, "--json", str(json_path)])
    (point,) = json.loads(json_path.read_text())["points"]
    assert point["greedy"]
    assert point["same_responses_as_ar"] == {mode: [8, 8] for mode in ("generate", "s3r-fixed", "s3r-adaptive")}
    assert point["modes"]["s3r-fixed"]["summary"]["num_drafts"] > 0  # the drafting path ran
    # Greedy: the G responses to one prompt are one response.
    for run in point["modes"].values():
        for call in run["calls"]:
            digests = call["response_digests"]
            assert digests[0] == digests[1] and digests[2] == digests[3]
    assert "responses equal to ar's: generate 8/8, s3r-fixed 8/8, s3r-adaptive 8/8" in capsys.readouterr().out


def test_sampled_responses_differ_between_modes_and_the_comparison_shows_it():
    """The digest comparison can fail: responses that differ are counted as differing."""
    from s3r_hf.rollout_bench import same_responses

    calls = lambda *digests: {"calls": [{"response_digests": list(digests)}]}  # noqa: E731
    assert same_responses({"ar": calls("a", "b", "c"), "s3r-fixed": calls("a", "x", "c")}) == {"s3r-fixed": [2, 3]}
    assert same_responses({"s3r-fixed": calls("a")}) == {}


def test_problems_come_from_json_jsonl_or_the_package(tmp_path):
    packaged = load_problems()
    assert len(packaged) >= 32 and all(isinstance(p, str) and p for p in packaged)
    (tmp_path / "math.json").write_text(json.dumps([{"problem": "1 + 1?", "answer": "2"}, {"question": "2 + 2?"}]))
    assert load_problems(str(tmp_path / "math.json")) == ["1 + 1?", "2 + 2?"]
    (tmp_path / "gsm.jsonl").write_text('{"question": "a?"}\n\n{"question": "b?"}\n')
    assert load_problems(str(tmp_path / "gsm.jsonl")) == ["a?", "b?"]
    (tmp_path / "bad.json").write_text(json.dumps([{"text": "no problem field"}]))
    with pytest.raises(RolloutUsageError, match="record 0 has no 'problem' or 'question'"):
        load_problems(str(tmp_path / "bad.json"))
    with pytest.raises(RolloutUsageError, match="no such file"):
        load_problems(str(tmp_path / "missing.json"))
    with pytest.raises(RolloutUsageError, match="not both"):
        load_problems(str(tmp_path / "math.json"), dataset="some/id")


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "--rollout", *flags])


def test_presets_modes_and_lengths_resolve():
    assert rollout_settings(parse("--model", "qwen3-tiny"))["max_new_tokens"] == PRESETS["medium"]
    assert rollout_settings(parse("--model", "qwen3-tiny", "--preset", "16k"))["max_new_tokens"] == 16384
    assert rollout_settings(parse("--model", "qwen3-tiny", "--preset", "16k", "--max-new-tokens", "7"))[
        "max_new_tokens"] == 7
    settings = rollout_settings(parse("--model", "qwen3-tiny", "--skip-generate", "--seq", "64,128"))
    assert settings["modes"] == ["ar", "s3r-fixed", "s3r-adaptive"] and settings["seqs"] == [64, 128]
    assert settings["s3r_config"].draft_matmul_precision == "high"  # the library's default
    settings = rollout_settings(parse("--model", "qwen3-tiny", "--draft-matmul-precision", "highest"))
    assert settings["s3r_config"].draft_matmul_precision == "highest"
    settings = rollout_settings(parse("--model", "qwen3-tiny", "--adaptive-draft-lengths", "0,3,6"))
    assert settings["s3r_config"].adaptive_draft_lengths == (0, 3, 6)
    # The fixed and dense modes run the paper's rule whatever lengths the adaptive one may choose.
    for mode in ("ar", "s3r-fixed"):
        config = mode_kwargs(mode, settings["s3r_config"], None, False)["s3r_config"]
        assert not config.adaptive and config.adaptive_draft_lengths is None
    assert mode_kwargs("s3r-adaptive", settings["s3r_config"], None, False)["s3r_config"].adaptive_draft_lengths == (
        0, 3, 6)


@pytest.mark.parametrize("flags, message", [
    (["--acceptance", "0.9"], "random-weight shapes only"),
    (["--model", "qwen3-tiny", "--batch", "16"], "--batch does not apply"),
    (["--model", "qwen3-tiny", "--modes", "ar,fast"], "--modes must name"),
    (["--model", "qwen3-tiny", "--budget", "0.05,0.1"], "--budget takes one value"),
    (["--model", "qwen3-tiny", "--generations", "0"], "--generations must be at least 1"),
    (["--model", "qwen3-tiny", "--adaptive-draft-lengths", "0,3"], "must include 0 and draft_len (6)"),
    (["--model", "qwen3-tiny", "--adaptive-draft-lengths", "0,three,6"], "--adaptive-draft-lengths takes integers"),
])
def test_bad_flags_are_one_line_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--rollout", *flags, "--device", "cpu"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error


def test_a_point_past_the_context_window_lowers_max_new_tokens():
    """S3R refuses calls past the context window; the benchmark asks for what the model holds and says so."""
    from rich.console import Console

    from s3r_hf import S3RConfig, enable
    from s3r_hf.rollout_bench import run_point
    from tests.conftest import tiny_model

    model = enable(tiny_model(max_position_embeddings=48))
    settings = {"prompts": 2, "generations": 2, "max_new_tokens": 64, "calls": 1, "modes": ["ar", "s3r-adaptive"],
                "acceptance": 0.9, "s3r_config": S3RConfig(min_budget=4, page_size=4, draft_len=3), "stages": False,
                "seed": 0}
    console = Console(record=True, width=140)
    point = run_point(model, None, "tiny", [], 16, settings, console)
    assert point["max_new_tokens"] == 48 - 16
    assert "max_new_tokens lowered to 32" in console.export_text()
    assert all("error" not in mode and mode["calls"] for mode in point["modes"].values())


def test_modes_take_turns_call_by_call_and_one_that_runs_out_of_memory_stops_alone(monkeypatch):
    """Calls alternate between modes (a machine's speed drifts over a run; the calls compared run side by side), and
    a mode whose call runs out of memory keeps its error while the others finish their calls."""
    import torch
    from rich.console import Console

    from s3r_hf import rollout_bench

    order = []

    def run_call(model, batch, mode, common, extra, call, calls, seed, eos_ids, console):
        order.append((mode, call))
        if mode == "s3r-fixed" and call == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"call": call}

    monkeypatch.setattr(rollout_bench, "run_call", run_call)
    monkeypatch.setattr(rollout_bench, "summarise", lambda calls: {"calls": len(calls)})
    extras = {"ar": {}, "s3r-fixed": {}, "s3r-adaptive": {}}
    results = rollout_bench.run_modes(None, {}, extras, {}, 3, 0, set(), Console(quiet=True))
    assert order == [("ar", 0), ("s3r-fixed", 0), ("s3r-adaptive", 0), ("ar", 1), ("s3r-fixed", 1),
                     ("s3r-adaptive", 1), ("ar", 2), ("s3r-adaptive", 2)]
    assert results["s3r-fixed"]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert [len(results[mode]["calls"]) for mode in extras] == [3, 1, 3]
    assert results["s3r-fixed"]["summary"] == {"calls": 1}
