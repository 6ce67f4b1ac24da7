"""`S3RGRPOTrainer`: TRL's `GRPOTrainer` whose rollouts come from S3R."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator

from transformers import PreTrainedModel
from trl import GRPOTrainer

from s3r_hf.config import S3RConfig
from s3r_hf.errors import ContextWindowError
from s3r_hf.generate import generate as s3r_generate
from s3r_hf.runtime_state import free_device_state
from s3r_hf.sharding import gathered_parameters
from s3r_hf.stats import S3RStats
from s3r_hf.validation import check_model_supported, context_window, model_dropout
from trl_integration.heap_freeze import HeapFreeze


def check_sharding_supported(trainer) -> None:
    """S3R rollouts run on plain, DDP and FSDP2 models (the last with its parameters gathered for each rollout,
    `s3r_hf.sharding`); FSDP1 and DeepSpeed are refused with what to use instead."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise NotImplementedError(
            "S3R rollouts under DeepSpeed are not supported (not tested); use FSDP2 (accelerate: fsdp_version: 2), "
            "DDP, or use_s3r=False in S3RGRPOConfig to generate with TRL's own path"
        )
    if getattr(trainer, "is_fsdp_enabled", False):
        plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
        if getattr(plugin, "fsdp_version", 1) != 2:
            raise NotImplementedError(
                "S3R rollouts under FSDP1 are not supported: its wrappers refuse forwards while their full "
                "parameters are summoned. Use FSDP2 (accelerate: fsdp_version: 2), DDP, or use_s3r=False in "
                "S3RGRPOConfig to generate with TRL's own path"
            )


def check_no_dropout_in_policy(policy: PreTrainedModel) -> None:
    """TRL generates with the policy in training mode, where S3R refuses dropout (its forwards apply none, so its
    samples would not be dense sampling's): refused here, before training starts, with what removes it."""
    where = model_dropout(policy)
    if where is None:
        return
    # TRL's `disable_dropout` zeroes `nn.Dropout` modules only; an attention module's rate is a float it leaves.
    remedy = (
        "set disable_dropout=True in S3RGRPOConfig" if where.startswith("dropout module")
        else "load the policy with attention_dropout=0.0 (disable_dropout zeroes nn.Dropout modules only)"
    )
    raise ValueError(
        f"S3R rollouts cannot run with dropout in the policy ({where}): TRL generates in training mode, where dense "
        f"sampling draws dropout masks that S3R's forwards do not apply. To use S3R, {remedy}; or set use_s3r=False "
        "to generate with TRL's own path"
    )


class _RolloutRecorder:
    """Routes one `model.generate` call through S3R and keeps the statistics TRL's code path drops."""

    def __init__(self, config: S3RConfig, mode: str = "s3r") -> None:
        self.config = config  # no sampling log-probs, as TRL's own transformers path (`S3RGRPOConfig` checks it)
        self.mode = mode  # `generate`'s s3r_mode: "s3r", or "ar" for the engine's dense decoding
        self.stats: S3RStats | None = None
        self.seconds = 0.0

    @contextlib.contextmanager
    def route(self, model: PreTrainedModel) -> Iterator[None]:
        """Within the block, `model.generate(...)` runs S3R and returns the sequences tensor, as TRL expects."""
        had_own = "generate" in model.__dict__
        previous = model.__dict__.get("generate")
        # The class's own `generate`, so a model already passed through `s3r_hf.enable` routes the same way.
        original = type(model).generate.__get__(model, type(model))

        def generate(*args, **kwargs):
            started = time.perf_counter()
            kwargs.update(custom_generate=s3r_generate, s3r_config=self.config, s3r_mode=self.mode)
            config = kwargs.get("generation_config")
            if config is None:
                kwargs["return_dict_in_generate"] = True
            else:  # inside TRL's config, where transformers does not warn of generation arguments passed beside it
                kwargs["generation_config"] = copy.deepcopy(config)
                kwargs["generation_config"].return_dict_in_generate = True
            output = original(*args, **kwargs)
            self.seconds += time.perf_counter() - started
            self.stats = output.s3r_stats
            return output.sequences

        model.generate = generate
        try:
            yield
        finally:
            if had_own:
                model.generate = previous
            else:
                del model.generate


def check_completions_fit(model: PreTrainedModel, max_completion_length: int | None) -> None:
    """Raise `ContextWindowError` before training if no prompt leaves room for `max_completion_length` tokens in the
    model's context window: S3R refuses positions past it (a rollout would fail at the first step)."""
    window = context_window(model)
    if window is not None and max_completion_length is not None and max_completion_length >= window:
        raise ContextWindowError(
            f"max_completion_length={max_completion_length} leaves no room for a prompt in the model's context window "
            f"of {window} tokens (max_position_embeddings); S3R generates within it: lower max_completion_length"
        )


