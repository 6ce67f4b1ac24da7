"""GRPO step time, rollout tokens/s and reward curves: S3R rollouts vs TRL's own generation paths.

Runs a few GRPO steps per rollout mode on the same model, prompts and seed, and reports per mode the step
time, the generation time, completion tokens per step, tokens/s and the reward of every step:

- `s3r`: `S3RGRPOTrainer` with S3R rollouts (exact sparse-draft / dense-verify speculative sampling);
- `engine-ar`: `S3RGRPOTrainer` with `s3r_rollout_mode="ar"`: the same engine, `--s3r-config` and kernels decoding
  densely, no drafting. Against `trl` it measures what the engine gains; `s3r` against it, what speculation adds;
- `s3r-paired`: `s3r` training, and every step also generates the same prompts from the same weights with the engine's
  dense decoding (its completions are discarded; the two calls take turns going first). Two separate runs train
  apart after their first step, and their response lengths with them; this compares the two rollouts of each step;
- `trl`: TRL's default generation (`model.generate` on a left-padded batch);
- `trl-paged`: TRL's `use_transformers_continuous_batching=True` (transformers' paged continuous batching
  `generate_batch`; TRL's deprecated alias for it is `use_transformers_paged`).

    python tools/bench_grpo.py --max-steps 5 --per-device-batch 32 --num-generations 8 \\
        --max-completion-length 1024 --json grpo_bench.json --plot grpo_reward.png

Training curves (do S3R rollouts train as dense ones do?): `--dataset arithmetic` trains on short arithmetic
problems generated on the fly (`trl_integration/examples/arithmetic.py`, graded by math-verify), small enough for
SmolLM2-135M to improve on within a few hundred steps; `--seeds 1,2` runs every mode once per seed, so the
spread between a mode's seeds shows run-to-run noise; `--devices 0,1,2,3` runs that many at once, each child on
its own GPU. `--plot` draws reward and mean completion length per step side by side, one line per mode and seed:

    python tools/bench_grpo.py --dataset arithmetic --modes s3r,trl --seeds 1,2 --max-steps 200 \\
        --max-completion-length 64 --learning-rate 1e-5 --json curves.json --plot curves.png

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
import gc
import json
import logging
import math
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO_ROOT / "s3r_hf" / "data" / "rollout_prompts.json"
"""The 32 MATH-style problems (with answers) shipped in the package; pass `--dataset` for a real training set."""
ARITHMETIC = "arithmetic"
"""`--dataset` value for the generated arithmetic problems (`--arithmetic-size`, `--arithmetic-seed`)."""
MODES = ("s3r", "engine-ar", "trl", "trl-paged", "s3r-paired")
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
    "bench/gc_seconds": "gc_seconds",
    "bench/sequences": "sequences",
    "bench/paired_ar_generate_seconds": "paired_ar_generate_seconds",
    "bench/paired_ar_completion_tokens": "paired_ar_completion_tokens",
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
    "s3r/compiled_graphs": "compiled_graphs",
    "s3r/compile_seconds": "compile_seconds",
    "s3r/kernel_variants": "kernel_variants",
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
                        help=f"MATH .json, GSM8K .jsonl, a Hub id, or {ARITHMETIC!r}: short sums, differences and "
                        "products generated on the fly (default: the packaged problems)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N problems (file or Hub id)")
    parser.add_argument("--arithmetic-size", type=int, default=4096, help=f"problems of --dataset {ARITHMETIC}")
    parser.add_argument("--arithmetic-seed", type=int, default=0,
                        help=f"seed of the --dataset {ARITHMETIC} problems (kept apart from --seed, so every run "
                        "trains on the same problems)")
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
    parser.add_argument("--seeds", default=None,
                        help="comma-separated training seeds: every mode runs once per seed (default: --seed)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated CUDA device indices: run that many (mode, seed) runs at once, each "
                        "child process on one of these GPUs (CUDA_VISIBLE_DEVICES); default one run at a time")
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
    parser.add_argument("--log-engine", action="store_true",
                        help="log s3r-hf's engine at info level (graph captures and compiles, Triton variants built) "
                        "and torch.compile's recompilations with the guard that failed")
    parser.add_argument("--json", default=None, help="write all results here (rewritten after every mode)")
    parser.add_argument("--plot", default=None,
                        help="write a PNG of reward and mean completion length per step, side by side, one line per "
                        "mode and seed (matplotlib, the [bench] extra)")
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
    try:
        args.seed_list = _int_list(args.seeds) if args.seeds is not None else [args.seed]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers; got {args.seeds!r}")
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        parser.error(f"--seeds must list distinct seeds; got {args.seeds!r}")
    try:
        args.device_list = [str(index) for index in _int_list(args.devices)] if args.devices else []
    except ValueError:
        parser.error(f"--devices must be comma-separated CUDA device indices; got {args.devices!r}")
    if args.device_list and args.in_process:
        parser.error("--devices runs child processes; it cannot be combined with --in-process")
    if args.dataset == ARITHMETIC and args.limit is not None:
        parser.error(f"--limit applies to problem files and Hub ids; size --dataset {ARITHMETIC} with "
                     "--arithmetic-size")
    if args.gguf is not None:
        if args.model is not None and args.model != args.gguf:
            parser.error("give the GGUF file with --gguf or --model, not both")
        args.model = args.gguf
    if args.per_device_batch % args.num_generations:
        parser.error("--per-device-batch must be a multiple of --num-generations")
    if args.max_completion_length is None:
        args.max_completion_length = PRESETS[args.preset or "default"]
    return args


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


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


def _timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """`(seconds, result)` of `call`, the device synchronized before and after."""
    _synchronize()
    started = time.perf_counter()
    result = call()
    _synchronize()
    return time.perf_counter() - started, result


def _trainer_classes() -> tuple[type, type]:
    """`(TimedGRPOTrainer, StepCallback)`, defined lazily so the parent process never imports torch or TRL."""
    from transformers import TrainerCallback

    from trl_integration import S3RGRPOTrainer

    class TimedGRPOTrainer(S3RGRPOTrainer):
        """`S3RGRPOTrainer` that also logs the wall time and completion tokens of every rollout; with `paired` set,
        also those of the engine's dense decoding of the same prompts from the same weights (`s3r-paired`)."""

        paired = False

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            metrics = self._metrics["train" if self.model.training else "eval"]
            arguments = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            dense_first = self.paired and self.state.global_step % 2 == 1
            if dense_first:
                self._paired_dense_rollout(metrics, arguments)
            seconds, (completion_ids, logprobs) = _timed(lambda: super(TimedGRPOTrainer, self)._generate_single_turn(
                *arguments))
            metrics["bench/generate_seconds"].append(seconds)
            metrics["bench/completion_tokens"].append(float(sum(len(ids) for ids in completion_ids)))
            metrics["bench/sequences"].append(float(len(completion_ids)))
            if self.paired and not dense_first:
                self._paired_dense_rollout(metrics, arguments)
            return completion_ids, logprobs

        def _paired_dense_rollout(self, metrics, arguments) -> None:
            """The engine's dense decoding of this step's prompts, timed; its completions and its S3R metrics are
            dropped, so the step trains on, and logs, the S3R rollout alone."""
            kept = {key: len(values) for key, values in metrics.items()}
            self.args.s3r_rollout_mode = "ar"
            try:
                seconds, (completion_ids, _) = _timed(lambda: super(TimedGRPOTrainer, self)._generate_single_turn(
                    *arguments))
            finally:
                self.args.s3r_rollout_mode = "s3r"
            for key, values in metrics.items():
                del values[kept.get(key, 0):]
            metrics["bench/paired_ar_generate_seconds"].append(seconds)
            metrics["bench/paired_ar_completion_tokens"].append(float(sum(len(ids) for ids in completion_ids)))

    class StepCallback(TrainerCallback):
        """Records and prints every logged step; stops before a step that would overrun the time budget.

        The first `min_steps` steps always run (the second is the first warm one); after that, training stops
        when the time spent plus the duration of the last step would exceed the budget. `on_record` receives
        each step's record as soon as it is logged (the child process saves partial results with it). Each
        step also records the seconds Python's cyclic garbage collector ran in it (`bench/gc_seconds`): a full
        collection in a process holding a model, a tokenizer and a dataset is one source of step-to-step spread.
        """

        def __init__(self, mode: str, budget: float | None, min_steps: int,
                     on_record: Callable[[dict[str, Any]], None] | None = None) -> None:
            self.mode, self.budget, self.min_steps, self.on_record = mode, budget, min_steps, on_record
            self.started = self.last_end = time.perf_counter()
            self.gc_seconds, self._gc_started = 0.0, None
            gc.callbacks.append(self._time_collection)

        def _time_collection(self, phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_started = time.perf_counter()
            elif self._gc_started is not None:
                self.gc_seconds += time.perf_counter() - self._gc_started
                self._gc_started = None

        def on_train_end(self, args, state, control, **kwargs):
            if self._time_collection in gc.callbacks:
                gc.callbacks.remove(self._time_collection)

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
            if state.log_history and state.log_history[-1].get("step_time") == logs["step_time"]:
                logs = state.log_history[-1]  # what the run's records are read from at its end
            logs["bench/gc_seconds"], self.gc_seconds = self.gc_seconds, 0.0
            parts = [f"[{self.mode}] step {state.global_step}", f"step {logs['step_time']:.2f}s"]
            if "bench/generate_seconds" in logs:
                parts.append(f"gen {logs['bench/generate_seconds']:.2f}s")
                parts.append(f"rest {logs['step_time'] - logs['bench/generate_seconds']:.2f}s")
            parts.append(f"gc {logs['bench/gc_seconds']:.2f}s")
            if "bench/completion_tokens" in logs:
                parts.append(f"{logs['bench/completion_tokens']:.0f} tok")
            parts.append(f"reward {logs.get('reward', float('nan')):.3f}")
            if "s3r/tau" in logs:
                parts.append(f"tau {logs['s3r/tau']:.2f}")
            if logs.get("s3r/compiled_graphs"):
                parts.append(f"compiled {logs['s3r/compiled_graphs']:.0f} graphs in {logs['s3r/compile_seconds']:.1f}s")
            if logs.get("s3r/kernel_variants"):
                parts.append(f"{logs['s3r/kernel_variants']:.0f} new kernel variants")
            print("  ".join(parts), flush=True)
            if self.on_record is not None:
                self.on_record(step_record(state.global_step, logs))

    return TimedGRPOTrainer, StepCallback


def step_record(step: int, logs: dict[str, Any]) -> dict[str, Any]:
    """The kept metrics of one logged step, under their short names."""
    return {"step": step, **{short: logs[key] for key, short in STEP_KEYS.items() if key in logs}}


def _put_repo_on_path() -> None:
    """Makes `s3r_hf` and `trl_integration` importable from a checkout that is not installed."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def load_training_dataset(args: argparse.Namespace):
    """The prompts and answers `--dataset` names: generated arithmetic problems, or a problem file or Hub id."""
    if args.dataset == ARITHMETIC:
        from trl_integration.examples.arithmetic import load_arithmetic_dataset

        return load_arithmetic_dataset(args.arithmetic_size, args.arithmetic_seed)
    from trl_integration.examples.grpo_math import load_math_dataset

    return load_math_dataset(args.dataset, args.limit)


def run_mode(args: argparse.Namespace, mode: str, seed: int) -> dict[str, Any]:
    """Train `args.max_steps` GRPO steps with rollout `mode` and training `seed`; the summary and per-step
    records, or the error.

    With `--child-out`, the result so far (status "running") is also written there after every step, so a
    parent that has to kill this process on its timeout still gets the finished steps.
    """
    result: dict[str, Any] = {"mode": mode, "seed": seed, "status": "ok", "steps": []}

    def record(row: dict[str, Any]) -> None:
        result["steps"].append(row)
        if args.child_out:
            _write_json(args.child_out, {**result, "status": "running", "summary": summarise(result["steps"])})

    try:
        _put_repo_on_path()
        import torch
        import transformers
        import trl
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        from s3r_hf.models import DEFAULT_MODEL, load_model_and_tokenizer
        from trl_integration import S3RGRPOConfig
        from trl_integration.examples.grpo_math import accuracy_reward

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
                output_dir=args.output_dir or scratch, use_s3r=mode in ("s3r", "engine-ar", "s3r-paired"),
                s3r_rollout_mode="ar" if mode == "engine-ar" else "s3r", s3r_config=args.s3r_config,
                max_steps=args.max_steps, num_generations=args.num_generations,
                per_device_train_batch_size=args.per_device_batch, max_completion_length=args.max_completion_length,
                learning_rate=args.learning_rate, bf16=args.bf16, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=not on_cuda, temperature=1.0, seed=seed, disable_tqdm=True, **extra,
            )
            trainer = TimedGRPOTrainer(
                model=model, reward_funcs=accuracy_reward, args=config,
                train_dataset=load_training_dataset(args), processing_class=tokenizer,
            )
            trainer.paired = mode == "s3r-paired"
            for noisy in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(noisy)
            trainer.add_callback(StepCallback(run_name(mode, seed), args.max_seconds_per_mode, args.min_steps,
                                              record))
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
            s3r_config = config.resolved_s3r_config()
            # What the draft-length rule measured per bucket, over all steps.
            if mode in ("s3r", "s3r-paired") and s3r_config.adaptive:
                from s3r_hf.runtime_state import adaptive_policy

                result["draft_policy"] = adaptive_policy(model, s3r_config).report()
            del trainer, model
    except Exception as error:  # a failing mode is a result; the other modes still run
        result["status"] = "failed"
        result["error"] = f"{type(error).__name__}: {error}"
        trace = traceback.format_exc()
        result["traceback"] = trace if len(trace) <= 6000 else f"{trace[:3000]}\n...\n{trace[-3000:]}"
        print(f"[{run_name(mode, seed)}] FAILED: {result['error']}", file=sys.stderr, flush=True)
        print(result["traceback"], file=sys.stderr, flush=True)
    if result.get("steps"):
        result["summary"] = summarise(result["steps"])
    return result


def run_name(mode: str, seed: int) -> str:
    """How logs name a run (with its seed: runs of one mode may print at the same time)."""
    return f"{mode} seed {seed}"


def run_child(args: argparse.Namespace, argv: list[str], mode: str, seed: int,
              device: str | None = None) -> dict[str, Any]:
    """`run_mode` in a fresh Python process (same arguments, one mode and seed, on CUDA `device` when given); its
    result comes back through a file."""
    with tempfile.TemporaryDirectory(prefix="bench-grpo-child-") as scratch:
        out = Path(scratch) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), *argv, "--modes", mode, "--seed", str(seed),
                   "--child-out", str(out)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        try:
            code = subprocess.run(command, env=env, timeout=args.mode_timeout).returncode
            problem = f"child process exited with code {code}"
        except subprocess.TimeoutExpired:  # `run` has killed the child; keep the steps it finished
            problem = f"killed after --mode-timeout {args.mode_timeout:.0f}s"
            print(f"[{run_name(mode, seed)}] {problem}", flush=True)
        result = json.loads(out.read_text()) if out.is_file() else None
    if result is None:
        return {"mode": mode, "seed": seed, "status": "failed", "error": f"{problem} and wrote no result"}
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
    """Means over all steps, over the warm ones (all but the first, when there are two or more) and, for the
    curves, over the last quarter of the steps (where a run has got to: compare it across modes and seeds)."""
    warm = steps[1:] if len(steps) > 1 else steps
    last_quarter = steps[-max(1, len(steps) // 4):]

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
        "reward_last_quarter": _mean(column(last_quarter, "reward")),
        "mean_length_last_quarter": _mean(column(last_quarter, "mean_length")),
        "acceptance_rate": _mean(column(steps, "acceptance_rate")),
        "tau": _mean(column(steps, "tau")),
    }
    # Steady state from the second step on: each warm step against the median warm step, in seconds and in seconds
    # per completion token (sampled lengths move a step's time as much as compilation does).
    timed = [row for row in warm if "step_seconds" in row and row.get("completion_tokens")]
    for name, values in (("step", [row["step_seconds"] for row in timed]),
                         ("step_per_token", [row["step_seconds"] / row["completion_tokens"] for row in timed])):
        if len(values) >= 2:
            median = sorted(values)[len(values) // 2]
            summary[f"warm_{name}_worst_over_median"] = max(values) / median - 1
            summary[f"warm_{name}_best_under_median"] = 1 - min(values) / median
    tokens = sum(column(warm, "completion_tokens"))
    generate, step = sum(column(warm, "generate_seconds")), sum(column(warm, "step_seconds"))
    summary["generate_tokens_per_second_warm"] = tokens / generate if generate else math.nan
    summary["step_tokens_per_second_warm"] = tokens / step if step else math.nan
    summary.update(_paired_summary(warm))
    return summary


def _paired_summary(warm: list[dict[str, Any]]) -> dict[str, float]:
    """S3R over the engine's dense decoding on the same steps (`s3r-paired`), by seconds and by tokens/s, for the
    generation and for the whole step (a step with one rollout: the logged step less the other mode's rollout)."""
    paired = [row for row in warm if "paired_ar_generate_seconds" in row and "generate_seconds" in row]
    if not paired:
        return {}
    s3r_tokens = sum(row["completion_tokens"] for row in paired)
    ar_tokens = sum(row["paired_ar_completion_tokens"] for row in paired)
    s3r_generate = sum(row["generate_seconds"] for row in paired)
    ar_generate = sum(row["paired_ar_generate_seconds"] for row in paired)
    s3r_step = sum(row["step_seconds"] - row["paired_ar_generate_seconds"] for row in paired)
    ar_step = sum(row["step_seconds"] - row["generate_seconds"] for row in paired)
    return {
        "paired_steps": len(paired),
        "paired_s3r_tokens": s3r_tokens,
        "paired_ar_tokens": ar_tokens,
        "paired_generate_by_seconds": ar_generate / s3r_generate,
        "paired_generate_by_tokens_per_second": (s3r_tokens / s3r_generate) / (ar_tokens / ar_generate),
        "paired_step_by_seconds": ar_step / s3r_step,
        "paired_step_by_tokens_per_second": (s3r_tokens / s3r_step) / (ar_tokens / ar_step),
    }


def run_labels(results: list[dict[str, Any]]) -> list[str]:
    """A name per result: its mode, with its seed when the results hold more than one seed."""
    several_seeds = len({result.get("seed") for result in results}) > 1
    return [f"{r['mode']} seed {r.get('seed')}" if several_seeds else r["mode"] for r in results]


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def markdown_table(results: list[dict[str, Any]]) -> str:
    """One row per run (mode and seed), plus S3R's speed-ups over each TRL mode when both ran (means over seeds)."""
    header = ["run", "status", "steps", "train s", "step s (warm)", "gen s/step (warm)", "tokens/step",
              "mean len", "clipped", "gen tok/s (warm)", "step tok/s (warm)", "reward (mean)", "reward (last 1/4)",
              "len (last 1/4)", "accept", "tau", "peak GiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result, label in zip(results, run_labels(results)):
        s = result.get("summary", {})
        status = result["status"]
        if status != "ok":
            status = f"{status.split(':')[0]}: {result.get('error', '')[:80]}"
        row = [label, status.replace("|", "/").replace("\n", " "), _fmt(s.get("steps")),
               _fmt(result.get("train_seconds"), 1), _fmt(s.get("step_seconds_warm")),
               _fmt(s.get("generate_seconds_warm")), _fmt(s.get("completion_tokens_per_step"), 0),
               _fmt(s.get("mean_length"), 1), _fmt(s.get("clipped_ratio")),
               _fmt(s.get("generate_tokens_per_second_warm"), 0), _fmt(s.get("step_tokens_per_second_warm"), 0),
               _fmt(s.get("reward_mean"), 3), _fmt(s.get("reward_last_quarter"), 3),
               _fmt(s.get("mean_length_last_quarter"), 1), _fmt(s.get("acceptance_rate")), _fmt(s.get("tau")),
               _fmt(result.get("peak_gpu_gib"))]
        lines.append("| " + " | ".join(row) + " |")
    for faster, base, meaning in COMPARISONS:
        ratios = [_mode_ratio(results, faster, base, key)
                  for key in ("generate_tokens_per_second_warm", "step_tokens_per_second_warm")]
        if all(math.isnan(ratio) for ratio in ratios):
            continue  # one of the two modes did not run
        lines.append(f"\n{faster} vs {base} ({meaning}; warm steps, tokens/s): generation x{_fmt(ratios[0])}, "
                     f"whole step x{_fmt(ratios[1])}")
        # Where the longest responses reach the cap every step lasts as many engine steps whatever the others
        # drew, so seconds per step compare the modes more steadily than tokens per second.
        by_time = [_mode_ratio(results, base, faster, key) for key in ("generate_seconds_warm", "step_seconds_warm")]
        lines.append(f"{faster} vs {base} (seconds per warm step): generation x{_fmt(by_time[0])}, "
                     f"whole step x{_fmt(by_time[1])}")
    for result, label in zip(results, run_labels(results)):
        s = result.get("summary", {})
        if "paired_steps" in s:
            lines.append(
                f"\n{label}: S3R vs engine AR on the same weights and prompts ({s['paired_steps']} warm steps, "
                f"{s['paired_s3r_tokens']:,.0f} vs {s['paired_ar_tokens']:,.0f} tokens): generation "
                f"x{_fmt(s['paired_generate_by_seconds'])} by seconds, "
                f"x{_fmt(s['paired_generate_by_tokens_per_second'])} by tokens/s; whole step "
                f"x{_fmt(s['paired_step_by_seconds'])} by seconds, "
                f"x{_fmt(s['paired_step_by_tokens_per_second'])} by tokens/s"
            )
        if "warm_step_worst_over_median" in s:
            lines.append(
                f"\n{label}: warm steps within +{s['warm_step_worst_over_median']:.0%} / "
                f"-{s['warm_step_best_under_median']:.0%} of their median step time; per completion token "
                f"+{s['warm_step_per_token_worst_over_median']:.0%} / -{s['warm_step_per_token_best_under_median']:.0%}"
            )
    return "\n".join(lines)


def _mode_ratio(results: list[dict[str, Any]], over: str, under: str, key: str) -> float:
    """`over`'s mean of summary `key` divided by `under`'s (NaN when either did not run or `under`'s is zero)."""
    numerator, denominator = _mode_mean(results, over, key), _mode_mean(results, under, key)
    return numerator / denominator if denominator else math.nan


def _mode_mean(results: list[dict[str, Any]], mode: str, key: str) -> float:
    """The mean of summary `key` over the seeds that `mode` ran with (NaN when it did not run)."""
    return _mean([r["summary"][key] for r in results if r["mode"] == mode and r.get("summary")])


def curve_table(results: list[dict[str, Any]], max_rows: int = 40) -> str:
    """Reward and mean completion length per step, one column per run (the curves as numbers); long runs show
    every n-th step, so the table stays within `max_rows` rows."""
    ran = [(r, label) for r, label in zip(results, run_labels(results)) if r.get("steps")]
    if not ran:
        return ""
    steps = sorted({row["step"] for r, _ in ran for row in r["steps"]})
    stride = math.ceil(len(steps) / max_rows)
    shown = steps[::stride] if steps[-1] in steps[::stride] else [*steps[::stride], steps[-1]]
    lines = ["| step | " + " | ".join(f"{label}: reward / len" for _, label in ran) + " |",
             "|" + "---|" * (len(ran) + 1)]
    for step in shown:
        cells = []
        for r, _ in ran:
            row = next((row for row in r["steps"] if row["step"] == step), {})
            cells.append(f"{_fmt(row.get('reward'), 3)} / {_fmt(row.get('mean_length'), 1)}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MODE_COLORS = {"s3r": "tab:red", "engine-ar": "tab:purple", "trl": "tab:blue", "trl-paged": "tab:green"}
SEED_LINESTYLES = ("-", "--", ":", "-.")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; a missing matplotlib names the [bench] extra."""
    _put_repo_on_path()
    from s3r_hf.errors import require

    require("matplotlib", "bench", "--plot").use("Agg")
    return require("matplotlib.pyplot", "bench", "--plot")


def trailing_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start)."""
    return [_mean(values[max(0, i + 1 - window): i + 1]) for i in range(len(values))]


def plot_curves(results: list[dict[str, Any]], path: str) -> None:
    """Reward and mean completion length per step, side by side: one colour per mode, one line style per seed.

    Each step's value is drawn faint and its trailing mean over ~5% of the steps solid: a step's reward is the
    mean of one batch, noisy enough to hide a trend, and the mean keeps the curves' ends comparable.
    """
    plt = pyplot()
    figure, (reward_axis, length_axis) = plt.subplots(1, 2, figsize=(13, 4.8))
    longest = max((len(r.get("steps", [])) for r in results), default=0)
    window = max(1, longest // 20)
    seeds_of: dict[str, list[Any]] = {}
    for result in results:
        seeds_of.setdefault(result["mode"], []).append(result.get("seed"))
    for result, label in zip(results, run_labels(results)):
        color = MODE_COLORS.get(result["mode"])
        style = SEED_LINESTYLES[seeds_of[result["mode"]].index(result.get("seed")) % len(SEED_LINESTYLES)]
        for axis, key in ((reward_axis, "reward"), (length_axis, "mean_length")):
            rows = [row for row in result.get("steps", []) if key in row]
            if not rows:
                continue
            steps, values = [row["step"] for row in rows], [row[key] for row in rows]
            axis.plot(steps, values, color=color, linestyle=style, linewidth=0.7, alpha=0.25)
            axis.plot(steps, trailing_mean(values, window), color=color, linestyle=style, linewidth=1.6, label=label)
    smoothing = f" (faint: per step; solid: mean of the last {window})" if window > 1 else ""
    reward_axis.set_title("reward" + smoothing, fontsize=10)
    reward_axis.set_ylabel("mean accuracy reward")
    length_axis.set_title("completion length" + smoothing, fontsize=10)
    length_axis.set_ylabel("mean completion length (tokens)")
    for axis in (reward_axis, length_axis):
        axis.set_xlabel("GRPO step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("GRPO: S3R rollouts vs dense generation")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def _write_json(path: str, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=float) + "\n")


def report(payload: dict[str, Any], plot: str | None) -> None:
    print("\n" + markdown_table(payload["results"]))
    curves = curve_table(payload["results"])
    if curves:
        print("\nReward and mean completion length per step:\n\n" + curves)
    if plot:
        plot_curves(payload["results"], plot)


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------


def _child_argv(argv: list[str]) -> list[str]:
    """The command line minus the options that only the parent acts on (--modes, --seeds, --devices, --json,
    --plot, --in-process)."""
    drop, kept, skip = {"--modes", "--seeds", "--devices", "--json", "--plot", "--in-process"}, [], False
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


def run_all(args: argparse.Namespace, argv: list[str], payload: dict[str, Any]) -> None:
    """Every (mode, seed) run, in that order, into `payload["results"]` (saved to `--json` as each one ends).

    Child processes run one at a time, or with `--devices` one per listed GPU at once: runs on separate GPUs
    share only the host, so their step times stay comparable.
    """
    runs = [(mode, seed) for mode in args.mode_list for seed in args.seed_list]
    finished: dict[int, dict[str, Any]] = {}

    def save(index: int, result: dict[str, Any]) -> None:
        finished[index] = result
        payload["results"] = [finished[i] for i in sorted(finished)]
        if args.json:
            _write_json(args.json, payload)

    if args.in_process:
        for index, (mode, seed) in enumerate(runs):
            print(f"\n=== {run_name(mode, seed)} ===", flush=True)
            save(index, run_mode(args, mode, seed))
        return
    free_devices: queue.Queue[str | None] = queue.Queue()
    for device in args.device_list or [None]:
        free_devices.put(device)

    def run_on_a_free_device(mode: str, seed: int) -> dict[str, Any]:
        device = free_devices.get()
        where = f" on CUDA device {device}" if device is not None else ""
        print(f"\n=== {run_name(mode, seed)}{where} ===", flush=True)
        try:
            return run_child(args, _child_argv(argv), mode, seed, device)
        finally:
            free_devices.put(device)

    with ThreadPoolExecutor(max_workers=len(args.device_list) or 1) as pool:
        futures = {pool.submit(run_on_a_free_device, mode, seed): index for index, (mode, seed) in enumerate(runs)}
        for future in as_completed(futures):
            save(futures[future], future.result())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings the Hub from every trainer otherwise
    if args.log_engine:
        logging.basicConfig(format="  %(name)s: %(message)s")
        logging.getLogger("s3r_hf").setLevel(logging.INFO)
        import torch._logging

        torch._logging.set_logs(recompiles=True)  # which shape or guard made a warm step compile again
    if args.from_json:
        payload = {"results": [r for path in args.from_json for r in json.loads(Path(path).read_text())["results"]]}
        report(payload, args.plot)
        return payload["results"]
    if args.child_out:
        _write_json(args.child_out, run_mode(args, args.mode_list[0], args.seed))
        return []
    if args.plot:
        pyplot()  # a missing matplotlib fails now, not after the runs
    settings = {key: value for key, value in vars(args).items()
                if key not in {"child_out", "from_json", "mode_list", "seed_list", "device_list"}}
    payload: dict[str, Any] = {"settings": settings, "results": []}
    run_all(args, argv, payload)
    report(payload, args.plot)
    return payload["results"]


if __name__ == "__main__":
    main()
