"""`s3r-hf bench --rollout`: the RL rollout workload, timed whole, for `model.generate`, engine AR and S3R.

A GRPO-style rollout step asks for G sampled responses to each of a few prompts. This benchmark runs exactly that
and times every `generate` call from start to end (prefill, CUDA-graph captures, compilation, and the tail where a
few long responses run almost alone), so what it reports is what an RL user waits for:

- prompts: MATH-style problems (records with `"problem"` or `"question"`) from a JSON/JSONL file (`--data`), a
  `datasets` id (`--dataset`), or the problems shipped with the package; each wrapped as a user turn of the chat
  template and repeated G times (`--generations`), as TRL repeats them. Random-weight shapes (`qwen3-1.7b`,
  `qwen3-8b`, `qwen3-tiny`) get random-token prompts of `--seq` tokens instead and, having no EOS, run every
  response to `max_new_tokens`; `--acceptance P` forces their acceptance pattern (NOT exact: it times the cost side).
- sampling: temperature 1 with top-k and top-p off, EOS honoured, `max_new_tokens` from `--preset` or
  `--max-new-tokens`. `--greedy` decodes greedily instead: every exact mode then generates the same responses
  (on fp32; bf16 may part at near-ties), so their times compare the same work, which sampled calls, whose
  response lengths differ by chance from mode to mode, do not. Each mode's rows are compared with `ar`'s and the
  count that match is reported.
- modes, all on the same batch in one run (`--modes`): `generate` (plain `model.generate`), `ar` (the engine's dense
  decoding, `s3r_mode="ar"`), `s3r-fixed` (`S3RConfig(adaptive=False)`, the paper's fixed k) and `s3r-adaptive`
  (`S3RConfig(adaptive=True)`).
- calls: `--calls N` per mode, the same seeds in every mode, taken in turn: the first call of every mode, then the
  second of every mode, and so on, so that the calls compared run next to each other rather than one mode's after
  all of another's (a machine's speed drifts over a run). The first call of a mode is cold (it pays the compilation
  and autotuning nobody paid before it in this process; what one mode compiled, a later one reuses); "warm" figures
  are over the calls after it.

Reported per mode (table, `--json`, `--plot`): tokens/s (cold and warm) and their ratios to `ar` and `generate`, the
engine's time by phase (prefill, decode, CUDA-graph capture, the rest of the call), τ, vLLM's mean acceptance
length, acceptance rate, dense steps, and the mean and longest response. Benchmarks report; they assert nothing.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from s3r_hf.bench import (
    RANDOM_SHAPES,
    build_model,
    check_prompt_source,
    random_prompts,
    refresh_interval_arg,
    write_results,
)
from s3r_hf.cache.page_allocator import KVCapacityError
from s3r_hf.config import S3RConfig
from s3r_hf.demo import build_batch, eos_token_ids, generated_lengths, output_sequences, timed_generate
from s3r_hf.errors import UsageError, require
from s3r_hf.generate import enable
from s3r_hf.runtime_state import adaptive_policy
from s3r_hf.validation import context_window

logger = logging.get_logger(__name__)

PRESETS = {"short": 1024, "medium": 2048, "long": 4096, "8k": 8192, "16k": 16384}
"""`--preset` name -> `max_new_tokens`."""
DEFAULT_PRESET = "medium"
MODES = ("generate", "ar", "s3r-fixed", "s3r-adaptive")
ROLLOUT_DEFAULTS = {"prompts": 8, "generations": 8, "calls": 3, "modes": ",".join(MODES), "seed": 0, "greedy": False}
PACKAGED_PROMPTS = "rollout_prompts.json"
"""MATH-style problems shipped in `s3r_hf/data/`, the prompts when neither `--data` nor `--dataset` is given."""


class RolloutUsageError(UsageError):
    """A `bench` flag or prompt source that cannot be used; the CLI reports it in one line and exits with 2."""


# ----------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------


def problem_texts(records: Sequence[dict[str, Any]], source: str) -> list[str]:
    """The `"problem"` (MATH) or `"question"` (GSM8K) text of every record, in order."""
    texts = []
    for index, record in enumerate(records):
        text = (record.get("problem") or record.get("question")) if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise RolloutUsageError(f"{source}: record {index} has no 'problem' or 'question' text")
        texts.append(text)
    if not texts:
        raise RolloutUsageError(f"{source}: no records")
    return texts


def load_records(data: str | None = None, dataset: str | None = None, split: str = "train") -> tuple[list, str]:
    """Records (dicts) from a JSON (a list of records) or JSONL file, a `datasets` id, or the packaged problems; and
    the name of their source. Each failure (both given, no such file, bad JSON, `datasets` missing or unable to
    load the id, e.g. offline) is a `RolloutUsageError` that says which."""
    if data is not None and dataset is not None:
        raise RolloutUsageError("give the prompts with --data or --dataset, not both")
    if dataset is not None:
        datasets = require("datasets", "bench", "--dataset")
        try:
            records = datasets.load_dataset(dataset, split=split)
        except Exception as error:  # datasets raises many types (not found, no split, offline, ...)
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise RolloutUsageError(
                f"--dataset {dataset} (split {split}) could not be loaded ({type(error).__name__}: {first_line}); "
                "pass a local MATH-style JSON/JSONL file with --data instead"
            ) from error
        return list(records), f"--dataset {dataset}"
    if data is None:
        text = resources.files("s3r_hf").joinpath("data", PACKAGED_PROMPTS).read_text(encoding="utf-8")
        return json.loads(text), PACKAGED_PROMPTS
    path = Path(data)
    if not path.is_file():
        raise RolloutUsageError(f"--data {data}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = f"not UTF-8 text ({error.reason} at byte {error.start})" if isinstance(error, UnicodeDecodeError) \
            else f"cannot be read ({error.strerror or error})"
        raise RolloutUsageError(f"--data {data}: {reason}") from error
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            records = json.loads(text)
    except json.JSONDecodeError as error:
        raise RolloutUsageError(f"--data {data}: not valid JSON/JSONL: {error}") from error
    if not isinstance(records, list):
        raise RolloutUsageError(f"--data {data}: expected a list of records (JSON) or one record per line (JSONL)")
    return records, str(path)


def load_problems(data: str | None = None, dataset: str | None = None, split: str = "train") -> list[str]:
    """Problem texts from a JSON (a list of records) or JSONL file, a `datasets` id, or the packaged problems."""
    return problem_texts(*load_records(data, dataset, split))


def rollout_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    problems: Sequence[str],
    prompts: int,
    generations: int,
    seq: int,
) -> dict[str, torch.Tensor]:
    """`prompts` prompts, each repeated `generations` times in a row, as one left-padded batch on the model's device.

    With a tokenizer: the first `prompts` problems (reused in turn when there are fewer) in the chat template.
    Without one (random-weight shapes): random-token prompts of `seq` tokens.
    """
    if tokenizer is None:
        ids = random_prompts(model.config.vocab_size, prompts, seq).repeat_interleave(generations, dim=0)
        return {"input_ids": ids.to(model.device), "attention_mask": torch.ones_like(ids, device=model.device)}
    if len(problems) < prompts:
        logger.warning(f"{len(problems)} problems for {prompts} prompts: problems are reused in turn")
    chosen = [problems[i % len(problems)] for i in range(prompts)]
    batch = build_batch(tokenizer, [text for text in chosen for _ in range(generations)], device=model.device)
    return dict(batch)


# ----------------------------------------------------------------------------------------------------------
# One call, one mode
# ----------------------------------------------------------------------------------------------------------


def mode_kwargs(mode: str, config: S3RConfig, acceptance: float | None, stages: bool) -> dict[str, Any]:
    """The `generate` keyword arguments that select `mode` (sampling and lengths are common to all modes)."""
    if mode == "generate":
        return {}
    kwargs: dict[str, Any] = {"s3r_timing": "stages" if stages else True}
    fixed_rule = replace(config, adaptive=False, adaptive_draft_lengths=None)  # the paper's fixed k
    if mode == "ar":
        return {**kwargs, "s3r_config": fixed_rule, "s3r_mode": "ar"}
    kwargs["s3r_config"] = config if mode == "s3r-adaptive" else fixed_rule
    if acceptance is not None:
        kwargs["s3r_forced_acceptance"] = acceptance
    return kwargs


def release_memory(device: torch.device) -> None:
    """Drop the previous call's garbage and cached blocks, so each call sizes its KV pool from the same free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def call_record(output: Any, seconds: float, prompt_len: int, eos_ids: set[int], pad_token_id: int | None) -> dict:
    """Tokens, lengths and (for engine modes) phases and speculation counts of one timed `generate` call."""
    new_tokens = output_sequences(output)[:, prompt_len:].cpu()
    if eos_ids:
        lengths = generated_lengths(new_tokens, eos_ids, pad_token_id)
    else:  # no EOS: no row ends early, and a sampled token equal to the pad id is still a token
        lengths = [new_tokens.shape[1]] * new_tokens.shape[0]
    tokens = sum(lengths)
    # A short digest of each response, so modes that should generate the same responses (greedy) can be compared.
    digests = [hashlib.blake2b(row[:length].numpy().tobytes(), digest_size=6).hexdigest()
               for row, length in zip(new_tokens, lengths)]
    record: dict[str, Any] = {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "mean_length": tokens / max(len(lengths), 1),
        "max_length": max(lengths, default=0),
        "lengths": lengths,  # per response: modes' length distributions can be compared, not only their means
        "response_digests": digests,
    }
    stats = getattr(output, "s3r_stats", None)
    if stats is not None:
        decode = stats.decode_seconds - stats.graph_capture_seconds
        record.update(
            prefill_s=stats.prefill_seconds,
            decode_s=decode,
            graph_capture_s=stats.graph_capture_seconds,
            graph_captures=stats.graph_captures,
            # Validation, KV-pool allocation, output assembly: what the engine's own timers do not cover.
            other_s=max(seconds - stats.prefill_seconds - stats.decode_seconds, 0.0),
            steps=stats.decode_steps,
            decode_ms_per_step=decode / max(stats.decode_steps, 1) * 1e3,
            stats=stats.to_dict(),
        )
    return record


