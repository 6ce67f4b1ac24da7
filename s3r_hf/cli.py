"""The `s3r-hf` command: `s3r-hf demo` and `s3r-hf generate`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape

from .bench import add_bench_arguments, bench_from_args
from .demo import (
    add_demo_arguments,
    add_model_arguments,
    add_s3r_arguments,
    build_batch,
    demo_from_args,
    eos_token_ids,
    generated_lengths,
    output_sequences,
    positive_int,
    quiet_hf_progress_bars,
    resolve_dtype,
    s3r_config_from_args,
    timed_generate,
    unit_interval,
)
from .models import load_model_and_tokenizer
from .rollout_bench import RolloutUsageError


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    value = float(text)
    if not value > 0.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `generate` subcommand's flags to `parser`."""
    add_model_arguments(parser)
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="a prompt; repeat the flag to generate for several prompts as one batch",
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="(%(default)s)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=positive_float, default=None, help="sampling temperature")
    parser.add_argument("--top-p", type=unit_interval, default=None, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=nonnegative_int, default=None, help="top-k sampling (0: off)")
    parser.add_argument("--seed", type=nonnegative_int, default=None, help="seed of all random draws")
    parser.add_argument(
        "--no-chat-template",
        action="store_true",
        help="tokenize the prompts as given, without the chat template",
    )
    parser.add_argument("--dense", action="store_true", help="plain model.generate without S3R, for comparison")
    add_s3r_arguments(parser)


def generate_from_args(args: argparse.Namespace, console: Console | None = None) -> dict[str, Any]:
    """Run the `generate` subcommand: print each completion, then timing and S3R statistics."""
    from . import enable  # the engine's entry point

    console = console or Console()
    config = s3r_config_from_args(args, seed=args.seed)
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)
    with console.status(f"Loading {args.model}"), quiet_hf_progress_bars():
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=resolve_dtype(args.dtype), device=args.device)
        model = enable(model)
    batch = build_batch(tokenizer, args.prompt, device=model.device, chat_template=not args.no_chat_template)
    kwargs: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if args.do_sample:
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
        kwargs.update({name: value for name, value in sampling.items() if value is not None})
    if not args.dense:
        kwargs.update(s3r_config=config, return_dict_in_generate=True)
    method = "dense" if args.dense else "S3R"
    with console.status(f"Generating ({method}, batch of {len(args.prompt)})"):
        output, seconds = timed_generate(model, batch, **kwargs)

    prompt_len = batch["input_ids"].shape[1]
    new_tokens = output_sequences(output)[:, prompt_len:].cpu()
    lengths = generated_lengths(new_tokens, eos_token_ids(model, tokenizer), tokenizer.pad_token_id)
    completions = [
        tokenizer.decode(new_tokens[i, :n].tolist(), skip_special_tokens=True) for i, n in enumerate(lengths)
    ]
    for prompt, completion in zip(args.prompt, completions):
        console.rule(f"[bold]{escape(prompt)}", align="left")
        console.print(completion.strip(), highlight=False, markup=False)
    console.rule()
    tokens = sum(lengths)
    result: dict[str, Any] = {
        "method": method,
        "completions": completions,
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }
    console.print(f"{method}: {tokens} tokens in {seconds:.2f} s ({result['tokens_per_s']:.1f} tokens/s)")
    stats = getattr(output, "s3r_stats", None)
    if stats is not None:
        result["s3r_stats"] = stats.to_dict()
        per_position = ", ".join(f"{p:.2f}" for p in stats.per_position_acceptance)
        console.print(
            f"acceptance rate {stats.acceptance_rate:.3f}, τ (tokens per request-round) {stats.tau:.2f}, "
            f"mean acceptance length {stats.mean_acceptance_length:.2f}, drafts {stats.num_drafts}, "
            f"dense steps {stats.dense_steps}, drafted {stats.drafted}, accepted {stats.accepted}"
        )
        console.print(f"per-position acceptance: [{per_position}]")
        console.print(
            f"S3R config: draft_len={config.draft_len}, budget_ratio={config.budget_ratio}, "
            f"min_budget={config.min_budget}"
        )
    return result


def build_parser() -> argparse.ArgumentParser:
    """The `s3r-hf` argument parser."""
    parser = argparse.ArgumentParser(
        prog="s3r-hf",
        description="Self-Sparse Speculative Rollouts for HuggingFace transformers: exact dense samples, faster.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="compare dense and S3R greedy decoding on bundled math prompts",
        description="Compare dense and S3R greedy decoding on bundled math prompts (speed, acceptance, and "
        "whether the outputs match token for token).",
    )
    add_demo_arguments(demo)
    demo.set_defaults(handler=demo_from_args, subparser=demo)
    generate = commands.add_parser(
        "generate",
        help="generate completions with S3R and print its statistics",
        description="Generate completions for one or more prompts with S3R (or densely with --dense).",
    )
    add_generate_arguments(generate)
    generate.set_defaults(handler=generate_from_args, subparser=generate)
    bench = commands.add_parser(
        "bench",
        help="time S3R against dense decoding in the same engine and against model.generate",
        description="Time S3R, the engine's dense decoding (AR) and model.generate on the same prompts.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(handler=bench_from_args, subparser=bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `s3r-hf` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in ("demo", "generate"):
        try:  # report an invalid S3R setting as a usage error, before any model is loaded
            s3r_config_from_args(args, seed=getattr(args, "seed", None))
        except ValueError as error:
            args.subparser.error(str(error))
    if getattr(args, "do_sample", True) is False:
        given = [flag for flag in ("temperature", "top_p", "top_k") if getattr(args, flag, None) is not None]
        if given:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
            args.subparser.error(f"{flags} need --do-sample")
    try:
        args.handler(args)
    except RolloutUsageError as error:  # a flag or prompt source `bench --rollout` cannot use: one line, exit 2
        args.subparser.exit(2, f"{args.subparser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
