"""`s3r-hf bench`: S3R vs dense decoding in the same engine (AR) vs `model.generate`, on the same prompts.

For each (model, B, S): decode ms per step (AR, `model.generate`) or per round (S3R), tokens/s, speedups, τ,
acceptance rate, the mean number of requests a step ran (`rows`) and the bandwidth floor of one dense decode step
(weights + all KV bytes at the measured copy bandwidth). `--requests N` runs N prompts through the engine at most
B at a time (a rollout queue: a finished request's slot goes to the next prompt); by default N = B, one fixed
batch, whose last steps run only the slowest rows. Random-weight shapes (`qwen3-1.7b`, `qwen3-8b`) accept
nothing meaningful; `--acceptance P` fixes their acceptance pattern (each draft kept with probability P, NOT
exact) so the cost side can be timed, and the report says so. Benchmarks report timings; they assert nothing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config
from transformers.utils import logging

from s3r_hf.bench_kernels import copy_bandwidth
from s3r_hf.cache.s3r_cache import kv_shape, page_bytes
from s3r_hf.config import DRAFT_WEIGHT_FORMATS, S3RConfig
from s3r_hf.errors import UsageError
from s3r_hf.generate import enable

logger = logging.get_logger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""`s3r_hf.models.DEFAULT_MODEL`, the model when no `--model` is given."""

RANDOM_SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    # For smoke tests of the benchmark itself on a CPU.
    "qwen3-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}


def build_model(name: str, dtype: torch.dtype, device: str) -> tuple[PreTrainedModel, object | None]:
    """A random-weight model of a named shape, or a real model (and its tokenizer) by name or path."""
    if name in RANDOM_SHAPES:
        config = Qwen3Config(**RANDOM_SHAPES[name], max_position_embeddings=40960, pad_token_id=0,
                             eos_token_id=None, bos_token_id=None)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval(), None
    from s3r_hf.models import load_model_and_tokenizer

    return load_model_and_tokenizer(name, dtype=dtype, device=device)


def real_texts(records: list[dict]) -> list[str]:
    """One text per MATH-style record: its problem (or question), then its solution (or answer)."""
    texts = []
    for record in records:
        problem = (record.get("problem") or record.get("question")) if isinstance(record, dict) else None
        if isinstance(problem, str) and problem.strip():
            texts.append(f"Problem: {problem}\nSolution: {record.get('solution', record.get('answer', ''))}\n\n")
    return texts


def load_texts(data: str | None = None, dataset: str | None = None, split: str = "train") -> tuple[list[str], str]:
    """`real_texts` of a MATH-style JSON/JSONL file, a `datasets` id or (neither given) the packaged problems, and the
    name of their source; a source that cannot be read raises a `UsageError` saying why."""
    from s3r_hf.rollout_bench import load_records

    records, source = load_records(data, dataset, split)
    return real_texts(records), source


def text_prompts(tokenizer, batch: int, seq: int, texts: list[str]) -> tuple[torch.Tensor, int]:
    """`[batch, seq]` prompts of real text: `texts` concatenated in turn (reused from the first once all are used).

    Returns the prompts and the number of tokens the distinct texts hold; fewer than `batch * seq` means the prompts
    repeat text, on which speculative drafts are accepted more often than on fresh text.
    """
    if not texts:
        raise UsageError("the prompt source has no records with a 'problem' or 'question' text")
    tokenized: dict[int, list[int]] = {}
    prompts: list[list[int]] = []
    cursor = 0
    for _ in range(batch):
        ids: list[int] = []
        while len(ids) < seq:
            index = cursor % len(texts)
            if index not in tokenized:
                tokenized[index] = tokenizer(texts[index], add_special_tokens=False)["input_ids"]
            ids += tokenized[index]
            cursor += 1
        prompts.append(ids[:seq])
    return torch.tensor(prompts), sum(len(ids) for ids in tokenized.values())


