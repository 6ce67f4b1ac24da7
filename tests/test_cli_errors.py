"""What a new user trips over: each CLI input error is one line on stderr with exit status 2 (a traceback only with
`--verbose`), a missing optional dependency names its extra, an untested TRL fails clearly, `import s3r_hf` loads
neither torch nor transformers, and `generate(s3r_config=...)` without `enable` names `s3r_hf.enable`. No network:
the Hub's answers are stubbed, and HF_HUB_OFFLINE is set where the code would otherwise ask it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import s3r_hf.models as s3r_models
from s3r_hf.cli import dense_drafting_note, main
from s3r_hf.errors import MissingDependencyError, require
from tests.conftest import tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub counts as reachable (its answer is stubbed by each test)."""
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `s3r-hf ARGV`, expect exit status 2, return stderr (checked to be one line)."""
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert "Traceback" not in err
    return err


def test_a_missing_model_directory_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["generate", "--model", "/nonexistent/dir", "--prompt", "hi"], capsys)
    assert err == "s3r-hf generate: error: model /nonexistent/dir: no such file or directory\n"


def test_a_missing_gguf_file_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["demo", "--model", "missing.gguf"], capsys)
    assert err == "s3r-hf demo: error: model missing.gguf: no such file or directory\n"


def test_a_directory_that_is_not_a_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["generate", "--model", str(tmp_path), "--prompt", "hi"], capsys)
    assert "has no config.json" in err


def test_an_unknown_hub_id_offline_fails_at_once(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = run_cli(["generate", "--model", "nosuch-org/nosuch-model", "--prompt", "hi"], capsys)
    assert "not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err


def test_an_unknown_hub_id_asks_the_hub_once(hub_online, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from huggingface_hub.errors import RepositoryNotFoundError

    asked = []

    def not_found(repo_id: str):
        asked.append(repo_id)
        # What the Hub's 404 raises; made without an HTTP response, which its constructor would need.
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(error, "404 Repository Not Found")
        raise error

    monkeypatch.setattr(s3r_models, "_hub_model_info", not_found)
    err = run_cli(["demo", "--model", "nosuch-org/nosuch-model"], capsys)
    assert asked == ["nosuch-org/nosuch-model"]
    assert err == ("s3r-hf demo: error: model nosuch-org/nosuch-model: no such model on the Hugging Face Hub (nor a "
                   "local path of that name; a private model needs hf auth login)\n")


def test_an_unreachable_hub_is_one_line(hub_online, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def unreachable(repo_id: str):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(s3r_models, "_hub_model_info", unreachable)
    err = run_cli(["generate", "--model", "some-org/some-model", "--prompt", "hi"], capsys)
    assert "the Hub cannot be reached (ConnectionError: Name or service not known)" in err


def test_a_malformed_name_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["generate", "--model", "not a model!", "--prompt", "hi"], capsys)
    assert "neither an existing path nor a Hugging Face Hub id" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_only_machine_is_one_line(tiny_checkpoint: Path, capsys) -> None:
    err = run_cli(["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--device", "cuda"], capsys)
    assert err.startswith("s3r-hf generate: error: device cuda: ")
    assert "no CUDA support" in err or "no CUDA device is visible" in err
    err = run_cli(["bench", "--model", "qwen3-tiny", "--device", "cuda"], capsys)
    assert err.startswith("s3r-hf bench: error: device cuda: ")


def test_an_unknown_device_is_one_line(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["demo", "--model", str(tiny_checkpoint), "--device", "gpu0"], capsys)
    assert "device gpu0: not a device torch knows" in err


@pytest.mark.parametrize(("device", "message"), [
    ("meta", "device meta: the meta device holds no weights"),
    pytest.param("mps", "device mps: not available with this machine and torch build",
                 marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")),
])
def test_a_device_this_machine_cannot_generate_on_is_one_line(device, message, tiny_checkpoint: Path, capsys) -> None:
    err = run_cli(["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--device", device], capsys)
    assert message in err


def _break_checkpoint(directory: Path, how: str) -> Path:
    if how == "config.json is not JSON":
        (directory / "config.json").write_text("{")
    elif how == "no weights":
        (directory / "model.safetensors").unlink()
    elif how == "truncated weights":
        (directory / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes()[:20])
    elif how == "not a causal LM":
        from transformers import T5Config

        T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2).save_pretrained(directory)
    elif how == "not a GGUF file":
        directory = directory / "model.gguf"
        directory.write_bytes(b"not a gguf file")
    return directory


@pytest.mark.parametrize(("how", "message"), [
    ("config.json is not JSON", "is not a valid JSON file"),
    ("no weights", "no file named model.safetensors"),
    ("truncated weights", "SafetensorError"),
    ("not a causal LM", "T5Config"),
    ("not a GGUF file", "GGUF"),
])
def test_a_checkpoint_transformers_cannot_load_is_one_line(how, message, tiny_checkpoint: Path, capsys) -> None:
    model = _break_checkpoint(tiny_checkpoint, how)
    err = run_cli(["generate", "--model", str(model), "--prompt", "hi", "--device", "cpu"], capsys)
    assert err.startswith(f"s3r-hf generate: error: model {model}: cannot be loaded: ") and message in err


def test_new_tokens_past_the_context_window_are_one_line(tiny_checkpoint: Path, capsys) -> None:
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "200"]
    err = run_cli(argv, capsys)
    assert "goes past the model's context window of 128 tokens" in err


def test_an_empty_prompt_without_the_chat_template_is_one_line(tiny_checkpoint: Path, capsys) -> None:
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "", "--no-chat-template", "--device", "cpu"]
    err = run_cli(argv, capsys)
    assert err == ("s3r-hf generate: error: --prompt '' has no tokens without the chat template "
                   "(--no-chat-template): the model would have nothing to continue\n")


def test_fused_layers_on_a_model_they_do_not_fit_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = run_cli(["bench", "--model", "qwen3-tiny", "--batch", "2", "--seq", "32", "--max-new-tokens", "4",
                   "--device", "cpu", "--dtype", "float32", "--skip-generate", "--no-warmup", "--fused-layers"], capsys)
    assert err == (
        "s3r-hf bench: error: S3RConfig.fused_layers: head_dim 16 of Qwen3DecoderLayer; the fused kernels need 32, "
        "64 or 128\n"
    )


@pytest.mark.parametrize(("flags", "message"), [
    (["--refresh-interval", "x"], "--refresh-interval: invalid literal"),
    (["--refresh-interval", "1,0"], "refresh_interval must be an integer >= 1"),
    (["--budget", "0.05,y"], "--budget: could not convert"),
    (["--budget", "2"], "budget_ratio must be a number in"),
    (["--batch", "a"], "--batch: invalid literal"),
    (["--batch", "2,0"], "--batch: must be an integer >= 1, got 0"),
    (["--seq", "0"], "--seq: must be an integer >= 1, got 0"),
    (["--batch", "2", "--requests", "1"], "--requests (1) must be at least the batch size (2)"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["--max-new-tokens", "1"], "--max-new-tokens must be at least 2 for the decode grid"),
    (["--prefill-chunk", "0"], "argument --prefill-chunk: must be an integer >= 1"),
    (["--acceptance", "5"], "argument --acceptance: must be a number in [0, 1], got 5"),
    (["--json", "/nonexistent/dir/out.json"], "--json /nonexistent/dir/out.json: the directory /nonexistent/dir does"),
    (["--rollout", "--seq", "x"], "--seq must be positive prompt lengths, got 'x'"),
    (["--rollout", "--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png: the directory /nonexistent does not"),
    # Prompt sources for random-weight shapes only, which take random prompts: they were ignored.
    (["--data", "/nonexistent.json"], "--data gives prompts to real models; the random-weight shapes (qwen3-tiny)"),
    (["--dataset", "x/y"], "--dataset gives prompts to real models"),
    (["--rollout", "--data", "/nonexistent.json"], "--data gives prompts to real models"),
    (["--rollout", "--seed", "-1"], "--seed must be >= 0, got -1"),
    # Rollout-only flags on the decode grid: they were ignored.
    (["--greedy"], "--greedy applies to the rollout benchmark only: add --rollout"),
    (["--calls", "2", "--adaptive-draft-lengths", "0,3"], "--calls, --adaptive-draft-lengths apply to the rollout"),
    # A value argparse takes for a flag: the error says how to give it.
    (["--rollout", "--adaptive-draft-lengths", "-1,3"],
     "expected one argument (if the value starts with '-', write --adaptive-draft-lengths=VALUE)"),
    (["--rollout", "--adaptive-draft-lengths=-1,3"], "adaptive_draft_lengths must include 0 and draft_len"),
])
def test_a_bad_bench_flag_is_one_line_before_anything_runs(flags: list[str], message: str, capsys) -> None:
    err = run_cli(["bench", "--model", "qwen3-tiny", "--device", "cpu", "--dtype", "float32", *flags], capsys)
    assert message in err


def test_a_forced_acceptance_on_a_real_model_is_one_line(tiny_checkpoint: Path, capsys) -> None:
    """The decode grid ran it, timing a non-exact decode of a real model; the rollout bench refused it already."""
    for rollout in ([], ["--rollout"]):
        err = run_cli(["bench", "--model", str(tiny_checkpoint), "--device", "cpu", "--acceptance", "0.5", *rollout],
                      capsys)
        assert f"{tiny_checkpoint} is a real model, whose acceptance is its own" in err


def test_a_data_file_that_is_not_utf8_is_one_line(tmp_path: Path, tiny_checkpoint: Path, capsys) -> None:
    data = tmp_path / "problems.json"
    data.write_bytes(b"\xff\xfe\x00garbage")
    for rollout in ([], ["--rollout"]):
        err = run_cli(["bench", "--model", str(tiny_checkpoint), "--device", "cpu", "--data", str(data), *rollout],
                      capsys)
        assert f"--data {data}: not UTF-8 text" in err


def test_results_that_cannot_be_written_are_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The output path passes the checks made before the run (a full disk does), and the write fails at the end."""
    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    err = run_cli(["bench", "--model", "qwen3-tiny", "--device", "cpu", "--dtype", "float32", "--batch", "1",
                   "--seq", "16", "--max-new-tokens", "4", "--skip-generate", "--no-warmup", "--json", "out.json"],
                  capsys)
    assert err == "s3r-hf bench: error: --json out.json: the results could not be written (No space left on device)\n"


