"""`s3r-hf demo`: dense greedy decoding against S3R greedy decoding on a few math word problems.

Greedy S3R commits exactly the tokens dense greedy decoding would (up to floating-point ties), so the demo
checks the two outputs token for token and reports speed and speculative-decoding statistics side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from transformers.utils import logging as hf_logging

from .config import S3RConfig
from .models import DEFAULT_MODEL, load_model_and_tokenizer

if TYPE_CHECKING:  # importing these loads most of transformers, which `s3r-hf demo --help` does without
    from transformers import BatchEncoding, PreTrainedModel, PreTrainedTokenizerBase

# The demo prompts are short: 55-70 tokens once chat-templated, so at most about 200 tokens of context with
# the default 128 new tokens. With the paper's `min_budget=192` every index view would then cover the whole
# context, i.e. the drafter would attend densely and the demo would show nothing sparse. `min_budget=16`
# keeps the drafter sparse at this scale (16 of 60-200 positions); at 5% of a long context the ratio decides.
DEMO_S3R_KWARGS: dict[str, Any] = {"draft_len": 6, "budget_ratio": 0.05, "min_budget": 16}

CPU_NOTE = (
    "On a CPU, S3R slower than dense decoding is expected: attention runs in the reference kernels, without CUDA "
    "graphs, and these short prompts leave sparse attention little to save. S3R's gains are on a GPU with long "
    "contexts: docs/benchmarks.md in the s3r-hf repository has the measurements (on an H200, e.g. 1.83x the "
    "engine's dense decoding for the Qwen3-1.7B shape at batch 64 and 8K tokens of context, at the paper's "
    "acceptance rate)."
)
"""Printed after a demo on the CPU, where S3R is slower than dense decoding."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A `torch.dtype` from itself or from one of the names `"float32"`, `"bfloat16"`, `"float16"`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def demo_s3r_config() -> S3RConfig:
    """The demo's S3R configuration: `S3RConfig(draft_len=6, budget_ratio=0.05, min_budget=16)`."""
    return S3RConfig(**DEMO_S3R_KWARGS)


def load_demo_prompts() -> list[dict[str, str]]:
    """The bundled demo problems, each `{"question": ..., "answer": "<number>"}`."""
    text = resources.files("s3r_hf").joinpath("data", "demo_prompts.json").read_text(encoding="utf-8")
    return json.loads(text)


def build_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    device: torch.device | str | None = None,
    chat_template: bool = True,
) -> BatchEncoding:
    """Tokenize `prompts` as one left-padded batch, each wrapped as a user turn of the chat template.

    Without a chat template (or with `chat_template=False`) the prompts are tokenized as they are.
    """
    if chat_template and getattr(tokenizer, "chat_template", None):
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            for prompt in prompts
        ]
        # The template already writes the special tokens it wants (e.g. a BOS); don't add them twice.
        batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    else:
        batch = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    return batch.to(device) if device is not None else batch


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Token ids that end a sequence: the generation config's EOS id(s) and the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else list(configured))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def generated_lengths(new_tokens: torch.Tensor, eos_ids: set[int], pad_token_id: int | None) -> list[int]:
    """Per row, how many of `new_tokens` (batch, steps) were really generated.

    A row ends at its first EOS token (counted); `generate` fills the rest with padding. Without EOS ids the
    non-pad tokens are counted. This stays right when the pad token is the EOS token.
    """
    lengths = []
    for row in new_tokens.tolist():
        if eos_ids:
            end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        else:
            end = sum(token != pad_token_id for token in row)
        lengths.append(end)
    return lengths


@contextlib.contextmanager
def quiet_hf_progress_bars() -> Iterator[None]:
    """Turn off transformers' tqdm bars for the duration (they fight a rich live display)."""
    were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if were_on:
            hf_logging.enable_progress_bar()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model: PreTrainedModel, batch: BatchEncoding, **kwargs: Any) -> tuple[Any, float]:
    """`model.generate(**batch, **kwargs)` under `torch.inference_mode`, with its wall-clock seconds."""
    _synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**batch, **kwargs)
    _synchronize(model.device)
    return output, time.perf_counter() - start


def output_sequences(output: Any) -> torch.Tensor:
    """The token ids of a `generate` result, whether a tensor or a `GenerateOutput`."""
    return output.sequences if hasattr(output, "sequences") else output