def decode_by_rows(calls: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per call on average, by running rows (`S3RStats.decode_by_rows`): seconds, steps and tokens."""
    totals: dict[int, dict[str, float]] = {}
    for call in calls:
        for rows, entry in call["stats"].get("decode_by_rows", {}).items():
            total = totals.setdefault(int(rows), {"seconds": 0.0, "steps": 0.0, "tokens": 0.0})
            for key in total:
                total[key] += entry[key] / len(calls)
    return dict(sorted(totals.items(), reverse=True))


def summarise(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Cold (first call) and warm (the calls after it; the first when there is only one) figures of a mode."""
    warm = calls[1:] or calls
    seconds = sum(c["seconds"] for c in warm)
    tokens = sum(c["tokens"] for c in warm)
    summary: dict[str, Any] = {
        "calls": len(calls),
        "cold_seconds": calls[0]["seconds"],
        "cold_tokens_per_s": calls[0]["tokens_per_s"],
        "warm_seconds_per_call": seconds / len(warm),
        "warm_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "mean_length": sum(c["mean_length"] for c in calls) / len(calls),
        "max_length": max(c["max_length"] for c in calls),
    }
    engine = [c for c in warm if "stats" in c]
    if engine:
        for phase in ("prefill_s", "decode_s", "graph_capture_s", "other_s"):
            summary[f"warm_{phase}"] = sum(c[phase] for c in engine) / len(engine)
        summary["warm_graph_captures"] = sum(c["graph_captures"] for c in engine) / len(engine)
        summary["warm_decode_by_rows"] = decode_by_rows(engine)
        summary["cold_graph_captures"] = calls[0].get("graph_captures", 0)
        # Speculation over every call (acceptance does not warm up), from the summed counts.
        totals = {key: sum(c["stats"][key] for c in calls) for key in
                  ("request_rounds", "num_drafts", "dense_steps", "drafted", "accepted", "committed", "decode_steps",
                   "view_refreshes", "view_extensions")}
        drafting_steps = totals["view_refreshes"] + totals["view_extensions"]
        summary.update(
            tau=totals["committed"] / totals["request_rounds"] if totals["request_rounds"] else 0.0,
            mean_acceptance_length=(1.0 + totals["accepted"] / totals["num_drafts"]) if totals["num_drafts"] else 1.0,
            acceptance_rate=totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
            dense_step_share=totals["dense_steps"] / totals["request_rounds"] if totals["request_rounds"] else 0.0,
            mean_rows_per_step=totals["request_rounds"] / totals["decode_steps"] if totals["decode_steps"] else 0.0,
            num_drafts=totals["num_drafts"],
            dense_steps=totals["dense_steps"],
            # Drafting steps per index-view refresh: 1 when every round refreshes (the paper).
            rounds_per_refresh=drafting_steps / totals["view_refreshes"] if totals["view_refreshes"] else 0.0,
            # The spread of the requests' own acceptance rates in the last call (rows that part under speculation).
            acceptance_by_request=calls[-1]["stats"].get("acceptance_by_request", {}),
        )
    return summary


def run_call(
    model: PreTrainedModel, batch: dict[str, torch.Tensor], mode: str, common: dict[str, Any], extra: dict[str, Any],
    call: int, calls: int, seed: int, eos_ids: set[int], console: Console,
) -> dict[str, Any]:
    """Call `call` (from 0) of `mode`, timed whole: its record. Raises what the call raised."""
    release_memory(model.device)
    torch.manual_seed(seed + call)  # the same seeds in every mode
    with console.status(f"{mode}: call {call + 1} of {calls}"):
        output, seconds = timed_generate(model, batch, **common, **extra)
    record = call_record(output, seconds, batch["input_ids"].shape[1], eos_ids, common.get("pad_token_id"))
    del output
    if mode == "s3r-adaptive":  # probes started so far per (rows, context) bucket: calls' differences say where
        record["policy_probes"] = {  # each call's probing went (the rule is kept across calls)
            f"{bucket['rows_from']}-{bucket['rows_to']} rows, context {bucket['context_from']}+": bucket["probes"]
            for bucket in adaptive_policy(model, extra["s3r_config"]).report()
        }
    console.print(f"  {mode} call {call + 1}: {record['seconds']:.2f} s, {record['tokens']} tokens "
                  f"({record['tokens_per_s']:,.0f} tok/s), longest {record['max_length']}", highlight=False)
    captured = record.get("stats", {}).get("captured_graphs")
    if call > 0 and captured:  # a kept runtime's later call should capture nothing: say what it needed
        console.print(f"    captured: {', '.join(captured)}", highlight=False)
    return record


def run_modes(
    model: PreTrainedModel, batch: dict[str, torch.Tensor], extras: dict[str, dict[str, Any]], common: dict[str, Any],
    calls: int, seed: int, eos_ids: set[int], console: Console,
) -> dict[str, dict[str, Any]]:
    """`calls` timed calls of every mode (`extras`: each mode's `generate` arguments), the modes taking turns call by
    call. Per mode, the call records and their summary, or the error that stopped its calls (the other modes go on)."""
    results: dict[str, dict[str, Any]] = {mode: {"calls": []} for mode in extras}
    for call in range(calls):
        for mode, extra in extras.items():
            result = results[mode]
            if "error" in result:
                continue
            try:
                result["calls"].append(run_call(model, batch, mode, common, extra, call, calls, seed, eos_ids, console))
            except (torch.OutOfMemoryError, KVCapacityError) as error:  # the other modes' numbers still stand
                result["error"] = f"{type(error).__name__}: {error}".splitlines()[0]
    for result in results.values():
        if result["calls"]:
            result["summary"] = summarise(result["calls"])
    return results


def run_point(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, name: str, problems: Sequence[str],
    seq: int, settings: dict[str, Any], console: Console,
) -> dict[str, Any]:
    """Every mode on one batch of `prompts x generations` rows of one model; the point's record."""
    batch = rollout_batch(model, tokenizer, problems, settings["prompts"], settings["generations"], seq)
    prompt_tokens = batch["attention_mask"].sum(dim=1)
    eos_ids = eos_token_ids(model, tokenizer) if tokenizer is not None else set()
    max_new_tokens = settings["max_new_tokens"]
    window = context_window(model)
    if window is not None and int(prompt_tokens.max()) + max_new_tokens > window:
        # Every mode would refuse (or, dense, run past the window): the point asks for what the model holds.
        max_new_tokens = window - int(prompt_tokens.max())
        console.print(f"max_new_tokens lowered to {max_new_tokens} for this point: the longest prompt has "
                      f"{int(prompt_tokens.max())} tokens and the model's context window {window}", highlight=False)
    sampling = {"do_sample": False} if settings.get("greedy") else {
        "do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
    }
    common: dict[str, Any] = {**sampling, "max_new_tokens": max_new_tokens, "return_dict_in_generate": True}
    if tokenizer is None:  # random weights: no EOS, every response runs to max_new_tokens
        common.update(pad_token_id=0, eos_token_id=None)
    else:
        common.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(eos_ids) or None)
    forced = settings["acceptance"] if tokenizer is None else None
    point: dict[str, Any] = {
        "model": name, "prompts": settings["prompts"], "generations": settings["generations"],
        "batch": int(batch["input_ids"].shape[0]), "max_new_tokens": max_new_tokens,
        "prompt_tokens": {"min": int(prompt_tokens.min()), "mean": float(prompt_tokens.float().mean()),
                          "max": int(prompt_tokens.max())},
        "acceptance_forced": forced, "greedy": bool(settings.get("greedy")), "modes": {},
    }
    console.print(f"\n[bold]{name}[/]  {point['prompts']} prompts x {point['generations']} generations = "
                  f"B {point['batch']}, prompts {point['prompt_tokens']['min']}-{point['prompt_tokens']['max']} "
                  f"tokens, max_new_tokens {point['max_new_tokens']}" + (", greedy" if point["greedy"] else "")
                  + (f", acceptance forced to {forced} (NOT exact)" if forced is not None else ""), highlight=False)
    extras = {mode: mode_kwargs(mode, settings["s3r_config"], forced, settings["stages"]) for mode in settings["modes"]}
    point["modes"] = run_modes(model, batch, extras, common, settings["calls"], settings["seed"], eos_ids, console)
    if "s3r-adaptive" in extras:  # what the rule measured per (rows, context) bucket, over all the calls
        point["modes"]["s3r-adaptive"]["policy"] = adaptive_policy(model, extras["s3r-adaptive"]["s3r_config"]).report()
    point["ratios"] = ratios(point["modes"])
    point["same_responses_as_ar"] = same_responses(point["modes"])
    print_point(point, console)
    return point