def test_a_temperature_that_overflows_the_logits_is_one_line(tiny_checkpoint: Path, capsys) -> None:
    base = ["generate", "--model", str(tiny_checkpoint), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "3",
            "--do-sample"]
    for extra in ([], ["--dense"]):
        err = run_cli([*base, "--temperature", "1e-45", *extra], capsys)
        assert "--temperature 1e-45 is too small: the model's logits divided by it overflow" in err
    err = run_cli([*base, "--temperature", "inf"], capsys)
    assert "argument --temperature: must be a finite number > 0, got inf" in err


def test_verbose_adds_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["generate", "--model", "/nonexistent/dir", "--prompt", "hi", "--verbose"],
                 ["-v", "generate", "--model", "/nonexistent/dir", "--prompt", "hi"]):
        with pytest.raises(SystemExit) as excinfo:
            main(argv)
        assert excinfo.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and "ModelSourceError" in err
        assert err.endswith("s3r-hf generate: error: model /nonexistent/dir: no such file or directory\n")


def test_the_installed_command_prints_one_line() -> None:
    """The real process, as a user runs it: nothing else on stderr (no warnings, no traceback), exit status 2."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "s3r_hf.cli", "generate", "--model", "/nonexistent/dir", "--prompt", "hi"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == "s3r-hf generate: error: model /nonexistent/dir: no such file or directory\n"


def test_import_and_help_load_neither_torch_nor_transformers() -> None:
    code = ("import sys, s3r_hf, s3r_hf.cli as cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'triton', 'rich') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "generate" in result.stdout and "bench" in result.stdout


# ----------------------------------------------------------------------------------------------------------
# First-run messages
# ----------------------------------------------------------------------------------------------------------


def test_generate_says_when_drafting_was_dense(tiny_checkpoint: Path, capsys) -> None:
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "how many books ?", "--max-new-tokens", "4",
            "--device", "cpu"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "is within min_budget=192" in out and "says nothing about sparse drafting" in out


def test_the_demo_on_a_cpu_says_slower_is_expected(tiny_checkpoint: Path) -> None:
    import io

    from rich.console import Console

    from s3r_hf.demo import run_demo

    console = Console(file=io.StringIO(), width=200)
    results = run_demo(str(tiny_checkpoint), num_prompts=2, max_new_tokens=4, device="cpu", console=console)
    printed = " ".join(console.file.getvalue().split())
    assert "On a CPU, S3R slower than dense decoding is expected" in printed and "docs/benchmarks.md" in printed
    assert results["note"].startswith("On a CPU")


def test_dense_drafting_note() -> None:
    assert dense_drafting_note([300, 400], [10, 10], min_budget=192) is None
    assert "every context here (10-30 tokens)" in dense_drafting_note([20, 10], [10, 5], min_budget=192)
    assert "from 100 to 310 tokens" in dense_drafting_note([100, 300], [10, 10], min_budget=192)


def test_generate_with_s3r_config_but_without_enable_names_enable() -> None:
    import s3r_hf

    model = tiny_model()
    with pytest.raises(ValueError, match=r"s3r_hf\.enable\(model\)"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, s3r_config=s3r_hf.S3RConfig())
    with pytest.raises(ValueError, match="not used by the model"):  # other unknown arguments: transformers' message
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, not_an_option=1)


# ----------------------------------------------------------------------------------------------------------
# Optional dependencies
# ----------------------------------------------------------------------------------------------------------


def test_a_missing_optional_dependency_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"--plot needs the matplotlib package.*s3r-hf\[bench\]"):
        require("matplotlib", "bench", "--plot")
    from s3r_hf.bench import plot

    with pytest.raises(MissingDependencyError, match=r"s3r-hf\[bench\]"):
        plot([], "out.png")


def test_a_missing_core_dependency_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(MissingDependencyError, match="pip install gguf"):
        require("gguf", None, "Loading a GGUF file")


def test_trl_outside_the_tested_range_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl

    from trl_integration.trl_version import ALLOW_UNTESTED_ENV, UntestedTRLError, check_trl

    assert check_trl() == trl.__version__  # the installed TRL is the tested one
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    for version in ("0.20.0", "1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(UntestedTRLError, match=rf"trl {version} is installed.*trl>=1\.16,<1\.17"):
            check_trl(version)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    assert check_trl("1.17.0") == "1.17.0"


def test_a_missing_trl_names_the_trl_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl_integration.trl_version import check_trl

    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 's3r-hf\[trl\]'"):
        check_trl()


def test_demo_past_the_context_window_is_refused_before_generating(tiny_checkpoint: Path, capsys, monkeypatch) -> None:
    import s3r_hf.demo as demo

    calls = []
    monkeypatch.setattr(demo, "timed_generate", lambda *args, **kwargs: calls.append(kwargs))
    err = run_cli(["demo", "--model", str(tiny_checkpoint), "--device", "cpu", "--max-new-tokens", "100000"], capsys)
    assert "goes past the model's context window" in err and "max_new_tokens=100000" in err
    assert calls == []  # neither the warm-up nor the dense pass ran first
