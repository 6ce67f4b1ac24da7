"""How often the sparse drafts are accepted at each context length, in a sampled rollout of a real model.

The adaptive draft-length rule (`s3r_hf/draft_policy.py`) estimates the acceptance per draft position from every
round it has seen, whatever the context. This measures whether acceptance depends on the context: one S3R `generate`
call at the fixed draft length, `--generations` sampled responses (T=1) to each of `--prompts` MATH-style problems,
with a draft-length policy that records each round's acceptance tests by the round's mean context (the engine's
own power-of-two buckets).

    python tools/acceptance_by_context.py --data math_train.json --prompts 4 --generations 4 --max-new-tokens 1536

Below `S3RConfig.min_budget` tokens of context an index view holds the whole context, so drafts are the dense
model's own tokens and every one is accepted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3r_hf import S3RConfig, enable  # noqa: E402
from s3r_hf.demo import build_batch  # noqa: E402
from s3r_hf.draft_policy import FixedDraftLength, RoundShape  # noqa: E402
from s3r_hf.models import load_model_and_tokenizer  # noqa: E402
from s3r_hf.rollout_bench import load_problems  # noqa: E402


class AcceptanceByContext(FixedDraftLength):
    """The fixed draft length, recording per context bucket the request-rounds, drafts and accepted drafts.

    The shape recorded is that of the latest choice; with early launches that is the round after the one whose
    acceptance is reported, one round later in context, which moves nothing at the scale of a bucket."""

    def __init__(self, draft_len: int) -> None:
        super().__init__(draft_len)
        self.shape: RoundShape | None = None
        self.by_context: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])

    def choose(self, shape: RoundShape) -> int:
        self.shape = shape
        return super().choose(shape)

    def observe_acceptance(self, draft_counts: list[int], accepted_counts: list[int], age: int = 0) -> None:
        entry = self.by_context[self.shape.bucket[1]]
        entry[0] += len(draft_counts)
        entry[1] += sum(draft_counts)
        entry[2] += sum(accepted_counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=None, help="MATH-style JSON/JSONL (default: the packaged problems)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=1536)
    parser.add_argument("--draft-len", type=int, default=6)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(args.model, dtype=getattr(torch, args.dtype), device=str(device))
    enable(model)
    problems = load_problems(args.data)[: args.prompts]
    batch = build_batch(tokenizer, [p for p in problems for _ in range(args.generations)], device)
    policy = AcceptanceByContext(args.draft_len)
    config = S3RConfig(draft_len=args.draft_len, adaptive=False)
    started = time.perf_counter()
    output = model.generate(
        **batch, max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=tokenizer.pad_token_id, s3r_config=config, s3r_draft_policy=policy, return_dict_in_generate=True,
    )
    print(f"{batch['input_ids'].shape[0]} rows, {time.perf_counter() - started:.0f} s, tau {output.s3r_stats.tau:.2f}, "
          f"min_budget {config.min_budget}")
    for bucket, (rounds, drafted, accepted) in sorted(policy.by_context.items()):
        print(f"context {2**bucket:>6}-{2 ** (bucket + 1) - 1:<6} request-rounds {rounds:>6}  accepted per draft "
              f"{accepted / max(drafted, 1):.3f}  tokens per request-round {1 + accepted / max(rounds, 1):.2f}")


if __name__ == "__main__":
    main()
