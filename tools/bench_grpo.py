"""GRPO step time, rollout tokens/s and reward curves: S3R rollouts vs TRL's own generation paths.

Runs a few GRPO steps per rollout mode on the same model, prompts and seed, and reports per mode the step
time, the generation time, completion tokens per step, tokens/s and the reward of every step:

- `s3r`: `S3RGRPOTrainer` with S3R rollouts (exact sparse-draft / dense-verify speculative sampling);
- `engine-ar`: `S3RGRPOTrainer` with `s3r_rollout_mode="ar"`: the same engine, `--s3r-config` and kernels decoding
  densely, no drafting. Against `trl` it measures what the engine gains; `s3r` against it, what speculation adds;
- `trl`: TRL's default generation (`model.generate` on a left-padded batch);
- `trl-paged`: TRL's `use_transformers_continuous_batching=True` (transformers' paged continuous batching
  `generate_batch`; TRL's deprecated alias for it is `use_transformers_paged`).

    python tools/bench_grpo.py --max-steps 5 --per-device-batch 32 --num-generations 8 \\
        --max-completion-length 1024 --json grpo_bench.json --plot grpo_reward.png

`--preset long` asks for long responses (max completion 4,096 tokens, where a rollout's tail of a few long responses
weighs most); `--max-completion-length` overrides a preset.

Every mode runs in a child process of its own (`--in-process` to share one), so one mode's crash, CUDA state
or allocator cache never reaches the next; a failing mode is recorded with its error and the others go on.
`--max-seconds-per-mode` stops a mode gracefully before a step that would overrun it; `--mode-timeout` kills
a child outright and keeps the steps it finished (each child saves its records after every step).
Generation is timed around the trainer's `_generate_single_turn` (one call per step here); "warm" figures
leave out the first step, which pays for CUDA context, kernel compilation and allocator warm-up. Results
already saved with `--json` can be re-rendered (table, plot) with `--from-json PATH [PATH ...]`, which also
merges runs made one mode at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO_ROOT / "s3r_hf" / "data" / "rollout_prompts.json"
"""The 32 MATH-style problems (with answers) shipped in the package; pass `--dataset` for a real training set."""
MODES = ("s3r", "engine-ar", "trl", "trl-paged")
PRESETS = {"default": 1024, "long": 4096}
"""`--preset` name -> max completion length (tokens)."""
# (faster, baseline, what the ratio measures) for the speed-up lines under the table.
COMPARISONS = (
    ("engine-ar", "trl", "the engine's own gain"),
    ("s3r", "engine-ar", "what speculation adds to the engine"),
    ("s3r", "trl", "S3R over TRL's default"),
    ("s3r", "trl-paged", "S3R over TRL's continuous batching"),
)

# Per-step keys kept from `trainer.state.log_history` (TRL's and S3RGRPOTrainer's metric names) -> short names.
STEP_KEYS = {
    "step_time": "step_seconds",
    "bench/generate_seconds": "generate_seconds",
    "bench/completion_tokens": "completion_tokens",
    "bench/sequences": "sequences",
    "completions/mean_length": "mean_length",
    "completions/clipped_ratio": "clipped_ratio",
    "reward": "reward",
    "reward_std": "reward_std",
    "s3r/acceptance_rate": "acceptance_rate",
    "s3r/tau": "tau",
    "s3r/mean_acceptance_length": "mean_acceptance_length",
    "s3r/dense_steps": "dense_steps",
    "s3r/rollout_seconds": "s3r_rollout_seconds",
    "s3r/graph_capture_seconds": "graph_capture_seconds",
}


# ----------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="the embedded default (smollm2-135m-instruct), a local .gguf, a directory or a Hub id")
    parser.add_argument("--gguf", default=None,
                        help="a local .gguf file to load (same as --model PATH; the pinned SmolLM2 GGUF fills the "
                        "default model's cache, so no network is needed)")
    parser.add_argument("--dataset", default=str(DEFAULT_DATASET),
                        help="MATH .json, GSM8K .jsonl or a Hub id (default: the packaged problems)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N problems")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--per-device-batch", type=int, default=32,
                        help="sequences per step (prompts per step = this / --num-generations)")
    parser.add_argument("--preset", choices=list(PRESETS), default=None,
                        help="max completion length: " + ", ".join(f"{k} {v}" for k, v in PRESETS.items()))
    parser.add_argument("--max-completion-length", type=int, default=None,
                        help="tokens per completion (default: the --preset's, else 1024)")
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--s3r-config", default=None, help="S3RConfig fields as JSON, e.g. '{\"cuda_graphs\": true}'")
    parser.add_argument("--cb-config", default=None,
                        help="transformers ContinuousBatchingConfig fields as JSON for trl-paged "
                        "(TRL sets max_memory_percent=0.5 unless given)")
    parser.add_argument("--bf16", action="store_true",
                        help="TrainingArguments.bf16 (autocast training; fp32 master weights). Note: TRL's trl-paged "
                        "path then casts the policy to bf16 in place before generating")
    parser.add_argument("--model-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="dtype the policy is loaded in (all modes)")
    parser.add_argument("--max-seconds-per-mode", type=float, default=None,
                        help="time budget of one mode's training: after --min-steps steps, stop before a step "
                        "that would overrun it (judged by the last step's duration)")
    parser.add_argument("--min-steps", type=int, default=2, help="steps that run whatever the time budget says")
    parser.add_argument("--mode-timeout", type=float, default=None,
                        help="wall-clock limit of one mode's child process (start-up included); on expiry it is "
                        "killed and the steps it finished are kept")
    parser.add_argument("--in-process", action="store_true", help="run all modes in this process")
    parser.add_argument("--json", default=None, help="write all results here (rewritten after every mode)")
    parser.add_argument("--plot", default=None, help="write a PNG of reward per step for each mode (matplotlib)")
    parser.add_argument("--from-json", nargs="+", default=None,
                        help="render the table/plot of saved --json files (their results merged); run nothing")
    parser.add_argument("--output-dir", default=None, help="trainer output dir (default: a temporary directory)")
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        parser.error(f"--modes must be a comma-separated subset of {','.join(MODES)}; got {args.modes!r}")
    args.mode_list = modes
    if args.gguf is not None:
        if args.model is not None and args.model != args.gguf:
            parser.error("give the GGUF file with --gguf or --model, not both")
        args.model = args.gguf
    if args.per_device_batch % args.num_generations:
        parser.error("--per-device-batch must be a multiple of --num-generations")
    if args.max_completion_length is None:
        args.max_completion_length = PRESETS[args.preset or "default"]
    return args


# ----------------------------------------------------------------------------------------------------------
# One mode
# ----------------------------------------------------------------------------------------------------------


def check_site_packages() -> None:
    """Warn when pyarrow lies outside every `site-packages` directory (e.g. `pip install --target /root/site`).

    dill, which `datasets` uses to fingerprint every dataset, pickles a module by value unless it lives under
    `sys.prefix` or in a path containing `site-packages`; for pyarrow that fails at `Dataset.from_dict` with
    `PicklingError: Can't pickle <class 'MonthDayNano'>`.
    """
    import pyarrow

    location = os.path.realpath(pyarrow.__file__)
    prefixes = {os.path.realpath(getattr(sys, name)) for name in ("prefix", "base_prefix", "exec_prefix")}
    if "site-packages" not in location and not any(location.startswith(prefix) for prefix in prefixes):
        print(f"WARNING: pyarrow is imported from {location}, outside any site-packages directory: datasets' "
              "fingerprinting will fail (PicklingError ... MonthDayNano). Install the wheels with "
              "`pip install --target DIR/site-packages` and put that directory on PYTHONPATH.",
              file=sys.stderr, flush=True)


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _trainer_classes() -> tuple[type, type]:
    """`(TimedGRPOTrainer, StepCallback)`, defined lazily so the parent process never imports torch or TRL."""
    from transformers import TrainerCallback

    from trl_integration import S3RGRPOTrainer

    class TimedGRPOTrainer(S3RGRPOTrainer):
        """`S3RGRPOTrainer` that also logs the wall time and completion tokens of every rollout."""

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            _synchronize()
            started = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
            _synchronize()
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["bench/generate_seconds"].append(time.perf_counter() - started)
            metrics["bench/completion_tokens"].append(float(sum(len(ids) for ids in completion_ids)))
            metrics["bench/sequences"].append(float(len(completion_ids)))
            return completion_ids, logprobs

    class StepCallback(TrainerCallback):
        """Records and prints every logged step; stops before a step that would overrun the time budget.

        The first `min_steps` steps always run (the second is the first warm one); after that, training stops
        when the time spent plus the duration of the last step would exceed the budget. `on_record` receives
        each step's record as soon as it is logged (the child process saves partial results with it).
        """

        def __init__(self, mode: str, budget: float | None, min_steps: int,
                     on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
            self.mode, self.budget, self.min_steps, self.on_record = mode, budget, min_steps, on_record
            self.started = self.last_end = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = self.last_end = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            last_step, self.last_end = now - self.last_end, now
            if self.budget is None or state.global_step < self.min_steps or state.global_step >= state.max_steps:
                return
            if now - self.started + last_step > self.budget:
                print(f"[{self.mode}] stopping after step {state.global_step}: another step would overrun the "
                      f"{self.budget:.0f}s budget", flush=True)
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "step_time" not in logs:
                return
            parts = [f"[{self.mode}] step {state.global_step}", f"step {logs['step_time']:.2f}s"]
            if "bench/generate_seconds" in logs:
                parts.append(f"gen {logs['bench/generate_seconds']:.2f}s")
            if "bench/completion_tokens" in logs:
                parts.append(f"{logs['bench/completion_tokens']:.0f} tok")
            parts.append(f"reward {logs.get('reward', float('nan')):.3f}")
            if "s3r/tau" in logs:
                parts.append(f"tau {logs['s3r/tau']:.2f}")
            print("  ".join(parts), flush=True)
            if self.on_record is not None:
                self.on_record(step_record(state.global_step, logs))

    return TimedGRPOTrainer, StepCallback


def step_record(step: int, logs: dict[str, Any]) -> dict[str, Any]:
    """The kept metrics of one logged step, under their short names."""
    return {"step": step, **{short: logs[key] for key, short in STEP_KEYS.items() if key in logs}}


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Train `args.max_steps` GRPO steps with rollout `mode`; the summary and per-step records, or the error.

    With `--child-out`, the result so far (status "running") is also written there after every step, so a
    parent that has to kill this process on its timeout still gets the finished steps.
    """
    result: dict[str, Any] = {"mode": mode, "status": "ok", "steps": []}

    def record(row: dict[str, Any]) -> None:
        result["steps"].append(row)
        if args.child_out:
            _write_json(args.child_out, {**result, "status": "running", "summary": summarise(result["steps"])})

    try:
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        import torch
        import transformers
        import trl
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        from s3r_hf.models import DEFAULT_MODEL, load_model_and_tokenizer
        from trl_integration import S3RGRPOConfig
        from trl_integration.examples.grpo_math import accuracy_reward, load_math_dataset

        check_site_packages()
        result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                              "trl": trl.__version__}
        TimedGRPOTrainer, StepCallback = _trainer_classes()
        dtype = torch.bfloat16 if args.model_dtype == "bfloat16" else torch.float32
        started = time.perf_counter()
        model, tokenizer = load_model_and_tokenizer(args.model or DEFAULT_MODEL, dtype=dtype)
        result["load_seconds"] = time.perf_counter() - started
        on_cuda = model.device.type == "cuda"
        result["device"] = torch.cuda.get_device_name(model.device) if on_cuda else "cpu"
        extra: dict[str, Any] = {}
        if mode == "trl-paged":
            extra["use_transformers_continuous_batching"] = True
            if args.cb_config:
                extra["transformers_continuous_batching_config"] = json.loads(args.cb_config)
        with tempfile.TemporaryDirectory(prefix="bench-grpo-") as scratch:
            config = S3RGRPOConfig(
                output_dir=args.output_dir or scratch, use_s3r=mode in ("s3r", "engine-ar"),
                s3r_rollout_mode="ar" if mode == "engine-ar" else "s3r", s3r_config=args.s3r_config,
                max_steps=args.max_steps, num_generations=args.num_generations,
                per_device_train_batch_size=args.per_device_batch, max_completion_length=args.max_completion_length,
                learning_rate=args.learning_rate, bf16=args.bf16, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=not on_cuda, temperature=1.0, seed=args.seed, disable_tqdm=True, **extra,
            )
            trainer = TimedGRPOTrainer(
                model=model, reward_funcs=accuracy_reward, args=config,
                train_dataset=load_math_dataset(args.dataset, args.limit), processing_class=tokenizer,
            )
            for noisy in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(noisy)
            trainer.add_callback(StepCallback(mode, args.max_seconds_per_mode, args.min_steps, record))
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
            _synchronize()
            started = time.perf_counter()
            trainer.train()
            _synchronize()
            result["train_seconds"] = time.perf_counter() - started
            if on_cuda:
                result["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
            result["steps"] = [step_record(e["step"], e) for e in trainer.state.log_history if "step_time" in e]
            del trainer, model
    except Exception as error:  # a failing mode is a result; the other modes still run
        result["status"] = "failed"
        result["error"] = f"{type(error).__name__}: {error}"
        trace = traceback.format_exc()
        result["traceback"] = trace if len(trace) <= 6000 else f"{trace[:3000]}\n...\n{trace[-3000:]}"
        print(f"[{mode}] FAILED: {result['error']}", file=sys.stderr, flush=True)
        print(result["traceback"], file=sys.stderr, flush=True)
    if result.get("steps"):
        result["summary"] = summarise(result["steps"])
    return result


def run_child(args: argparse.Namespace, argv: list[str], mode: str) -> dict[str, Any]:
    """`run_mode` in a fresh Python process (same arguments, one mode); its result comes back through a file."""
    with tempfile.TemporaryDirectory(prefix="bench-grpo-child-") as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--modes", mode, "--child-out", str(out)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        try:
            code = subprocess.run(command, env=env, timeout=args.mode_timeout).returncode
            problem = f"child process exited with code {code}"
        except subprocess.TimeoutExpired:  # `run` has killed the child; keep the steps it finished
            problem = f"killed after --mode-timeout {args.mode_timeout:.0f}s"
            print(f"[{mode}] {problem}", flush=True)
        result = json.loads(out.read_text()) if out.is_file() else None
    if result is None:
        return {"mode": mode, "status": "failed", "error": f"{problem} and wrote no result"}
    if result["status"] == "running":
        result["status"] = f"partial: {problem}"
        result["error"] = problem
    return result


# ----------------------------------------------------------------------------------------------------------
# Summaries, table, plot
# ----------------------------------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarise(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Means over all steps and over the warm ones (all but the first, when there are two or more)."""
    warm = steps[1:] if len(steps) > 1 else steps

    def column(rows: list[dict[str, Any]], key: str) -> list[float]:
        return [row[key] for row in rows if key in row]

    summary = {
        "steps": len(steps),
        "step_seconds_mean": _mean(column(steps, "step_seconds")),
        "step_seconds_warm": _mean(column(warm, "step_seconds")),
        "generate_seconds_warm": _mean(column(warm, "generate_seconds")),
        "completion_tokens_per_step": _mean(column(steps, "completion_tokens")),
        "mean_length": _mean(column(steps, "mean_length")),
        "clipped_ratio": _mean(column(steps, "clipped_ratio")),
        "reward_mean": _mean(column(steps, "reward")),
        "acceptance_rate": _mean(column(steps, "acceptance_rate")),
        "tau": _mean(column(steps, "tau")),
    }
    tokens = sum(column(warm, "completion_tokens"))
    generate, step = sum(column(warm, "generate_seconds")), sum(column(warm, "step_seconds"))
    summary["generate_tokens_per_second_warm"] = tokens / generate if generate else math.nan
    summary["step_tokens_per_second_warm"] = tokens / step if step else math.nan
    return summary


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per mode, plus S3R's speed-ups over each TRL mode when both ran."""
    header = ["mode", "status", "steps", "train s", "step s (warm)", "gen s/step (warm)", "tokens/step",
              "mean len", "clipped", "gen tok/s (warm)", "step tok/s (warm)", "reward (mean)", "accept", "tau",
              "peak GiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        s = result.get("summary", {})
        status = result["status"]
        if status != "ok":
            status = f"{status.split(':')[0]}: {result.get('error', '')[:80]}"
        row = [result["mode"], status.replace("|", "/").replace("\n", " "), _fmt(s.get("steps")),
               _fmt(result.get("train_seconds"), 1), _fmt(s.get("step_seconds_warm")),
               _fmt(s.get("generate_seconds_warm")), _fmt(s.get("completion_tokens_per_step"), 0),
               _fmt(s.get("mean_length"), 1), _fmt(s.get("clipped_ratio")),
               _fmt(s.get("generate_tokens_per_second_warm"), 0), _fmt(s.get("step_tokens_per_second_warm"), 0),
               _fmt(s.get("reward_mean"), 3), _fmt(s.get("acceptance_rate")), _fmt(s.get("tau")),
               _fmt(result.get("peak_gpu_gib"))]
        lines.append("| " + " | ".join(row) + " |")
    by_mode = {r["mode"]: r["summary"] for r in results if r.get("summary")}
    for faster, base, meaning in COMPARISONS:
        if faster not in by_mode or base not in by_mode:
            continue
        ratios = []
        for key in ("generate_tokens_per_second_warm", "step_tokens_per_second_warm"):
            ratios.append(by_mode[base][key] and by_mode[faster][key] / by_mode[base][key])
        lines.append(f"\n{faster} vs {base} ({meaning}; warm steps, tokens/s): generation x{_fmt(ratios[0])}, "
                     f"whole step x{_fmt(ratios[1])}")
    return "\n".join(lines)


def reward_table(results: list[dict[str, Any]]) -> str:
    """Reward per step, one column per mode (the reward curves as numbers)."""
    ok = [r for r in results if r.get("steps")]
    if not ok:
        return ""
    steps = sorted({row["step"] for r in ok for row in r["steps"]})
    lines = ["| step | " + " | ".join(r["mode"] for r in ok) + " |", "|" + "---|" * (len(ok) + 1)]
    for step in steps:
        cells = []
        for r in ok:
            row = next((row for row in r["steps"] if row["step"] == step), {})
            cells.append(_fmt(row.get("reward"), 3))
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_rewards(results: list[dict[str, Any]], path: str) -> None:
    """Reward (and its mean over the steps so far) against step, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written. Re-render later with --from-json ... --plot {path}")
        return
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for result in results:
        rows = [row for row in result.get("steps", []) if "reward" in row]
        if not rows:
            continue
        steps = [row["step"] for row in rows]
        rewards = [row["reward"] for row in rows]
        running = [sum(rewards[: i + 1]) / (i + 1) for i in range(len(rewards))]
        (line,) = axis.plot(steps, rewards, marker="o", alpha=0.6, label=f"{result['mode']} (per step)")
        axis.plot(steps, running, linestyle="--", color=line.get_color(), label=f"{result['mode']} (running mean)")
    axis.set_xlabel("GRPO step")
    axis.set_ylabel("mean accuracy reward")
    axis.set_title("GRPO reward: S3R vs dense rollouts")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def _write_json(path: str, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=float) + "\n")


def report(payload: dict[str, Any], plot: str | None) -> None:
    print("\n" + markdown_table(payload["results"]))
    rewards = reward_table(payload["results"])
    if rewards:
        print("\nReward per step:\n\n" + rewards)
    if plot:
        plot_rewards(payload["results"], plot)


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------


def _child_argv(argv: list[str]) -> list[str]:
    """The command line minus the options that only the parent acts on (--modes, --json, --plot)."""
    drop, kept, skip = {"--modes", "--json", "--plot", "--in-process"}, [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in drop:
            skip = "=" not in item and name != "--in-process"
            continue
        kept.append(item)
    return kept


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub from every trainer otherwise
    if args.from_json:
        payload = {"results": [r for path in args.from_json for r in json.loads(Path(path).read_text())["results"]]}
        report(payload, args.plot)
        return payload["results"]
    if args.child_out:
        _write_json(args.child_out, run_mode(args, args.mode_list[0]))
        return []
    settings = {key: value for key, value in vars(args).items() if key not in {"child_out", "from_json", "mode_list"}}
    payload: dict[str, Any] = {"settings": settings, "results": []}
    for mode in args.mode_list:
        print(f"\n=== {mode} ===", flush=True)
        result = run_mode(args, mode) if args.in_process else run_child(args, _child_argv(argv), mode)
        payload["results"].append(result)
        if args.json:
            _write_json(args.json, payload)
    report(payload, args.plot)
    return payload["results"]


if __name__ == "__main__":
    main()