def random_prompts(vocab: int, batch: int, seq: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(1, vocab, (batch, seq), generator=generator)


def floor_ms(model: PreTrainedModel, batch: int, context: int, bandwidth: float) -> float:
    """Bytes one dense decode step must read (all weights + every request's KV) over the copy bandwidth."""
    return _dense_step_bytes(model, batch, context) / bandwidth * 1e3


def _weight_bytes(model: PreTrainedModel) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _dense_step_bytes(model: PreTrainedModel, batch: int, context: int) -> int:
    return _weight_bytes(model) + batch * context * page_bytes(model.config, 1, model.dtype)


def stage_floors_ms(
    model: PreTrainedModel, batch: int, context: int, config: S3RConfig, bandwidth: float
) -> dict[str, float]:
    """Bandwidth floor of each stage of one S3R round (`--stages`), in ms: the bytes the stage must move at least,
    over the copy bandwidth. draft: `draft_len` sparse passes, each reading the weights, the index views' K/V and the
    views themselves; verify: the weights and every request's K/V (as a dense step); accept: the target and draft
    scores `[batch, draft_len + 1, vocab]` in fp32; refresh: the reduced scores `[layers, batch, Hkv, context]` in
    fp32, read once, and the new views written. Commit is host work and has none. With 8-bit draft weights
    (`S3RConfig.draft_weights`) a draft pass reads the decoder layers' linears at one byte a weight, and their float32
    scales."""
    weights = _weight_bytes(model)
    draft_weights = weights
    if config.draft_weights != "model":
        from s3r_hf.compiled_layers import decoder_layers
        from s3r_hf.draft_weights import quantizable

        group = DRAFT_WEIGHT_FORMATS[config.draft_weights][1]
        linears = [m.weight for layer in decoder_layers(model) for m in layer.modules() if quantizable(m)]
        for w in linears:  # one byte a weight, and a 4-byte scale per row or per group
            scales = w.shape[0] if group is None else w.numel() // group
            draft_weights -= w.numel() * (w.element_size() - 1) - 4 * scales
    kv_per_token = page_bytes(model.config, 1, model.dtype)
    layers, kv_heads, _ = kv_shape(model.config)
    budget = config.budget(context)
    view_bytes = batch * layers * kv_heads * budget * 4  # int32 positions
    vocab = model.get_output_embeddings().weight.shape[0]
    bytes_per_stage = {
        "draft": config.draft_len * (draft_weights + batch * budget * kv_per_token + view_bytes),
        "verify": _dense_step_bytes(model, batch, context),
        "accept": 2 * batch * (config.draft_len + 1) * vocab * 4,
        "refresh": batch * layers * kv_heads * context * 4 + view_bytes,
    }
    return {stage: size / bandwidth * 1e3 for stage, size in bytes_per_stage.items()}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_hf_generate(model, input_ids, max_new_tokens: int, device: str) -> dict:
    """Decode time of `model.generate` (whole call minus a one-token call, i.e. minus prefill)."""
    mask = torch.ones_like(input_ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    _sync(device)
    start = time.perf_counter()
    model.generate(input_ids, max_new_tokens=1, **kwargs)
    _sync(device)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(input_ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **kwargs)
    _sync(device)
    decode = time.perf_counter() - start - prefill
    tokens = input_ids.shape[0] * (max_new_tokens - 1)
    return {"ms_per_step": decode / (max_new_tokens - 1) * 1e3, "tokens_per_s": tokens / decode}


def _sweep(values: str, flag: str, kind) -> list:
    """A comma-separated sweep flag's values; `UsageError` naming the flag for one that does not parse."""
    try:
        return [kind(v) for v in str(values).split(",")]
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise UsageError(f"{flag}: {error}") from error


def probability(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = float(text)
    if not 0.0 <= value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def check_output_path(path: str | None, flag: str) -> None:
    """Before anything runs: `path` (a `--json` or `--plot` file) can be written, so no result is lost at the end."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; name a file")
    parent = target.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")


def write_results(path: str, result: dict) -> None:
    """Write `result` as JSON to `path` (`--json`); a write that fails (a full disk, a device file) is a usage error
    that names the path, after the tables the run printed."""
    try:
        Path(path).expanduser().write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    except OSError as error:
        raise UsageError(f"--json {path}: the results could not be written ({error.strerror or error})") from error


def check_prompt_source(
    models: list[str], data: str | None, dataset: str | None, acceptance: float | None
) -> list[str]:
    """The real models of `models` (the others are random-weight shapes), after refusing the prompt and acceptance
    flags that would be ignored: random-weight shapes take random prompts and only they take a forced acceptance (a
    real model's acceptance is its own)."""
    real = [name for name in models if name not in RANDOM_SHAPES]
    if acceptance is not None and real:
        raise UsageError(f"--acceptance forces the acceptance of random-weight shapes only; {real[0]} is a real "
                         "model, whose acceptance is its own")
    if not real and (data is not None or dataset is not None):
        flag = "--data" if data is not None else "--dataset"
        raise UsageError(f"{flag} gives prompts to real models; the random-weight shapes ({', '.join(models)}) take "
                         "random prompts")
    return real


def refresh_interval_arg(value: str) -> int | None:
    """`--refresh-interval`: a number of rounds, or "auto" for `S3RConfig.refresh_interval=None`."""
    return None if value.strip() == "auto" else int(value)


def time_engine(
    model, input_ids, max_new_tokens: int, config: S3RConfig, mode: str, acceptance, stages: bool = False
) -> dict:
    mask = torch.ones_like(input_ids)
    out = model.generate(
        input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
        eos_token_id=None, s3r_config=config, s3r_mode=mode, s3r_forced_acceptance=acceptance,
        s3r_timing="stages" if stages else True,
    )
    stats = out.s3r_stats
    # Steady state: CUDA-graph captures (once per batch bucket and call) are reported apart.
    decode = stats.decode_seconds - stats.graph_capture_seconds
    return {
        "ms_per_step": decode / max(stats.decode_steps, 1) * 1e3,
        "tokens_per_s": stats.committed / decode,
        # Requests per step: below B when a fixed batch's finished rows leave the slowest ones running alone.
        "mean_rows_per_step": stats.request_rounds / max(stats.decode_steps, 1),
        "graph_captures": stats.graph_captures,
        "graph_capture_s": stats.graph_capture_seconds,
        "prefill_s": stats.prefill_seconds,
        "tau": stats.tau,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "acceptance_rate": stats.acceptance_rate,
        "per_position_acceptance": stats.per_position_acceptance,
        "stage_ms_per_step": {k: v / max(stats.decode_steps, 1) * 1e3 for k, v in stats.stage_seconds.items()},
        "sequences": out,
    }


def greedy_agreement(s3r: torch.Tensor, ar: torch.Tensor, prompt_len: int) -> dict:
    """Whether greedy S3R reproduced greedy AR, and where rows part when they do not: in bf16 two different
    kernels (a 7-query verify block vs a 1-query step) round differently, and a near-tie argmax can flip."""
    differs = s3r[:, prompt_len:] != ar[:, prompt_len:]
    rows = differs.any(dim=1)
    first = differs.int().argmax(dim=1)[rows]
    return {
        "greedy_matches_ar": not bool(rows.any()),
        "greedy_rows_differing": int(rows.sum()),
        "greedy_first_divergence": int(first.min()) if rows.any() else None,  # generated-token index
    }


def run_point(model, tokenizer, name, batch, seq, args, bandwidth) -> dict:
    device = str(model.device)
    requests = args.requests if args.requests is not None else batch
    repeats = None
    if tokenizer is not None:
        input_ids, distinct = text_prompts(tokenizer, requests, seq, args.texts)
        input_ids = input_ids.to(device)
        if distinct < requests * seq:
            repeats = requests * seq / max(distinct, 1)
            print(f"\nnote: {args.prompt_source} holds {distinct:,} tokens of text, so the {requests} x {seq} prompt "
                  f"tokens repeat it {repeats:.1f} times; drafts are accepted more often on repeated text than on "
                  "fresh text, so acceptance and speedups here are optimistic. For real-text figures pass a larger "
                  "MATH-style file with --data FILE or a `datasets` id with --dataset ID.")
    else:
        input_ids = random_prompts(model.config.vocab_size, requests, seq).to(device)
    context = seq + args.max_new_tokens // 2  # where the floors are taken: the middle of the decoding
    point = {"model": name, "batch": batch, "requests": requests, "seq": seq, "max_new_tokens": args.max_new_tokens,
             "cuda_graphs": args.cuda_graphs, "compile_layers": args.compile_layers,
             "fused_layers": args.fused_layers, "draft_matmul_precision": args.draft_matmul_precision,
             "floor_ms": floor_ms(model, batch, context, bandwidth),
             "acceptance_forced": args.acceptance,
             "prompt_source": args.prompt_source if tokenizer is not None else "random tokens",
             "prompt_text_repeats": repeats}
    # At most `batch` requests run at once (a fixed AIMD limit); the rest wait for a slot.
    base = S3RConfig(draft_len=args.draft_len, min_budget=args.min_budget, page_size=16,
                     prefill_chunk_size=args.prefill_chunk, cuda_graphs=args.cuda_graphs,
                     compile_layers=args.compile_layers, fused_layers=args.fused_layers, concurrency_min=batch,
                     concurrency_max=batch, draft_matmul_precision=args.draft_matmul_precision)
    if args.warmup:
        # First-use costs (compilation of new shape classes, Triton compilation, allocator growth) fall here, not
        # in a timed call: without it the first call of a process is markedly slower than a repeat of it.
        warmup_tokens = min(args.max_new_tokens, 2 * (args.draft_len + 1))
        first_budget = S3RConfig(**{**base.to_dict(), "budget_ratio": args.budget[0]})
        for mode, config, acceptance in [("ar", base, None), ("s3r", first_budget, args.acceptance)]:
            _release_memory(device)
            time_engine(model, input_ids[:batch], warmup_tokens, config, mode, acceptance)
    _release_memory(device)
    ar = time_engine(model, input_ids, args.max_new_tokens, base, "ar", None, args.stages)
    point["engine_ar"] = {k: v for k, v in ar.items() if k != "sequences"}
    if args.stages:  # a dense step is engine AR's verify stage
        point["engine_ar"]["stage_floor_ms"] = {"verify": point["floor_ms"]}
    point["s3r"] = {}
    for ratio, interval, weights in itertools.product(args.budget, args.refresh_interval, args.draft_weights):
        config = S3RConfig(**{**base.to_dict(), "budget_ratio": ratio, "refresh_interval": interval,
                              "draft_weights": weights})
        _release_memory(device)
        s3r = time_engine(model, input_ids, args.max_new_tokens, config, "s3r", args.acceptance, args.stages)
        if args.acceptance is None:  # exact runs: greedy S3R must reproduce greedy AR
            s3r.update(greedy_agreement(s3r["sequences"], ar["sequences"], input_ids.shape[1]))
        # r2: views refreshed every second round; no suffix: the interval the config chooses (adaptive: the rule's);
        # int8: the draft passes' weights (S3RConfig.draft_weights)
        key = str(ratio) if interval is None else f"{ratio} r{interval}"
        key += "" if weights == "model" else f" {weights}"
        point["s3r"][key] = {k: v for k, v in s3r.items() if k != "sequences"}
        if args.stages:
            point["s3r"][key]["stage_floor_ms"] = stage_floors_ms(model, batch, context, config, bandwidth)
    if not args.skip_generate:  # the engine's numbers stand even if model.generate runs out of memory
        _release_memory(device)
        try:
            # One batch of B: without EOS every row runs to max_new_tokens, so a queue would change nothing.
            point["hf_generate"] = time_hf_generate(model, input_ids[:batch], args.max_new_tokens, device)
        except torch.OutOfMemoryError as error:
            point["hf_generate_error"] = f"out of memory: {error}".splitlines()[0]
    print_point(point)
    return point


def _release_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def print_point(point: dict) -> None:
    ar = point["engine_ar"]
    forced = f" (acceptance forced to {point['acceptance_forced']}, not exact)" if point["acceptance_forced"] else ""
    queue = f"  {point['requests']} requests" if point.get("requests", point["batch"]) > point["batch"] else ""
    print(f"\n{point['model']}  B={point['batch']}{queue}  S={point['seq']}  floor {point['floor_ms']:.2f} ms/step"
          f"{forced}")
    print(f"{'method':<18}{'ms/step':>10}{'tok/s':>12}{'vs AR':>8}{'vs HF':>8}{'tau':>7}{'accept':>8}{'rows':>7}"
          f"{'=AR':>9}")
    captures = [(label, r) for label, r in [("AR", ar)] + list(point["s3r"].items()) if r.get("graph_captures")]
    for label, r in captures:
        print(f"  {label}: {r['graph_captures']} CUDA-graph captures, {r['graph_capture_s']:.2f} s (excluded)")
    for label, r in [("AR", ar)] + list(point["s3r"].items()):
        if r.get("stage_ms_per_step"):
            floors = r.get("stage_floor_ms", {})
            parts = ", ".join(f"{stage} {ms:.2f}{_over_floor(ms, floors.get(stage))}"
                              for stage, ms in r["stage_ms_per_step"].items())
            print(f"  {label} stages, ms per step (synchronized): {parts}")
    hf = point.get("hf_generate")
    if "hf_generate_error" in point:
        print(f"model.generate failed: {point['hf_generate_error']}")
    rows = [("engine AR", ar)] + [(f"S3R s={ratio}", r) for ratio, r in point["s3r"].items()]
    if hf:
        rows.append(("model.generate", hf))
    for label, r in rows:
        vs_hf = r["tokens_per_s"] / hf["tokens_per_s"] if hf else float("nan")
        tau = r.get("tau", 1.0)
        accept = r.get("acceptance_rate", float("nan"))
        match = {True: "yes", False: f"{r.get('greedy_rows_differing')} rows"}.get(r.get("greedy_matches_ar"), "")
        rows_per_step = r.get("mean_rows_per_step", float("nan"))
        print(f"{label:<18}{r['ms_per_step']:>10.2f}{r['tokens_per_s']:>12.0f}"
              f"{r['tokens_per_s'] / ar['tokens_per_s']:>8.2f}{vs_hf:>8.2f}{tau:>7.2f}{accept:>8.3f}"
              f"{rows_per_step:>7.1f}{match:>9}")


def _over_floor(ms: float, floor: float | None) -> str:
    """` (2.1x floor)` where the stage has a floor (on a GPU: the CPU run measures no bandwidth), else nothing."""
    return f" ({ms / floor:.1f}x floor)" if floor is not None and math.isfinite(floor) and floor > 0 else ""


def plot(points: list[dict], path: str) -> None:
    from s3r_hf.errors import require

    matplotlib = require("matplotlib", "bench", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for model in sorted({p["model"] for p in points}):
        for batch in sorted({p["batch"] for p in points if p["model"] == model}):
            chosen = sorted((p for p in points if p["model"] == model and p["batch"] == batch), key=lambda p: p["seq"])
            ratio = next(iter(chosen[0]["s3r"]))
            speedups = [p["s3r"][ratio]["tokens_per_s"] / p["engine_ar"]["tokens_per_s"] for p in chosen]
            axis.plot([p["seq"] for p in chosen], speedups, marker="o", label=f"{model} B={batch}")
    axis.set_xlabel("context length S")
    axis.set_ylabel("S3R tokens/s ÷ engine AR tokens/s")
    axis.set_xscale("log", base=2)
    axis.axhline(1.0, color="grey", linewidth=0.5)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from s3r_hf.demo import positive_int

    parser.add_argument("--model", action="append", help="qwen3-1.7b, qwen3-8b (random weights) or a real model; "
                        "repeatable (default: the embedded SmolLM2-135M)")
    parser.add_argument("--batch", default=None,
                        help="comma-separated batch sizes (requests running at once; default 16)")
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="prompts per point, run at most B at a time (default: B, one fixed batch)")
    parser.add_argument("--seq", default="1024", help="comma-separated prompt lengths")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None,
                        help="tokens to generate (default 128; with --rollout, the --preset's)")
    parser.add_argument("--budget", default="0.05", help="comma-separated budget ratios (a sweep)")
    parser.add_argument("--refresh-interval", default="auto",
                        help="comma-separated S3RConfig.refresh_interval values, 'auto' for None (the adaptive rule's "
                             "choice, every round without it); a sweep, rows 's r2' for 2")
    parser.add_argument("--draft-weights", default="model",
                        help="comma-separated S3RConfig.draft_weights values (model, int8, int8-g64, int8-g128); a "
                        "sweep, rows 's int8' for int8")
    parser.add_argument("--draft-len", type=int, default=6)
    parser.add_argument("--min-budget", type=positive_int, default=192)
    parser.add_argument("--prefill-chunk", type=positive_int, default=8192)
    parser.add_argument(
        "--acceptance", type=probability, default=None,
        help="random-weight models: accept each draft with this probability up to the first rejection (NOT exact). "
        "With draft_len 6, 0.93 accepts 78%% of drafts (tau 5.7), the paper's Qwen3-1.7B point at s=0.05 and what "
        "SmolLM2 reaches on real text; 0.8 accepts 49%% (tau 3.95)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--data", default=None,
                        help="MATH-style JSON or JSONL (records with 'problem' or 'question', and 'solution' or "
                        "'answer') for real models' prompts (default: the problems shipped in s3r_hf/data, which "
                        "long prompts repeat; the report says so)")
    parser.add_argument("--dataset", default=None, help="a `datasets` id to take the problems from (instead of --data)")
    parser.add_argument("--split", default="train", help="split of --dataset (%(default)s)")
    parser.add_argument("--skip-generate", action="store_true", help="do not time model.generate")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay single-token steps as CUDA graphs")
    parser.add_argument("--compile-layers", action="store_true",
                        help="torch.compile the decoder layers (S3RConfig.compile_layers); with --cuda-graphs the "
                        "compilation falls in prefill and graph captures, which are not timed")
    parser.add_argument("--fused-layers", action="store_true",
                        help="run decode-shaped forwards through the fused decoder-layer kernels "
                        "(S3RConfig.fused_layers; Llama-family models with a head dimension of 32 or more)")
    parser.add_argument("--draft-matmul-precision", choices=["high", "highest"], default="high",
                        help="float32 models on CUDA: the draft passes' matmuls on TF32 tensor cores (high) or in full "
                        "float32 (highest); S3RConfig.draft_matmul_precision (%(default)s)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="skip the short untimed AR and S3R calls that compile and autotune before each point")
    parser.add_argument("--stages", action="store_true",
                        help="also time each stage of a round (synchronizes between stages: slower, for profiling)")
    parser.add_argument("--json", help="write all results to this file")
    parser.add_argument("--plot", help="write a PNG of speedup against context length (--rollout: tokens/s per mode)")
    from s3r_hf.rollout_bench import add_rollout_arguments  # here, not at the top: rollout_bench imports this module

    add_rollout_arguments(parser)


def bench_from_args(args: argparse.Namespace) -> list[dict] | dict:
    from s3r_hf.demo import positive_int
    from s3r_hf.models import resolve_device
    from s3r_hf.rollout_bench import rollout_flags_given, rollout_from_args

    args.device = str(resolve_device(args.device))  # a clear error for a device this machine does not have
    check_output_path(args.json, "--json")  # before anything runs, not after it
    check_output_path(args.plot, "--plot")
    if args.plot:
        from s3r_hf.errors import require

        require("matplotlib", "bench", "--plot")
    if getattr(args, "rollout", False):
        return rollout_from_args(args)
    rollout_only = rollout_flags_given(args)
    if rollout_only:
        raise UsageError(f"{', '.join(rollout_only)} {'applies' if len(rollout_only) == 1 else 'apply'} to the rollout "
                         "benchmark only: add --rollout (the decode grid would ignore it)")
    args.batch = _sweep(args.batch if args.batch is not None else "16", "--batch", positive_int)
    args.seq = _sweep(args.seq, "--seq", positive_int)
    if args.requests is not None and args.requests < max(args.batch):
        raise UsageError(f"--requests ({args.requests}) must be at least the batch size ({max(args.batch)})")
    args.max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else 128
    if args.max_new_tokens < 2:  # the first new token comes from the prefill: one more is the first decode step
        raise UsageError(f"--max-new-tokens must be at least 2 for the decode grid, got {args.max_new_tokens}")
    if check_prompt_source(args.model or [DEFAULT_MODEL], args.data, args.dataset, args.acceptance):
        args.texts, args.prompt_source = load_texts(args.data, args.dataset, args.split)
    args.budget = _sweep(args.budget, "--budget", float)
    args.refresh_interval = _sweep(args.refresh_interval, "--refresh-interval", refresh_interval_arg)
    args.draft_weights = _sweep(args.draft_weights, "--draft-weights", str)
    for ratio, interval, weights in itertools.product(args.budget, args.refresh_interval, args.draft_weights):
        try:  # every setting of the sweep, before any model is built
            S3RConfig(draft_len=args.draft_len, min_budget=args.min_budget, budget_ratio=ratio,
                      refresh_interval=interval, draft_weights=weights, fused_layers=args.fused_layers)
        except ValueError as error:
            raise UsageError(str(error)) from error
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth() if args.device.startswith("cuda") else float("nan")
    points = []
    for name in args.model or [DEFAULT_MODEL]:
        model, tokenizer = build_model(name, dtype, args.device)
        enable(model)
        for batch in args.batch:
            for seq in args.seq:
                point = run_point(model, tokenizer, name, batch, seq, args, bandwidth)
                points.append(point)
                if args.device.startswith("cuda"):
                    torch.cuda.empty_cache()
        del model
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "copy_bandwidth_GBps": bandwidth / 1e9, "points": points}
    if args.json:
        write_results(args.json, result)
    if args.plot:
        plot(points, args.plot)
    return points


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_bench_arguments(parser)
    bench_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    main()

