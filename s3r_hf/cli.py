"""The `s3r-hf` command: `s3r-hf demo`, `s3r-hf generate` and `s3r-hf bench`.

Only the chosen subcommand's module is imported (and only once its flags are needed), so `s3r-hf --help` answers
without loading torch or transformers. Errors caused by the input (a missing model, a device this machine does not
have, an empty prompt, a bad flag) are printed in one line with exit status 2; `--verbose` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

from s3r_hf.errors import S3RUserError, UsageError


class Command(NamedTuple):
    help: str
    description: str
    add_arguments: str
    """`module:function` that adds the subcommand's flags to its parser (the module is imported then)."""
    handler: str
    """`module:function` that runs the subcommand with the parsed arguments."""


COMMANDS: dict[str, Command] = {
    "demo": Command(
        help="compare dense and S3R greedy decoding on bundled math prompts",
        description="Compare dense and S3R greedy decoding on bundled math prompts (speed, acceptance, and whether "
        "the outputs match token for token).",
        add_arguments="s3r_hf.demo:add_demo_arguments",
        handler="s3r_hf.demo:demo_from_args",
    ),
    "generate": Command(
        help="generate completions with S3R and print its statistics",
        description="Generate completions for one or more prompts with S3R (or densely with --dense).",
        add_arguments="s3r_hf.cli:add_generate_arguments",
        handler="s3r_hf.cli:generate_from_args",
    ),
    "bench": Command(
        help="time S3R against dense decoding in the same engine and against model.generate",
        description="Time S3R, the engine's dense decoding (AR) and model.generate on the same prompts.",
        add_arguments="s3r_hf.bench:add_bench_arguments",
        handler="s3r_hf.bench:bench_from_args",
    ),
}


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = float(text)
    if not 0.0 < value < math.inf:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `generate` subcommand's flags to `parser`."""
    from s3r_hf.demo import add_model_arguments, add_s3r_arguments, positive_int, unit_interval

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


def dense_drafting_note(prompt_lengths: Sequence[int], generated: Sequence[int], min_budget: int) -> str | None:
    """What to say when some contexts were no longer than `min_budget`: the drafter then attends to the whole
    context (its index view holds every position), so drafts are dense and acceptance is near 1."""
    if not prompt_lengths:
        return None
    shortest = min(prompt_lengths)
    longest = max(p + g for p, g in zip(prompt_lengths, generated))
    if shortest > min_budget:
        return None
    if longest <= min_budget:
        return (
            f"note: every context here ({shortest}-{longest} tokens) is within min_budget={min_budget}, so the "
            "drafter attended to the whole context, as dense decoding does: an acceptance near 1 is expected and says "
            "nothing about sparse drafting. Use a longer prompt, or --min-budget below the context length."
        )
    return (
        f"note: contexts up to min_budget={min_budget} tokens are drafted with full attention (here they ran from "
        f"{shortest} to {longest} tokens), so the acceptance is higher than sparse drafting alone would give."
    )


def generate_from_args(args: argparse.Namespace, console: Any = None) -> dict[str, Any]:
    """Run the `generate` subcommand: print each completion, then timing and S3R statistics."""
    from rich.console import Console
    from rich.markup import escape

    from s3r_hf import enable  # the engine's entry point
    from s3r_hf.demo import (
        build_batch,
        eos_token_ids,
        generated_lengths,
        output_sequences,
        quiet_hf_progress_bars,
        resolve_dtype,
        s3r_config_from_args,
        timed_generate,
    )
    from s3r_hf.models import load_model_and_tokenizer

    console = console or Console()
    config = s3r_config_from_args(args, seed=args.seed)
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)
    with console.status(f"Loading {args.model}"), quiet_hf_progress_bars():
        model, tokenizer = load_model_and_tokenizer(args.model, dtype=resolve_dtype(args.dtype), device=args.device)
        model = enable(model)
    batch = build_batch(tokenizer, args.prompt, device=model.device, chat_template=not args.no_chat_template)
    prompt_lengths = batch["attention_mask"].sum(dim=1).tolist()
    if 0 in prompt_lengths:
        empty = args.prompt[prompt_lengths.index(0)]
        how = "without the chat template (--no-chat-template)" if args.no_chat_template else "with the chat template"
        raise UsageError(f"--prompt {empty!r} has no tokens {how}: the model would have nothing to continue")
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
        try:
            output, seconds = timed_generate(model, batch, **kwargs)
        except RuntimeError as error:
            # torch.multinomial's refusal of inf/nan probabilities: logits divided by a tiny temperature overflow.
            if args.temperature is None or "probability tensor contains" not in str(error):
                raise
            raise UsageError(
                f"--temperature {args.temperature:g} is too small: the model's logits divided by it overflow, so "
                "there is no distribution to sample from; use a larger temperature, or greedy decoding (no "
                "--do-sample)"
            ) from error

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
        note = dense_drafting_note(prompt_lengths, lengths, config.min_budget)
        if note is not None:
            result["note"] = note
            console.print(f"[dim]{escape(note)}[/]")
    return result


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a bad flag value, a missing flag) are one line, like every other input
    error of the command, without the usage block; `--help` prints the usage."""

    def error(self, message: str) -> NoReturn:
        flag = re.fullmatch(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
        if flag is not None:
            # argparse takes a value such as "-1,3" for a flag of its own and then misses the value.
            message += f" (if the value starts with '-', write {flag.group(1)}=VALUE)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `s3r-hf` argument parser; with `only`, the flags of that subcommand alone are added (and only its
    module imported), which is all `main` needs."""
    from s3r_hf import __version__

    parser = OneLineErrorParser(
        prog="s3r-hf",
        description="Self-Sparse Speculative Rollouts for HuggingFace transformers: exact dense samples, faster.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.description)
        # Also after the subcommand; SUPPRESS keeps a flag given before it.
        sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="show the traceback of an error")
        if only is None or only == name:
            _resolve(command.add_arguments)(sub)
            sub.set_defaults(handler=command.handler, subparser=sub)
    return parser


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names: its first word that is not an option (the top-level options take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def is_user_error(error: BaseException) -> bool:
    """Whether `error` describes the input rather than a defect: these are reported in one line."""
    if isinstance(error, S3RUserError):
        return True
    kinds = []
    for module, name in (("s3r_hf.validation", "UnsupportedModelError"), ("s3r_hf.cache.page_allocator",
                                                                          "KVCapacityError")):
        loaded = sys.modules.get(module)  # if it is not loaded, the error cannot be one of its classes
        if loaded is not None and hasattr(loaded, name):
            kinds.append(getattr(loaded, name))
    return isinstance(error, tuple(kinds))


def one_line(error: BaseException) -> str:
    """The error's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


def _check_inputs(args: argparse.Namespace) -> None:
    """Before a model loads: the device exists and the model can be found (`demo` and `generate`)."""
    from s3r_hf.models import check_model_source, resolve_device

    resolve_device(args.device)
    check_model_source(args.model)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `s3r-hf` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(argv)
    parser = build_parser(only=command if command in COMMANDS else "")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command in ("demo", "generate"):
        from s3r_hf.demo import s3r_config_from_args

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
        if args.command in ("demo", "generate"):
            _check_inputs(args)
        _resolve(args.handler)(args)
    except Exception as error:
        if not is_user_error(error):
            raise
        if args.verbose:
            traceback.print_exc()
        args.subparser.exit(2, f"{args.subparser.prog}: error: {one_line(error)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
