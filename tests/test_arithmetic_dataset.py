"""The generated arithmetic task: deterministic per seed, right answers, and graded by the GRPO math reward."""

from __future__ import annotations

import ast
import operator

import pytest

from trl_integration.examples.arithmetic import INSTRUCTION, arithmetic_problems, load_arithmetic_dataset
from trl_integration.examples.grpo_math import accuracy_reward

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(question: str) -> int:
    """The value of "What is A op B?" computed independently of the generator (Python's own parse)."""
    expression = ast.parse(question.removeprefix("What is ").removesuffix("?"), mode="eval").body
    assert isinstance(expression, ast.BinOp) and type(expression.op) in BINARY
    return BINARY[type(expression.op)](expression.left.value, expression.right.value)


def test_the_same_seed_gives_the_same_problems_and_another_seed_others():
    first, again = load_arithmetic_dataset(64, seed=3), load_arithmetic_dataset(64, seed=3)
    assert first["prompt"] == again["prompt"] and first["answer"] == again["answer"]
    assert load_arithmetic_dataset(64, seed=4)["prompt"] != first["prompt"]
    assert arithmetic_problems(16, seed=3) == arithmetic_problems(64, seed=3)[:16]  # a prefix of a larger set


def test_prompts_are_conversational_and_answers_right():
    dataset = load_arithmetic_dataset(200, seed=0, max_operand=50, max_factor=12)
    assert dataset.column_names == ["prompt", "answer"]
    for prompt, answer in zip(dataset["prompt"], dataset["answer"]):
        (message,) = prompt
        assert message["role"] == "user" and message["content"].endswith(INSTRUCTION)
        question = message["content"].removesuffix(INSTRUCTION).strip()
        assert str(evaluate(question)) == answer
    operators = {problem.operator for problem in arithmetic_problems(200, seed=0)}
    assert operators == {"+", "-", "*"}
    assert all(0 <= p.left <= 12 and 0 <= p.right <= 12 for p in arithmetic_problems(200) if p.operator == "*")


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="size"):
        arithmetic_problems(-1)
    with pytest.raises(ValueError, match="bounds"):
        arithmetic_problems(4, max_operand=0)


def test_the_reward_is_one_for_the_right_boxed_answer_and_zero_otherwise():
    dataset = load_arithmetic_dataset(4, seed=1)
    answers = list(dataset["answer"])
    right = [[{"role": "assistant", "content": f"\\boxed{{{answer}}}"}] for answer in answers]
    wrong = [[{"role": "assistant", "content": f"\\boxed{{{int(answer) + 1}}}"}] for answer in answers]
    assert accuracy_reward(right, answers) == [1.0] * 4
    assert accuracy_reward(wrong, answers) == [0.0] * 4
    assert accuracy_reward(["I do not know."] * 4, answers) == [0.0] * 4
    negative = [[{"role": "assistant", "content": "\\boxed{-7}"}]]
    assert accuracy_reward(negative, ["-7"]) == [1.0] and accuracy_reward(negative, ["7"]) == [0.0]