def run_demo(
    model_name_or_path: str = DEFAULT_MODEL,
    num_prompts: int = 4,
    max_new_tokens: int = 128,
    s3r_config: S3RConfig | dict[str, Any] | None = None,
    device: str | torch.device | None = None,
    console: Console | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> dict[str, Any]:
    """Run dense and S3R greedy decoding on the bundled math prompts, print a comparison, return the numbers.

    Args:
        model_name_or_path: Anything `load_model_and_tokenizer` accepts; defaults to the embedded SmolLM2.
        num_prompts: Batch size. The 8 bundled prompts are reused in turn when more are asked for.
        max_new_tokens: Generation length limit of both runs.
        s3r_config: S3R settings (an `S3RConfig` or a dict of its fields); `None` uses `demo_s3r_config()`.
        device: Where to run; `None` picks CUDA when available.
        console: Rich console to print to; a new one by default.
        dtype: Model dtype (a `torch.dtype` or one of `"float32"`, `"bfloat16"`, `"float16"`).

    Returns:
        A dict with the `dense` and `s3r` measurements (generated tokens, seconds, tokens/s; for S3R also
        acceptance rate, τ, per-position acceptance, drafted/accepted counts), `speedup`, `outputs_match`,
        `rows_matching`, the config used and the decoded completions.
    """
    from . import enable  # the engine's entry point; imported here so this module loads without it
    from .validation import check_context_window, prompt_rows

    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    config = demo_s3r_config() if s3r_config is None else S3RConfig.coerce(s3r_config)
    dtype = resolve_dtype(dtype)
    console = console or Console()
    problems = load_demo_prompts()
    problems = [problems[i % len(problems)] for i in range(num_prompts)]

    console.print(
        f"[bold]S3R demo[/] model={escape(str(model_name_or_path))} prompts={num_prompts} "
        f"max_new_tokens={max_new_tokens}"
    )
    console.print(f"S3R config: {_describe_config(config)}")
    paper_min_budget = S3RConfig().min_budget
    if config.min_budget < paper_min_budget:
        console.print(
            f"[dim](min_budget is below the paper's {paper_min_budget} because these prompts are short: a "
            "context under min_budget would be drafted with full attention)[/]"
        )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("Loading model", total=4)
        with quiet_hf_progress_bars():
            model, tokenizer = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=device)
        model = enable(model)
        batch = build_batch(tokenizer, [p["question"] for p in problems], device=model.device)
        prompt_len = batch["input_ids"].shape[1]
        # Before the dense pass, which would otherwise run whole before S3R's own check refuses the call.
        check_context_window(model, prompt_rows(batch["input_ids"], batch["attention_mask"]), max_new_tokens)
        eos_ids = eos_token_ids(model, tokenizer)
        pad_id = tokenizer.pad_token_id
        common = {"do_sample": False, "pad_token_id": pad_id}

        progress.update(task, advance=1, description="Warming up (dense and S3R)")
        warm = min(16, max_new_tokens)
        timed_generate(model, batch, max_new_tokens=warm, **common)
        timed_generate(model, batch, max_new_tokens=warm, s3r_config=config, return_dict_in_generate=True, **common)

        progress.update(task, advance=1, description="Dense greedy generate")
        dense_out, dense_seconds = timed_generate(model, batch, max_new_tokens=max_new_tokens, **common)

        progress.update(task, advance=1, description="S3R greedy generate")
        s3r_out, s3r_seconds = timed_generate(
            model,
            batch,
            max_new_tokens=max_new_tokens,
            s3r_config=config,
            return_dict_in_generate=True,
            **common,
        )
        progress.update(task, advance=1)

    dense_new = output_sequences(dense_out)[:, prompt_len:].cpu()
    s3r_new = output_sequences(s3r_out)[:, prompt_len:].cpu()
    dense_lengths = generated_lengths(dense_new, eos_ids, pad_id)
    s3r_lengths = generated_lengths(s3r_new, eos_ids, pad_id)
    dense_rows = [dense_new[i, :n].tolist() for i, n in enumerate(dense_lengths)]
    s3r_rows = [s3r_new[i, :n].tolist() for i, n in enumerate(s3r_lengths)]
    rows_matching = sum(a == b for a, b in zip(dense_rows, s3r_rows))
    stats = getattr(s3r_out, "s3r_stats", None)

    dense_tokens, s3r_tokens = sum(dense_lengths), sum(s3r_lengths)
    results: dict[str, Any] = {
        "model": model_name_or_path,
        "device": str(model.device),
        "dtype": str(dtype).removeprefix("torch."),
        "num_prompts": num_prompts,
        "prompt_tokens": prompt_len,
        "max_new_tokens": max_new_tokens,
        "s3r_config": config.to_dict(),
        "dense": {
            "generated_tokens": dense_tokens,
            "seconds": dense_seconds,
            "tokens_per_s": dense_tokens / dense_seconds if dense_seconds > 0 else 0.0,
        },
        "s3r": {
            "generated_tokens": s3r_tokens,
            "seconds": s3r_seconds,
            "tokens_per_s": s3r_tokens / s3r_seconds if s3r_seconds > 0 else 0.0,
            **(_stats_numbers(stats) if stats is not None else {}),
        },
        "outputs_match": rows_matching == num_prompts,
        "rows_matching": rows_matching,
        "completions": {
            "dense": tokenizer.batch_decode(dense_rows, skip_special_tokens=True),
            "s3r": tokenizer.batch_decode(s3r_rows, skip_special_tokens=True),
        },
        "questions": [p["question"] for p in problems],
        "answers": [p["answer"] for p in problems],
    }
    dense_tps, s3r_tps = results["dense"]["tokens_per_s"], results["s3r"]["tokens_per_s"]
    results["speedup"] = s3r_tps / dense_tps if dense_tps > 0 else 0.0
    if model.device.type == "cpu":
        results["note"] = CPU_NOTE
    _print_results(console, results)
    return results


