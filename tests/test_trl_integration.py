"""`S3RGRPOTrainer`: GRPO steps with S3R rollouts on a tiny model (CPU)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import LlamaForCausalLM, TrainerCallback

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.runtime_state import runtime_for
from tests.conftest import WORDS, tiny_tokenizer, word_model
from trl_integration import S3RGRPOConfig, S3RGRPOTrainer

PROMPTS = ["how many eggs ?", "how many books and eggs ?", "the dollars of 3 books ?", "how many is 4 and 5 ?"]


def tiny_policy(seed: int = 0) -> LlamaForCausalLM:
    return word_model(seed, pad_token_id=WORDS.index("<eos>"))


def count_reward(completions, **kwargs) -> list[float]:
    """Rewards mentioning numbers: enough signal for GRPO to take non-zero steps."""
    return [float(sum(word.isdigit() for word in text.split())) for text in completions]


def make_trainer(
    tmp_path, seed: int = 0, s3r_options: dict | None = None, rollout_func=None, policy=None, **overrides
) -> S3RGRPOTrainer:
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = "<eos>"
    overrides.setdefault("max_steps", 2)
    overrides.setdefault("use_cpu", True)
    args = S3RGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=overrides.pop("max_completion_length", 10), learning_rate=1e-2, logging_steps=1,
        report_to="none", save_strategy="no",
        seed=seed, temperature=1.0, dataloader_num_workers=0, bf16=False,
        s3r_config={"draft_len": 3, "budget_ratio": 0.1, "min_budget": 2, "page_size": 4, "seed": seed,
                    **(s3r_options or {})},
        **overrides,
    )
    return S3RGRPOTrainer(
        model=policy if policy is not None else tiny_policy(seed), reward_funcs=count_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}), processing_class=tokenizer,
        rollout_func=rollout_func,
    )


def _count_pools(monkeypatch) -> list[int]:
    """Counts the KV pools built from now on (one entry per pool)."""
    from s3r_hf.cache import s3r_cache

    built, original_init = [], s3r_cache.S3RCache.__init__

    def counting_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        built.append(1)

    monkeypatch.setattr(s3r_cache.S3RCache, "__init__", counting_init)
    return built


def test_two_grpo_steps_with_s3r_rollouts_log_s3r_metrics(tmp_path, monkeypatch):
    # A fixed draft length: every step drafts, whatever this machine's timings would make the adaptive rule choose.
    trainer = make_trainer(tmp_path, s3r_options={"adaptive": False})
    s3r_hf.enable(trainer.model)  # an enabled model routes the same way
    before = [p.detach().clone() for p in trainer.model.parameters()]
    pools = _count_pools(monkeypatch)
    trainer.train()
    # The second step's rollout reused the first's KV pool (`keep_rollout_state`), across the optimizer step, and
    # the pool was freed when training ended.
    assert len(pools) == 1
    assert runtime_for(trainer.model).cache is None
    logs = [entry for entry in trainer.state.log_history if "s3r/acceptance_rate" in entry]
    assert len(logs) == 2, trainer.state.log_history
    for entry in logs:
        assert 0.0 <= entry["s3r/acceptance_rate"] <= 1.0
        assert entry["s3r/num_draft_tokens"] > 0 and entry["s3r/rollout_seconds"] > 0
        assert entry["s3r/num_drafts"] > 0 and entry["s3r/dense_steps"] >= 0
        assert entry["s3r/num_accepted_tokens"] <= entry["s3r/num_draft_tokens"]
        assert entry["s3r/num_accepted_tokens_per_pos_0"] <= entry["s3r/num_drafts"]
        assert 1.0 <= entry["s3r/mean_acceptance_length"] <= 4.0 and 1.0 <= entry["s3r/tau"] <= 4.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())), "no optimizer step"


def test_keep_rollout_state_false_frees_the_pool_after_each_rollout(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, keep_rollout_state=False)
    pools = _count_pools(monkeypatch)
    prompt_ids = [trainer.processing_class(p)["input_ids"] for p in PROMPTS]
    for _ in range(2):
        trainer._generate_single_turn(prompt_ids, None, {}, 1)
        assert runtime_for(trainer.model).cache is None
    assert len(pools) == 2


class _FreezeCountsAtStepEnd(TrainerCallback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.counts.append(gc.get_freeze_count())


def _train_recording_freeze_counts(trainer: S3RGRPOTrainer) -> list[int]:
    recorder = _FreezeCountsAtStepEnd()
    trainer.add_callback(recorder)
    trainer.train()
    return recorder.counts


def test_the_heap_is_frozen_after_the_first_rollout_and_thawed_when_training_ends(tmp_path, monkeypatch):
    """The first rollout's compiles leave long-lived objects that every later full collection traverses again (a
    half-second pause in some GPU step): they are frozen out of the collector for the run and thawed after it."""
    from s3r_hf.cache import s3r_cache

    pools, original_init = [], s3r_cache.S3RCache.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        pools.append(weakref.ref(self))

    monkeypatch.setattr(s3r_cache.S3RCache, "__init__", recording_init)
    assert gc.get_freeze_count() == 0
    counts = _train_recording_freeze_counts(make_trainer(tmp_path / "on"))
    assert len(counts) == 2 and counts[0] > 0 and counts[1] > 0, counts
    assert gc.get_freeze_count() == 0
    # The kept KV pool, alive when the heap was frozen, is freed when training ends all the same.
    assert len(pools) == 1 and pools[0]() is None

    assert _train_recording_freeze_counts(make_trainer(tmp_path / "off", freeze_gc_after_first_rollout=False)) == [0, 0]
    # A rollout outside `train` freezes nothing (nothing would thaw it).
    trainer = make_trainer(tmp_path / "outside")
    trainer._generate_single_turn([trainer.processing_class(p)["input_ids"] for p in PROMPTS], None, {}, 1)
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_before_training_is_frozen_further_and_not_thawed(tmp_path):
    """Objects frozen before training (by the user, or by whatever froze some at the process's start) do not stop the
    freeze after the first rollout, which is what keeps the steps free of long collections; at the end nothing is
    thawed, since `gc.unfreeze` would thaw those objects too."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        trainer = make_trainer(tmp_path)
        counts = _train_recording_freeze_counts(trainer)
        assert len(counts) == 2 and all(count > frozen for count in counts), (counts, frozen)
        assert trainer._heap_freeze.frozen_before > 0  # (frozen objects freed since leave the count)
        assert gc.get_freeze_count() > frozen  # the trainer's frozen objects stay frozen with the earlier ones
    finally:
        gc.unfreeze()


def _rollouts_against_trl(tmp_path, **trainer_options):
    """A trainer with `trainer_options` and TRL's own generation, both at top_k=1: the first after checking that its
    completions and sampling log-probs are what TRL's own path returns."""
    ours_trainer = make_trainer(tmp_path / "ours", top_k=1, **trainer_options)
    trl = make_trainer(tmp_path / "trl", top_k=1, use_s3r=False)
    tokenizer = ours_trainer.processing_class
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours, our_logprobs = ours_trainer._generate_single_turn(prompt_ids, None, {}, 1)
    theirs, their_logprobs = trl._generate_single_turn(prompt_ids, None, {}, 1)
    assert ours == theirs
    assert our_logprobs == their_logprobs
    return ours_trainer


def test_s3r_rollouts_equal_trl_generation_with_top_k_1_and_return_no_logprobs_as_trl(tmp_path, caplog):
    """TRL stores returned log-probs as `sampling_per_token_logps`, which its off-policy mask then reads in place of
    the policy's own: S3R's processed ones (after top-k / top-p) would drop other sequences than TRL drops. The route
    asks for S3R's statistics inside TRL's generation config, so transformers warns of nothing passed beside it."""
    _rollouts_against_trl(tmp_path)
    assert not [r for r in caplog.records if "generation_config" in r.getMessage() and "deprecated" in r.getMessage()]


def test_engine_ar_rollouts_equal_trl_generation_and_draft_nothing(tmp_path):
    ar = _rollouts_against_trl(tmp_path, s3r_rollout_mode="ar")
    metrics = ar._metrics["train" if ar.model.training else "eval"]
    assert metrics["s3r/num_drafts"] == [0.0] and metrics["s3r/dense_steps"][0] > 0
    assert metrics["s3r/tau"] == [1.0]


# compile_layers: the second step's rollouts run compiled layers (compiled in the first) on updated weights.
@pytest.mark.parametrize("compile_layers", [False, True])
def test_training_is_unchanged_by_s3r_except_through_the_samples(tmp_path, compile_layers):
    """TRL's own trainer, handed the completions S3R sampled (at T=1, so groups differ and the weights move) and the
    random state S3R's sampling left, trains to the same weights and losses: S3R changes the step only through its
    samples (in fp32: under GRPOConfig's default bf16 autocast, packed and padded batches round differently)."""
    s3r = make_trainer(tmp_path / "s3r", max_steps=2, s3r_options={"compile_layers": compile_layers})
    trl = make_trainer(tmp_path / "trl", use_s3r=False, max_steps=2)
    sampled = []
    generate = s3r._generate_single_turn

    def recording(*args, **kwargs):
        result = generate(*args, **kwargs)
        sampled.append((result, torch.get_rng_state()))
        return result

    def replaying(*args, **kwargs):
        result, rng_state = sampled.pop(0)
        torch.set_rng_state(rng_state)
        return result

    s3r._generate_single_turn, trl._generate_single_turn = recording, replaying
    before = [p.detach().clone() for p in s3r.model.parameters()]
    s3r.train()
    trl.train()
    assert len(sampled) == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, s3r.model.parameters())), "no optimizer step"
    for ours, theirs in zip(s3r.model.parameters(), trl.model.parameters()):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    losses = lambda t: [e["loss"] for e in t.state.log_history if "loss" in e]  # noqa: E731
    assert any(loss != 0 for loss in losses(s3r))
    assert losses(s3r) == pytest.approx(losses(trl), abs=1e-6)


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="draft_len"):
        S3RGRPOConfig(output_dir=str(tmp_path), s3r_config={"draft_len": 0}, use_cpu=True)
    with pytest.raises(ValueError, match="JSON"):
        S3RGRPOConfig(output_dir=str(tmp_path), s3r_config="{draft_len: 3", use_cpu=True)
    with pytest.raises(ValueError, match="s3r_rollout_mode must be one of"):
        S3RGRPOConfig(output_dir=str(tmp_path), s3r_rollout_mode="fast", use_cpu=True)
    for name in ("use_s3r", "keep_rollout_state", "freeze_gc_after_first_rollout"):
        for value in ("false", None, 0):  # "false" would turn S3R on, None off: neither says what was meant
            with pytest.raises(ValueError, match=rf"S3RGRPOConfig.{name} must be True or False"):
                S3RGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{name: value})
    with pytest.raises(ValueError, match="s3r_config.return_logprobs"):  # it was dropped without a word
        S3RGRPOConfig(output_dir=str(tmp_path), s3r_config={"return_logprobs": True}, use_cpu=True)