def ratios(modes: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Warm and cold tokens/s of every mode over those of `ar` and `generate` (where both ran), and the warm calls'
    speed by whole-call time (`warm_time_vs_ar`: AR's seconds per call over the mode's). Sampled calls of two modes
    draw different responses, and a call's tokens vary far more than its time when its longest responses run to
    `max_new_tokens`, so the time ratio is the steadier of the two there."""
    out: dict[str, dict[str, float]] = {}
    for mode, result in modes.items():
        summary = result.get("summary")
        if summary is None:
            continue
        for base in ("ar", "generate"):
            reference = modes.get(base, {}).get("summary")
            if reference is None or mode == base:
                continue
            for kind in ("warm", "cold"):
                if reference[f"{kind}_tokens_per_s"] > 0:
                    ratio = summary[f"{kind}_tokens_per_s"] / reference[f"{kind}_tokens_per_s"]
                    out.setdefault(mode, {})[f"{kind}_vs_{base}"] = ratio
            if base == "ar" and summary["warm_seconds_per_call"] > 0:
                ratio = reference["warm_seconds_per_call"] / summary["warm_seconds_per_call"]
                out.setdefault(mode, {})["warm_time_vs_ar"] = ratio
    return out


def same_responses(modes: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """Per mode, `[responses equal to ar's, responses]` over the calls both ran: with `--greedy`, whether two modes'
    times measured the same work."""
    reference = modes.get("ar", {}).get("calls", [])
    out = {}
    for mode, result in modes.items():
        if mode == "ar" or not reference:
            continue
        pairs = [(a, b) for call, base in zip(result["calls"], reference)
                 for a, b in zip(call["response_digests"], base["response_digests"])]
        out[mode] = [sum(a == b for a, b in pairs), len(pairs)]
    return out


# ----------------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_point(point: dict[str, Any], console: Console) -> None:
    """Two tables, a row per mode: speed, ratios and response lengths; then the engine modes' phases and speculation."""
    title = f"{point['model']}, B={point['batch']}, max_new_tokens {point['max_new_tokens']}"
    speed = Table(title=f"{title}: speed", caption="warm: the calls after the first (cold) one; vs AR by tokens/s, "
                  "and by seconds per call (steadier when sampled responses differ in length from mode to mode)")
    for header in ("mode", "cold s", "warm s/call", "warm tok/s", "vs AR", "vs AR (time)", "vs generate", "mean len",
                   "max len"):
        speed.add_column(header, justify="left" if header == "mode" else "right", no_wrap=True)
    engine = Table(title=f"{title}: engine", caption="seconds per warm call; τ: tokens per request-round, dense "
                   "steps included; MAL: vLLM's mean acceptance length, 1 + accepted / drafts; p10–p90: the "
                   "requests' own acceptance rates in the last call; dense: share of request-rounds that drafted "
                   "nothing; N: drafting steps per index-view refresh")
    for header in ("mode", "prefill", "decode", "captures (n)", "other", "τ", "MAL", "accept", "p10–p90", "dense",
                   "N"):
        engine.add_column(header, justify="left" if header == "mode" else "right", no_wrap=True)
    for mode, result in point["modes"].items():
        s = result.get("summary")
        if s is None:
            speed.add_row(mode, f"[red]{result.get('error', 'no call finished')}[/]")
            continue
        r = point["ratios"].get(mode, {})
        speed.add_row(
            mode, f"{s['cold_seconds']:.2f}", f"{s['warm_seconds_per_call']:.2f}", f"{s['warm_tokens_per_s']:,.0f}",
            _fmt(r.get("warm_vs_ar"), ".2f"), _fmt(r.get("warm_time_vs_ar"), ".2f"),
            _fmt(r.get("warm_vs_generate"), ".2f"), f"{s['mean_length']:.0f}",
            str(s["max_length"]),
        )
        if "error" in result:
            speed.add_row("", f"[red]later calls: {result['error']}[/]")
        if "tau" in s:
            drafts = mode != "ar"  # AR drafts nothing: no acceptance to show
            engine.add_row(
                mode, f"{s['warm_prefill_s']:.2f}", f"{s['warm_decode_s']:.2f}",
                f"{s['warm_graph_capture_s']:.2f} ({s['warm_graph_captures']:.0f})", f"{s['warm_other_s']:.2f}",
                f"{s['tau']:.2f}", f"{s['mean_acceptance_length']:.2f}" if drafts else "-",
                f"{s['acceptance_rate']:.3f}" if drafts else "-", _spread(s.get("acceptance_by_request", {})),
                f"{s['dense_step_share']:.0%}",
                f"{s['rounds_per_refresh']:.2f}" if s["rounds_per_refresh"] else "-",
            )
    console.print(speed)
    if point.get("greedy"):
        console.print("responses equal to ar's: " + ", ".join(
            f"{mode} {same}/{total}" for mode, (same, total) in point["same_responses_as_ar"].items()), highlight=False)
    if engine.row_count:
        console.print(engine)
        console.print(rows_table(point, title))


def _spread(by_request: dict[str, float]) -> str:
    """`p10–p90` of the requests' own acceptance rates, or `-` where too few requests drafted."""
    return f"{by_request['p10']:.2f}–{by_request['p90']:.2f}" if by_request else "-"


def rows_table(point: dict[str, Any], title: str) -> Table:
    """Decoding by the number of requests still running, per warm call: where each mode spends the call (the tail of
    a few long responses, say) and what a step costs there."""
    modes = {mode: result["summary"]["warm_decode_by_rows"] for mode, result in point["modes"].items()
             if "warm_decode_by_rows" in result.get("summary", {})}
    table = Table(title=f"{title}: decoding by running rows",
                  caption="per warm call: seconds / engine steps, and ms per step; rows: at most that many running")
    table.add_column("rows", justify="right")
    for mode in modes:
        table.add_column(mode, justify="right", no_wrap=True)
    for rows in sorted({rows for by_rows in modes.values() for rows in by_rows}, reverse=True):
        cells = []
        for by_rows in modes.values():
            entry = by_rows.get(rows)
            if entry is None or not entry["steps"]:
                cells.append("-")
                continue
            seconds, steps = entry["seconds"], entry["steps"]
            cells.append(f"{seconds:.2f} s / {steps:.0f}, {seconds / steps * 1e3:.2f}")
        table.add_row(str(rows), *cells)
    return table


def plot(points: list[dict[str, Any]], path: str) -> None:
    """Bars of warm tokens/s per mode, one group per point; a dash marks each mode's cold (first-call) tokens/s."""
    matplotlib = require("matplotlib", "bench", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(m in p["modes"] for p in points)]
    width = 0.8 / max(len(modes), 1)
    figure, axis = plt.subplots(figsize=(max(6.0, 1.8 * len(points) + 3), 4))
    for index, mode in enumerate(modes):
        xs, warm, cold = [], [], []
        for number, point in enumerate(points):
            summary = point["modes"].get(mode, {}).get("summary")
            if summary is not None:
                xs.append(number + (index - (len(modes) - 1) / 2) * width)
                warm.append(summary["warm_tokens_per_s"])
                cold.append(summary["cold_tokens_per_s"])
        axis.bar(xs, warm, width=width, label=mode)
        axis.scatter(xs, cold, marker="_", s=200, color="black", linewidths=1.5, zorder=3,
                     label="first call" if index == 0 else None)
    axis.set_xticks(range(len(points)))
    axis.set_xticklabels([f"{p['model']}\nB={p['batch']}, ≤{p['max_new_tokens']}" for p in points], fontsize=8)
    axis.set_ylabel("tokens/s (bars: warm calls; dash: first call)")
    axis.set_title("Rollout generation speed by mode")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ----------------------------------------------------------------------------------------------------------
# CLI glue (`s3r-hf bench --rollout`; the shared flags are `bench`'s)
# ----------------------------------------------------------------------------------------------------------


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--rollout` and its own flags to the `bench` parser."""
    group = parser.add_argument_group(
        "rollout (--rollout)",
        "The RL rollout workload: G sampled responses (T=1, no top-k/top-p, EOS honoured; --greedy: greedy) to each "
        "prompt, every generate call timed whole, for each mode. Shared flags: --model, --max-new-tokens, "
        "--draft-len, --budget and --refresh-interval (one value each), --min-budget, --prefill-chunk, --acceptance "
        "(random shapes), --seq (random shapes' prompt length), --data, --dataset, --split, --dtype, --device, "
        "--cuda-graphs, --compile-layers, --fused-layers, --draft-matmul-precision, --stages, --skip-generate, "
        "--json, --plot.",
    )
    group.add_argument("--rollout", action="store_true", help="run the rollout benchmark instead of the decode grid")
    # The flags of this group default to None (their defaults are ROLLOUT_DEFAULTS), so the decode grid can tell
    # which were given and refuse them instead of ignoring them.
    group.add_argument("--prompts", type=int, default=None,
                       help=f"distinct prompts per batch ({ROLLOUT_DEFAULTS['prompts']})")
    group.add_argument("--generations", type=int, default=None,
                       help=f"responses per prompt, G ({ROLLOUT_DEFAULTS['generations']})")
    group.add_argument("--preset", choices=sorted(PRESETS, key=PRESETS.get), default=None,
                       help="max_new_tokens: " + ", ".join(f"{k} {v}" for k, v in PRESETS.items())
                       + f" (default {DEFAULT_PRESET}; --max-new-tokens overrides)")
    group.add_argument("--calls", type=int, default=None,
                       help=f"timed calls per mode; the first is cold ({ROLLOUT_DEFAULTS['calls']})")
    group.add_argument("--modes", default=None, help=f"comma-separated subset of {ROLLOUT_DEFAULTS['modes']}")
    group.add_argument("--seed", type=int, default=None,
                       help=f"call i of every mode samples from seed + i ({ROLLOUT_DEFAULTS['seed']})")
    group.add_argument("--adaptive-draft-lengths", default=None,
                       help="S3RConfig.adaptive_draft_lengths of the s3r-adaptive mode, e.g. 0,3,6 (default: 0 and "
                       "--draft-len)")
    group.add_argument("--greedy", action="store_true", default=None,
                       help="decode greedily instead of sampling at T=1: exact modes generate the same responses, so "
                       "their times compare the same work")


def rollout_flags_given(args: argparse.Namespace) -> list[str]:
    """The rollout-only flags on the command line (`bench` without `--rollout` refuses them)."""
    flags = ("prompts", "generations", "preset", "calls", "modes", "seed", "adaptive_draft_lengths", "greedy")
    return ["--" + name.replace("_", "-") for name in flags if getattr(args, name, None) is not None]


def _single(values: str, flag: str, kind: type) -> Any:
    parts = [v for v in str(values).split(",") if v.strip()]
    if len(parts) != 1:
        raise RolloutUsageError(f"{flag} takes one value with --rollout, got {values!r}")
    try:
        return kind(parts[0])
    except ValueError as error:
        raise RolloutUsageError(f"{flag}: {error}") from error


def _lengths(values: str | None) -> tuple[int, ...] | None:
    """`--adaptive-draft-lengths` as a tuple (S3RConfig checks the values)."""
    if values is None:
        return None
    try:
        return tuple(int(v) for v in values.split(",") if v.strip())
    except ValueError as error:
        raise RolloutUsageError(f"--adaptive-draft-lengths takes integers like 0,3,6, got {values!r}") from error


def rollout_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Check the flags and resolve them into the run's settings; `RolloutUsageError` names the first bad one."""
    args = argparse.Namespace(**{**vars(args), **{
        name: default for name, default in ROLLOUT_DEFAULTS.items() if getattr(args, name, None) is None}})
    for flag in ("batch", "requests"):  # the decode grid's; `bench` leaves them None unless given
        if getattr(args, flag, None) is not None:
            raise RolloutUsageError(f"--{flag} does not apply with --rollout (B = --prompts x --generations)")
    for name in ("prompts", "generations", "calls"):
        if getattr(args, name) < 1:
            raise RolloutUsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.skip_generate:
        modes = [m for m in modes if m != "generate"]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or len(set(modes)) != len(modes):
        raise RolloutUsageError(f"--modes must name distinct modes of {','.join(MODES)}, got {args.modes!r}")
    if args.max_new_tokens is not None:
        max_new_tokens = args.max_new_tokens
    else:
        max_new_tokens = PRESETS[args.preset or DEFAULT_PRESET]
    if max_new_tokens < 1:
        raise RolloutUsageError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    models = args.model or ["smollm2-135m-instruct"]
    real = check_prompt_source(models, args.data, args.dataset, args.acceptance)
    if args.acceptance is not None and not 0.0 <= args.acceptance <= 1.0:
        raise RolloutUsageError(f"--acceptance must be in [0, 1], got {args.acceptance}")
    if args.seed < 0:
        raise RolloutUsageError(f"--seed must be >= 0, got {args.seed}")
    try:
        seqs = [int(v) for v in str(args.seq).split(",") if v.strip()]
    except ValueError:
        seqs = []
    if any(s < 1 for s in seqs) or not seqs:
        raise RolloutUsageError(f"--seq must be positive prompt lengths, got {args.seq!r}")
    try:
        config = S3RConfig(
            draft_len=args.draft_len, budget_ratio=_single(args.budget, "--budget", float), min_budget=args.min_budget,
            refresh_interval=_single(args.refresh_interval, "--refresh-interval", refresh_interval_arg),
            prefill_chunk_size=args.prefill_chunk, cuda_graphs=args.cuda_graphs, compile_layers=args.compile_layers,
            fused_layers=args.fused_layers, draft_matmul_precision=args.draft_matmul_precision,
            adaptive_draft_lengths=_lengths(args.adaptive_draft_lengths),
        )
    except ValueError as error:
        raise RolloutUsageError(str(error)) from error
    problems = load_problems(args.data, args.dataset, args.split) if real else []
    return {
        "models": models, "prompts": args.prompts, "generations": args.generations, "max_new_tokens": max_new_tokens,
        "calls": args.calls, "modes": modes, "seqs": seqs, "acceptance": args.acceptance, "s3r_config": config,
        "stages": args.stages, "seed": args.seed, "greedy": args.greedy, "problems": problems, "dtype": args.dtype,
        "device": args.device,
        "prompt_source": args.dataset or args.data or f"s3r_hf/data/{PACKAGED_PROMPTS}",
    }


def rollout_from_args(args: argparse.Namespace, console: Console | None = None) -> dict[str, Any]:
    """Run `s3r-hf bench --rollout`: every model (and, for random shapes, every `--seq`), every mode."""

    settings = rollout_settings(args)
    # Logs of GPU runs are files, where rich would squeeze the tables into 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    points = []
    for name in settings["models"]:
        model, tokenizer = build_model(name, getattr(torch, settings["dtype"]), settings["device"])
        enable(model)
        for seq in settings["seqs"] if name in RANDOM_SHAPES else [0]:
            points.append(run_point(model, tokenizer, name, settings["problems"], seq, settings, console))
        del model, tokenizer
        release_memory(torch.device(settings["device"]))
    on_cuda = settings["device"].startswith("cuda")
    shown = {k: v for k, v in settings.items() if k != "problems"}
    shown["s3r_config"] = settings["s3r_config"].to_dict()
    result = {"device": torch.cuda.get_device_name() if on_cuda else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "settings": shown, "points": points}
    if args.json:
        write_results(args.json, result)
    if args.plot:
        plot(points, args.plot)
    return result
