"""An S3R call's hold on a model: one call per model at a time, and its changes seen by the calling thread only.

For the duration of a call S3R changes how the model runs: its attention goes through S3R's function
(`attention.py`), and with `S3RConfig.compile_layers` the decoder layers' forwards and Q/K/V and gate/up linears are
replaced (`compiled_layers.py`, `fused_projections.py`). Another thread may use the same model meanwhile (a dense
`generate`, a training or scoring forward), and it must see the model unchanged. So:

- `config._attn_implementation` is read through a per-thread override (`attention_override`). transformers keeps
  the value behind a property of its config class; that property is wrapped once so that a thread inside an S3R
  call reads S3R's implementation and every other thread reads the model's own. Nothing on the config is written.
- What is installed on the layers asks `owns(model)` and runs the model's own code in every other thread.
- A re-entrant lock per model serializes S3R calls on one model (the layer installs are per model, and one call's
  exit must not undo them under another call): a second thread's call waits for the first to return.
- User callbacks of a call (stopping criteria, a streamer, logits processors) run `outside_call`: a forward or a
  dense `generate` they run on the model sees it unchanged, and an S3R call they make on it is refused.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

_local = threading.local()  # .models: models this thread holds; .attention: (config, implementation) overrides
_registry_lock = threading.Lock()
_model_locks: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_wrapped_classes: set[type] = set()


def _model_lock(model: torch.nn.Module) -> threading.RLock:
    with _registry_lock:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.RLock()
        return lock


@contextlib.contextmanager
def hold(model: torch.nn.Module) -> Iterator[None]:
    """Hold the model for an S3R call: wait for another thread's call on it to finish, then mark it as this
    thread's until the block exits (re-entrant within the thread)."""
    lock = _model_lock(model)
    if not lock.acquire(blocking=False):
        logger.info("waiting for another thread's S3R call on this model to return")
        lock.acquire()
    held = _thread_list("models")
    held.append(model)
    try:
        yield
    finally:
        held.pop()
        lock.release()


@contextlib.contextmanager
def outside_call() -> Iterator[None]:
    """Run a user callback of an S3R call (a stopping criterion, a streamer, a logits processor) as if outside the
    call: within the block this thread holds no model and overrides no attention, so a forward or a dense `generate`
    the callback runs on the model gets the model's own code. The models stay locked against other threads' S3R
    calls, and an S3R call on one of them from the callback is refused (`check_not_nested`)."""
    models, attention, paused = _thread_list("models"), _thread_list("attention"), _thread_list("paused")
    saved_models, saved_attention = list(models), list(attention)
    paused.extend(saved_models)
    models.clear()
    attention.clear()
    try:
        yield
    finally:
        models[:] = saved_models
        attention[:] = saved_attention
        del paused[len(paused) - len(saved_models):]


def check_not_nested(model: torch.nn.Module) -> None:
    """Refuse an S3R call on a model that an S3R call of this thread is running (called from one of its callbacks):
    the inner call would reset the kept pool and undo the layers' installs under the outer one."""
    if owns(model) or any(paused is model for paused in getattr(_local, "paused", ())):
        raise RuntimeError(
            "an S3R call on this model is already running in this thread (generate with s3r_config was called from "
            "its stopping criterion, streamer or logits processor); S3R calls on one model cannot nest: generate "
            "without s3r_config inside the callback"
        )


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the current CUDA device for the block (a no-op off CUDA). Triton launches and CUDA-graph captures
    run on the current device's stream, not on their tensors' device: a model on `cuda:1` called while `cuda:0` is
    current would otherwise have its kernels launched on the wrong device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def owns(model: torch.nn.Module) -> bool:
    """Whether the current thread is inside an S3R call on `model`."""
    return any(held is model for held in getattr(_local, "models", ()))


@contextlib.contextmanager
def attention_override(configs: Iterable, implementation: str) -> Iterator[None]:
    """Within the block, the current thread reads `config._attn_implementation == implementation` for each of
    `configs`; other threads, and this one after the block, read the configs' own value."""
    configs = list(configs)
    for config in configs:
        _wrap_attention_property(type(config))
    overrides = _thread_list("attention")
    entries = [(config, implementation) for config in configs]
    overrides.extend(entries)
    try:
        yield
    finally:
        del overrides[len(overrides) - len(entries):]


def _thread_list(name: str) -> list:
    value = getattr(_local, name, None)
    if value is None:
        value = []
        setattr(_local, name, value)
    return value


def _wrap_attention_property(config_class: type) -> None:
    """Make `_attn_implementation` of `config_class` (a property in transformers 5) consult this thread's
    overrides first. Done once per defining class; behaviour without an override is the property's own."""
    owner = next((cls for cls in config_class.__mro__ if "_attn_implementation" in cls.__dict__), None)
    with _registry_lock:
        if owner is None or owner in _wrapped_classes:
            return
        original = owner.__dict__["_attn_implementation"]
        if not isinstance(original, property):
            raise RuntimeError(
                f"{owner.__name__}._attn_implementation is not a property in this transformers version; S3R cannot "
                "switch the attention implementation for its own thread only"
            )

        def read(config):
            # Innermost override first; a short list (one or two entries per S3R call on the stack).
            for overridden, implementation in reversed(getattr(_local, "attention", ())):
                if overridden is config:
                    return implementation
            return original.fget(config)

        owner._attn_implementation = property(read, original.fset, original.fdel, original.__doc__)
        _wrapped_classes.add(owner)