def test_an_s3r_config_object_is_kept_as_json_arguments(tmp_path):
    args = S3RGRPOConfig(output_dir=str(tmp_path), s3r_config=S3RConfig(draft_len=4, seed=3), use_cpu=True)
    assert args.resolved_s3r_config() == S3RConfig(draft_len=4, seed=3)
    assert json.loads(args.to_json_string())["s3r_config"]["draft_len"] == 4


def test_completions_past_the_context_window_are_refused_before_training(tmp_path):
    """S3R refuses positions past `max_position_embeddings`: a `max_completion_length` that leaves no room for a
    prompt failed at the first rollout, naming `max_new_tokens`; now the trainer refuses it, naming its own field."""
    window = tiny_policy().config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_completion_length={window}.*context window of {window}"):
        make_trainer(tmp_path, max_completion_length=window)


def test_a_rollout_func_is_refused_with_s3r_and_runs_without(tmp_path):
    """TRL calls a `rollout_func` in place of its own generation, which S3R routes: S3R would silently not run."""
    with pytest.raises(ValueError, match="rollout_func replaces TRL's generation"):
        make_trainer(tmp_path / "s3r", rollout_func=lambda prompts, trainer: None)
    assert make_trainer(tmp_path / "trl", use_s3r=False, rollout_func=lambda prompts, trainer: None).s3r_config is None


