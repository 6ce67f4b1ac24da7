"""Short arithmetic problems generated on the fly: a verifiable task sized for a 135M model to improve on in GRPO.

    from trl_integration.examples.arithmetic import load_arithmetic_dataset
    from trl_integration.examples.grpo_math import accuracy_reward      # the reward: math-verify on \\boxed{}

    dataset = load_arithmetic_dataset(size=4096, seed=0)   # "What is 37 + 48?" ... with answers "85" ...

Sums and differences take operands up to `max_operand`, products factors up to `max_factor`: SmolLM2-135M-Instruct
gets some of these right from the start, so the reward has variance for GRPO to learn from, and the answers are
short, so a rollout of a few dozen tokens suffices. The problems depend only on `size`, `seed` and the bounds
(a private `random.Random`), so runs that compare rollout methods train on the same data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from s3r_hf.errors import require

datasets = require("datasets", "trl", "the arithmetic dataset")

INSTRUCTION = "Give only the final answer, in \\boxed{}."
"""Asks for the answer alone: short completions keep a GRPO step cheap, and `accuracy_reward` reads the box."""
OPERATORS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One problem `left operator right`, with its exact integer answer."""

    left: int
    operator: str
    right: int

    @property
    def question(self) -> str:
        return f"What is {self.left} {self.operator} {self.right}?"

    @property
    def answer(self) -> int:
        if self.operator == "+":
            return self.left + self.right
        if self.operator == "-":
            return self.left - self.right
        return self.left * self.right


def arithmetic_problems(size: int, seed: int = 0, max_operand: int = 50,
                        max_factor: int = 12) -> list[ArithmeticProblem]:
    """`size` problems drawn uniformly over the three operators; the same arguments give the same list.

    Operands of `+` and `-` lie in [0, max_operand], factors of `*` in [0, max_factor] (two-digit products are
    as hard as a small model's sums; larger ones it rarely gets right, and a zero reward teaches nothing).
    """
    if size < 0 or max_operand < 1 or max_factor < 1:
        raise ValueError(f"need size >= 0 and bounds >= 1; got {size=}, {max_operand=}, {max_factor=}")
    rng = random.Random(seed)
    problems = []
    for _ in range(size):
        operator = rng.choice(OPERATORS)
        bound = max_factor if operator == "*" else max_operand
        problems.append(ArithmeticProblem(rng.randint(0, bound), operator, rng.randint(0, bound)))
    return problems


def load_arithmetic_dataset(size: int = 4096, seed: int = 0, max_operand: int = 50,
                            max_factor: int = 12) -> datasets.Dataset:
    """Conversational `prompt`s and string `answer`s: the columns `load_math_dataset` gives and `accuracy_reward`
    reads."""
    rows: dict[str, list] = {"prompt": [], "answer": []}
    for problem in arithmetic_problems(size, seed, max_operand, max_factor):
        rows["prompt"].append([{"role": "user", "content": f"{problem.question} {INSTRUCTION}"}])
        rows["answer"].append(str(problem.answer))
    return datasets.Dataset.from_dict(rows)
