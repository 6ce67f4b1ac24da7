"""GRPO on math problems with S3R rollouts (`--rollout s3r`) or TRL's own generation (`--rollout trl`).

    python trl_integration/examples/grpo_math.py --dataset path/to/gsm8k_train.jsonl --max-steps 20
    accelerate launch trl_integration/examples/grpo_math.py --dataset path/to/math_train.json

Datasets: a GSM8K-style `.jsonl` (`question`, `answer` ending in `#### N`), a MATH-style `.json` list
(`problem`, `answer`), or a Hub dataset id with such columns. Rewards: 1 when `math-verify` finds the
completion's final answer equal to the reference, else 0. The model defaults to the embedded SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from s3r_hf.errors import require
from s3r_hf.models import DEFAULT_MODEL, load_model_and_tokenizer
from trl_integration import S3RGRPOConfig, S3RGRPOTrainer  # checks TRL first (missing: names the [trl] extra)

# Both come with the [trl] extra.
datasets = require("datasets", "trl", "the GRPO math example")
math_verify = require("math_verify", "trl", "the GRPO math example's reward", package="math-verify")

INSTRUCTION = "Solve the problem step by step and put the final answer in \\boxed{}."


def load_math_dataset(source: str, limit: int | None = None) -> datasets.Dataset:
    """Conversational prompts and reference answers from a local file or a Hub dataset id."""
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_file():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".json" and path.is_file():
        records = json.loads(path.read_text())
    else:
        records = list(datasets.load_dataset(source, split="train"))
    rows = {"prompt": [], "answer": []}
    records = [r for r in records if r.get("answer")]  # a few MATH records carry no final answer
    for record in records[:limit]:
        question = record.get("question") or record["problem"]
        answer = record["answer"].split("####")[-1].strip()  # GSM8K keeps the final number after ####
        rows["prompt"].append([{"role": "user", "content": f"{question}\n{INSTRUCTION}"}])
        rows["answer"].append(answer)
    return datasets.Dataset.from_dict(rows)


def accuracy_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 where math-verify judges the completion's answer equal to the reference, else 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        gold = math_verify.parse(f"${reference}$")
        rewards.append(1.0 if gold and math_verify.verify(gold, math_verify.parse(text)) else 0.0)
    return rewards


def main(argv: list[str] | None = None) -> S3RGRPOTrainer:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the embedded default, a local path or a Hub id")
    parser.add_argument("--dataset", required=True, help="GSM8K .jsonl, MATH .json, or a Hub dataset id")
    parser.add_argument("--rollout", choices=["s3r", "trl"], default="s3r")
    parser.add_argument("--s3r-config", default=None, help="S3RConfig fields as JSON")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N problems")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--per-device-batch", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--learning-rate", type=float, default=1e-6)
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (default fp32)")
    parser.add_argument("--output-dir", default="grpo-math-output")
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model)
    config = S3RGRPOConfig(
        output_dir=args.output_dir, use_s3r=args.rollout == "s3r", s3r_config=args.s3r_config,
        max_steps=args.max_steps, num_generations=args.num_generations,
        per_device_train_batch_size=args.per_device_batch, max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate, bf16=args.bf16, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=not model.device.type == "cuda", temperature=1.0,
    )
    trainer = S3RGRPOTrainer(
        model=model, reward_funcs=accuracy_reward, args=config,
        train_dataset=load_math_dataset(args.dataset, args.limit), processing_class=tokenizer,
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
