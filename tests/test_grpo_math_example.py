"""The GRPO math example: data loading, math-verify rewards, and one S3R training step end to end (CPU)."""

from __future__ import annotations

import json

from tests.conftest import tiny_tokenizer
from tests.test_trl_integration import tiny_policy
from trl_integration.examples.grpo_math import accuracy_reward, load_math_dataset, main


def test_gsm8k_and_math_files_become_prompts_and_answers(tmp_path):
    gsm8k = tmp_path / "gsm.jsonl"
    gsm8k.write_text(json.dumps({"question": "2 and 3?", "answer": "2+3=5\n#### 5"}) + "\n")
    math = tmp_path / "math.json"
    math.write_text(json.dumps([{"problem": "Half of 8?", "answer": "4", "type": "Algebra"}]))
    rows = load_math_dataset(str(gsm8k))
    assert rows["answer"] == ["5"] and rows["prompt"][0][0]["content"].startswith("2 and 3?")
    assert load_math_dataset(str(math))["answer"] == ["4"]


def test_accuracy_reward_uses_math_verify():
    completions = [[{"role": "assistant", "content": "so \\boxed{5}"}], [{"role": "assistant", "content": "6"}],
                   "The answer is $\\frac{1}{2}$"]
    assert accuracy_reward(completions, ["5", "5", "0.5"]) == [1.0, 0.0, 1.0]


def test_one_s3r_grpo_step_on_a_local_model(tmp_path):
    model_dir = tmp_path / "policy"
    tiny_policy().save_pretrained(model_dir)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n" for q in ["how many eggs ?"] * 4))
    trainer = main(["--model", str(model_dir), "--dataset", str(data), "--max-steps", "1", "--num-generations", "4",
          "--per-device-batch", "4", "--max-completion-length", "6", "--output-dir", str(tmp_path / "out"),
          "--s3r-config", '{"draft_len": 2, "min_budget": 2, "budget_ratio": 0.1, "page_size": 4}'])
    assert trainer.state.global_step == 1
    assert any("s3r/acceptance_rate" in entry for entry in trainer.state.log_history)