def _stats_numbers(stats: Any) -> dict[str, Any]:
    return {
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "tau": stats.tau,
        "per_position_acceptance": list(stats.per_position_acceptance),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
    }


def _describe_config(config: S3RConfig) -> str:
    return f"draft_len={config.draft_len}, budget_ratio={config.budget_ratio}, min_budget={config.min_budget}"


def _print_results(console: Console, results: dict[str, Any]) -> None:
    dense, s3r = results["dense"], results["s3r"]
    title = f"Greedy decoding, batch of {results['num_prompts']}, {results['device']}, {results['dtype']}"
    table = Table(title=title, caption="τ: tokens committed per request-round, bonus token included")
    headers = ("method", "gen. tokens", "seconds", "tok/s", "accept rate", "τ", "matches dense")
    for header in headers:
        table.add_column(header, justify="left" if header == "method" else "right", no_wrap=True)
    table.add_row(
        "dense",
        str(dense["generated_tokens"]),
        f"{dense['seconds']:.2f}",
        f"{dense['tokens_per_s']:.1f}",
        "-",
        "-",
        "reference",
    )
    match = f"{results['rows_matching']}/{results['num_prompts']}"
    match = f"[green]yes {match}[/]" if results["outputs_match"] else f"[red]no {match}[/]"
    table.add_row(
        "S3R",
        str(s3r["generated_tokens"]),
        f"{s3r['seconds']:.2f}",
        f"{s3r['tokens_per_s']:.1f}",
        f"{s3r['acceptance_rate']:.3f}" if "acceptance_rate" in s3r else "n/a",
        f"{s3r['tau']:.2f}" if "tau" in s3r else "n/a",
        match,
    )
    console.print(table)
    console.print(f"S3R / dense tokens/s: {results['speedup']:.2f}x")
    if "per_position_acceptance" in s3r:
        per_position = ", ".join(f"{p:.2f}" for p in s3r["per_position_acceptance"])
        console.print(f"Per-position acceptance: [{per_position}]")
    question, answer = escape(results["questions"][0]), escape(results["answers"][0])
    console.print(f"\n[bold]Q:[/] {question}  [dim](expected {answer})[/]")
    console.print(f"[bold]S3R:[/] {escape(results['completions']['s3r'][0].strip())}", highlight=False)
    if "note" in results:
        console.print(f"\n[dim]{escape(results['note'])}[/]")


# ----------------------------------------------------------------------------------------------------------
# CLI glue
# ----------------------------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def unit_interval(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def add_s3r_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """Add `--draft-len`, `--budget-ratio`, `--min-budget`; `defaults` (else `S3RConfig`'s) fill them in."""
    base = S3RConfig(**(defaults or {}))
    group = parser.add_argument_group("S3R")
    group.add_argument(
        "--draft-len",
        type=positive_int,
        default=base.draft_len,
        help="tokens drafted per round (%(default)s)",
    )
    group.add_argument(
        "--budget-ratio",
        type=unit_interval,
        default=base.budget_ratio,
        help="fraction of the context each sparse index view keeps (%(default)s)",
    )
    group.add_argument(
        "--min-budget",
        type=positive_int,
        default=base.min_budget,
        help="smallest index view; shorter contexts are drafted densely (%(default)s)",
    )


def s3r_config_from_args(args: argparse.Namespace, **extra: Any) -> S3RConfig:
    """`S3RConfig` from the flags `add_s3r_arguments` added, plus any other fields in `extra`."""
    return S3RConfig(draft_len=args.draft_len, budget_ratio=args.budget_ratio, min_budget=args.min_budget, **extra)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--model`, `--device` and `--dtype`."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="PATH_OR_HUB_ID",
        help="model directory, Hub id or .gguf file (default: the embedded %(default)s)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (%(default)s)")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `demo` subcommand's flags to `parser`."""
    add_model_arguments(parser)
    parser.add_argument(
        "--num-prompts", type=positive_int, default=4, help="batch size; the 8 bundled prompts are reused"
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate (%(default)s)")
    add_s3r_arguments(parser, DEMO_S3R_KWARGS)


def demo_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run `run_demo` with parsed `demo` flags."""
    return run_demo(
        model_name_or_path=args.model,
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        s3r_config=s3r_config_from_args(args),
        device=args.device,
        dtype=args.dtype,
    )
