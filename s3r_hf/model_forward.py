"""One packed forward of the model over the engine's cache: the call that eager steps, draft phases and CUDA-graph
captures all make.

It is its own object, holding the cache and (weakly) the model but not the engine, so that the engine's draft phase
and graphs can keep it without forming a reference cycle back to the engine: the KV pool (often most of the
device's memory) is then freed by reference counting the moment its last holder drops it, not whenever Python's
cycle collector next runs. A model's kept runtime (`runtime_state.py`) holds it too, and must not keep the model
alive.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import PreTrainedModel

from s3r_hf.cache import S3RCache
from s3r_hf.draft_weights import draft_pass
from s3r_hf.step_plan import StepPlan
from s3r_hf.validation import UnsupportedModelError


class ModelForward:
    """`forward(ids, plan, keep=None)`: the model's logits `[N, V]` (model dtype) for packed `ids` `[1, N]`."""

    def __init__(self, model: PreTrainedModel, cache: S3RCache) -> None:
        self._model = weakref.ref(model)
        self.cache = cache
        parameters = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.supports_logits_to_keep = "logits_to_keep" in parameters

    @property
    def model(self) -> PreTrainedModel:
        model = self._model()
        if model is None:
            raise RuntimeError("the model this S3R forward ran was garbage-collected")
        return model

    def __call__(self, ids: torch.Tensor, plan: StepPlan, keep: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {self.cache_argument: self.cache}
        if keep is not None and self.supports_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        if plan.sparse is not None:  # inside the forward, so a captured graph regathers them on every replay
            sparse = plan.sparse
            sparse.views, sparse.view_lens = self.cache.index_views.view(None, sparse.slots, width=sparse.view_width)
        self.cache.step = plan
        try:
            model = self.model
            # A draft pass's plan holds sparse queries only; with `S3RConfig.draft_weights` its linears read their
            # 8-bit copies (`draft_weights.py`).
            with draft_pass(plan.sparse is not None and plan.dense is None):
                output = model(
                    input_ids=ids, position_ids=plan.position_ids, use_cache=True, s3r_step=plan,
                    s3r_cache=self.cache, **kwargs,
                )
        finally:
            self.cache.step = None
        if len(plan.layers_seen) != self.cache.num_layers:
            raise UnsupportedModelError(
                f"{type(model).__name__}: only {len(plan.layers_seen)} of {self.cache.num_layers} layers called "
                "the attention function registered with transformers' AttentionInterface; S3R needs every layer's "
                "attention to go through `cache.update` and `ALL_ATTENTION_FUNCTIONS`"
            )
        logits = output.logits[0]
        if keep is not None and not self.supports_logits_to_keep:
            logits = logits[keep]
        return logits