def test_dropout_in_the_policy_is_refused_before_training_with_its_remedy(tmp_path):
    """TRL generates in training mode: dense sampling would apply dropout, S3R's forwards apply none."""
    with_dropout_module = tiny_policy()
    with_dropout_module.model.embedding_dropout = torch.nn.Dropout(0.1)
    with pytest.raises(ValueError, match="embedding_dropout.*set disable_dropout=True"):
        make_trainer(tmp_path / "module", policy=with_dropout_module)
    # TRL's disable_dropout zeroes the module's rate: accepted.
    with_dropout_module.model.embedding_dropout.p = 0.1
    assert make_trainer(tmp_path / "disabled", policy=with_dropout_module, disable_dropout=True).s3r_config is not None
    with pytest.raises(ValueError, match="attention_dropout is 0.1.*load the policy with attention_dropout=0.0"):
        make_trainer(tmp_path / "attention", policy=word_model(0, attention_dropout=0.1), disable_dropout=True)
    assert make_trainer(tmp_path / "trl", policy=word_model(0, attention_dropout=0.1), use_s3r=False).s3r_config is None


def test_accelerate_launch_two_cpu_processes():
    """Two CPU processes under `accelerate launch` (gloo, DDP) run GRPO with S3R rollouts on both ranks.

    This accelerate's `--cpu` flag starts a single process whatever `--num_processes` says (multi-CPU needs
    mpirun), so the launch goes through torchrun (`--multi_gpu`) and the trainer's `use_cpu=True` makes it a
    CPU/gloo run.
    """
    script = Path(__file__).with_name("ddp_grpo.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ,
                            "OMP_NUM_THREADS": "1"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("S3R-DDP")]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(line.split()[1] for line in lines) == ["rank=0", "rank=1"], result.stdout[-3000:]
    for line in lines:
        assert "world=2" in line and "steps=2" in line and "s3r_logs=2" in line, line
        assert "wrapped=DistributedDataParallel" in line, line


def test_deepspeed_and_fsdp1_get_a_clear_error_and_fsdp2_passes():
    from types import SimpleNamespace

    from trl_integration.trainer import check_sharding_supported

    check_sharding_supported(SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=False))
    with pytest.raises(NotImplementedError, match="DeepSpeed"):
        check_sharding_supported(SimpleNamespace(is_deepspeed_enabled=True, is_fsdp_enabled=False))

    def fsdp(version):
        plugin = SimpleNamespace(fsdp_version=version)
        return SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=True,
                               accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)))

    with pytest.raises(NotImplementedError, match="FSDP1"):
        check_sharding_supported(fsdp(1))
    check_sharding_supported(fsdp(2))