class S3RGRPOTrainer(GRPOTrainer):
    """Drop-in for `GRPOTrainer`: every rollout is generated by S3R from the current policy parameters.

    The policy drafts with sparse attention over its own KV cache and verifies densely, so response groups are
    distributed exactly as TRL's own sampling would produce them. Nothing else changes: TRL's own
    `_generate_single_turn` builds the batch, unwraps the model and post-processes the completions (and returns no
    sampling log-probs, as without vLLM); only the model's `generate` call is routed through S3R. Plain, DDP and
    FSDP2 models are supported (FSDP2 parameters are gathered for each rollout); DeepSpeed and FSDP1 get a clear
    error. The KV pool, CUDA graphs and fused weights are kept for the next rollout
    (`S3RGRPOConfig.keep_rollout_state`, on by default), or freed when each rollout returns, before the optimizer
    step.

    Use with `S3RGRPOConfig`; a plain `GRPOConfig` (or `use_s3r=False`) runs TRL's own generation, and
    `s3r_rollout_mode="ar"` the engine's dense decoding (a baseline for benchmarks).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        resolve = getattr(self.args, "resolved_s3r_config", None)
        self.s3r_config = resolve() if resolve is not None and self.args.use_s3r else None
        self._heap_freeze = HeapFreeze()
        if self.s3r_config is not None:
            if getattr(self, "rollout_func", None) is not None:  # TRL calls it in place of its generation
                raise ValueError(
                    "rollout_func replaces TRL's generation, so S3R rollouts would never run; set use_s3r=False in "
                    "S3RGRPOConfig, or generate with model.generate(..., s3r_config=...) inside the rollout_func"
                )
            check_sharding_supported(self)
            policy = self.accelerator.unwrap_model(self.model)
            check_model_supported(policy)
            check_no_dropout_in_policy(policy)
            check_completions_fit(policy, self.args.max_completion_length)

    def train(self, *args, **kwargs):
        """TRL's `train`; then S3R's kept KV pool, graphs and fused weights are freed (`keep_rollout_state` keeps them
        from one rollout to the next, not past training). What the draft-length rule measured stays with the model.
        The heap frozen after the first rollout (`freeze_gc_after_first_rollout`) is thawed."""
        freeze = getattr(self.args, "freeze_gc_after_first_rollout", False)  # a plain GRPOConfig has no such field
        self._heap_freeze.armed = self.s3r_config is not None and freeze
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.s3r_config is not None:
                free_device_state(self.accelerator.unwrap_model(self.model))
            self._heap_freeze.thaw()

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        multimodal = bool(multimodal_fields) or (images is not None and any(images))
        if self.s3r_config is None or multimodal:  # S3R serves text-only causal LMs; TRL's path does the rest
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        recorder = _RolloutRecorder(self.s3r_config, getattr(self.args, "s3r_rollout_mode", "s3r"))
        model = self.accelerator.unwrap_model(self.model)
        # FSDP2: the full parameters for the whole rollout, so no rank waits on another's forwards (a no-op otherwise).
        with recorder.route(model), gathered_parameters(model):
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        self._log_s3r(recorder)
        self._heap_freeze.freeze()  # after the first rollout's compiles, in `train`; a no-op from then on
        # None, as TRL's own path returns: TRL would store sampling log-probs as `sampling_per_token_logps`, and its
        # off-policy mask would compare them (after top-k / top-p) with the policy's, dropping other sequences than
        # it drops with its own generation.
        return completion_ids, logprobs

    def _log_s3r(self, recorder: _RolloutRecorder) -> None:
        """S3R figures of this rollout, through TRL's own metrics (averaged and logged like TRL's).

        The speculative-decoding counts carry vLLM's names (`num_drafts`, `num_draft_tokens`, `num_accepted_tokens`,
        `num_accepted_tokens_per_pos_<i>`, `mean_acceptance_length = 1 + accepted / drafts`, over request-rounds
        that drafted); `s3r/tau` is committed tokens per request-round with dense steps included, what speed follows
        (`S3RStats` explains the difference).
        """
        mode = "train" if self.model.training else "eval"
        stats = recorder.stats
        metrics = self._metrics[mode]
        metrics["s3r/rollout_seconds"].append(recorder.seconds)
        metrics["s3r/acceptance_rate"].append(stats.acceptance_rate)
        metrics["s3r/mean_acceptance_length"].append(stats.mean_acceptance_length)
        metrics["s3r/tau"].append(stats.tau)
        metrics["s3r/num_drafts"].append(float(stats.num_drafts))
        metrics["s3r/dense_steps"].append(float(stats.dense_steps))
        metrics["s3r/rounds_per_refresh"].append(stats.rounds_per_refresh)
        metrics["s3r/num_draft_tokens"].append(float(stats.num_draft_tokens))
        metrics["s3r/num_accepted_tokens"].append(float(stats.num_accepted_tokens))
        for position, count in enumerate(stats.num_accepted_tokens_per_pos):
            metrics[f"s3r/num_accepted_tokens_per_pos_{position}"].append(float(count))
        for position, rate in enumerate(stats.per_position_acceptance):
            metrics[f"s3r/acceptance_position_{position + 1}"].append(rate)
        metrics["s3r/shared_prompt_tokens"].append(float(stats.shared_prompt_tokens))
        metrics["s3r/peak_kv_pages"].append(float(stats.peak_kv_pages))
        metrics["s3r/offload_episodes"].append(float(stats.offload_episodes))
        metrics["s3r/pages_moved_per_1k_tokens"].append(stats.pages_moved_per_1k_tokens)
        metrics["s3r/peak_host_kv_pages"].append(float(stats.peak_host_kv_pages))
        metrics["s3r/concurrency_backoffs"].append(float(stats.concurrency_backoffs))
        metrics["s3r/concurrency_limit_min"].append(float(stats.concurrency_limit_min))
        metrics["s3r/concurrency_limit_final"].append(float(stats.concurrency_limit_final))
        metrics["s3r/graph_capture_seconds"].append(stats.graph_capture_seconds)
        metrics["s3r/compiled_graphs"].append(float(stats.compiled_graphs))
        metrics["s3r/kernel_variants"].append(float(stats.kernel_variants))
        metrics["s3r/compile_seconds"].append(stats.compile_seconds)
