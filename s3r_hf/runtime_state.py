"""What S3R keeps for a model between `generate` calls (`ModelRuntime`), and `release(model)` to free it.

An RL loop calls `generate` once per step with the same shapes. Building the device state afresh on every call
costs more than a short rollout's decoding: the KV pool is allocated and zeroed, every CUDA graph is captured again,
and the fused projection weights are copied. So each model gets one runtime, kept until `release(model)` (or the
end of a `kept_state(model)` block), and reused by every later call it fits:

- the KV pool (`S3RCache`), reused when the call's requests fit it (same page size, dtype and device, enough
  request slots, and at least the pages the call would size it to);
- the CUDA graphs (`DecodeGraphs`) and the model forward they replay, on that same pool;
- the fused Q/K/V and gate/up weights of compiled layers, refilled in place from the model's weights on every call
  (the graphs read them by address, so an optimizer step between calls is picked up, and never missed);
- the adaptive draft-length rule's measurements (a few hundred numbers, no device memory);
- the response lengths seen so far, which admissions under KV pressure forecast from (`engine/kv_forecast.py`);
- how many calls used each fixed `S3RConfig.seed` (`call_seed`), so that successive calls draw new streams.

Everything a graph reads by address must still be where it was captured: the model's parameters and buffers are
fingerprinted (address, shape, dtype, device) on every call, with the modules, their hooks and their scalar
attributes (a scale, a flag), and if any changed (`model.to(...)`, new modules, a state dict loaded with
`assign=True`, an adapter switched off) the device state is dropped and rebuilt. Tensor values changed in place keep
their addresses, and the graphs read them as they are.

The runtime refers to the model weakly: it never keeps the model alive.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.nn.modules import module as module_hooks
from transformers import PreTrainedModel
from transformers.utils import logging

from s3r_hf.cache.s3r_cache import S3RCache, kv_shape
from s3r_hf.config import S3RConfig
from s3r_hf.cuda_graphs import DecodeGraphs
from s3r_hf.draft_policy import AdaptiveDraftLength, adaptive_for
from s3r_hf.draft_weights import DraftWeights
from s3r_hf.fused_projections import FusedProjections
from s3r_hf.matmul_precision import tf32_matmuls
from s3r_hf.model_forward import ModelForward

if TYPE_CHECKING:  # the engine package imports this module
    from s3r_hf.engine.kv_forecast import KVForecast

logger = logging.get_logger(__name__)

# How much more a call may want than the kept pool and graphs were sized for and still reuse them (see
# `ModelRuntime.reusable_cache` and `graphs_for`): an RL step's prompts differ a little in length from the last's.
POOL_TOLERANCE = 1.25
GRAPH_HEADROOM = 1.25
# Graphs are sized for at least this many tokens per request: RL prompts vary several-fold in length (MATH: 50-400
# tokens) while short completions barely pad them, so a 1.25x headroom over the first step's longest request is
# soon outgrown, and every graph is captured again (and layers recompiled) mid-run. A block table of 2,048 tokens
# costs the graphs little.
GRAPH_MIN_TOKENS = 2048


class ModelRuntime:
    """The device state of S3R calls on one model: KV pool, model forward, CUDA graphs, fused weights.

    A runtime made for a single call (`S3RConfig(keep_state=False)`, or an engine built directly) is the same object,
    dropped with the call.
    """

    def __init__(self) -> None:
        self.cache: S3RCache | None = None
        self.forward: ModelForward | None = None
        self.graphs: DecodeGraphs | None = None
        self.fused: FusedProjections | None = None
        # by (compile_layers, which decides the modules a layer runs; the copies' dtype)
        self.draft_weights: dict[tuple[bool, str], DraftWeights] = {}
        # by (draft_len, refresh_interval, adaptive_draft_lengths)
        self.policies: dict[tuple[int, int | None, tuple[int, ...] | None], AdaptiveDraftLength] = {}
        self.seed_calls: dict[int, int] = {}  # calls so far per fixed seed
        self.length_forecasts: dict[int, KVForecast] = {}  # by page size
        self._pages_wanted = 0  # the page count the pool was sized for (before a cap by free memory)
        self._fingerprint: tuple | None = None
        self._graphs_layers: tuple | None = None  # the layers' implementation the graphs were captured with
        # Whether part of the state was made under `torch.inference_mode`: its tensors are inference tensors, which
        # a later call outside that mode may not update in place.
        self._has_inference_tensors = False

    # ---------------------------------------------------------------- the model
    def check_model(self, model: PreTrainedModel) -> None:
        """Drop the device state if any parameter or buffer of `model` moved or changed shape or dtype since the
        state was built (captured graphs would read stale addresses), or a module or forward hook was swapped in,
        added or removed (`_fingerprint`); also if part of it was made under `torch.inference_mode` and this call
        runs outside it."""
        fingerprint = _fingerprint(model)
        if self._fingerprint is not None and fingerprint != self._fingerprint and self.cache is not None:
            logger.info("the model's weights, modules or hooks changed: S3R rebuilds its kept state")
            self.drop_device_state()
        if self._has_inference_tensors and not torch.is_inference_mode_enabled():
            logger.info("S3R's kept state was made under torch.inference_mode, and this call runs outside it, where "
                        "its tensors cannot be written: it is rebuilt")
            self.drop_device_state()
        self._fingerprint = fingerprint

    def policy(
        self, draft_len: int, refresh_interval: int | None = None, lengths: tuple[int, ...] | None = None
    ) -> AdaptiveDraftLength:
        """The adaptive draft-length rule for `draft_len`, `refresh_interval` (None: chosen by the rule) and the
        draft `lengths` it chooses among (None: 0 and `draft_len`), created on first use."""
        key = (draft_len, refresh_interval, lengths)
        if key not in self.policies:
            self.policies[key] = adaptive_for(draft_len, refresh_interval, lengths)
        return self.policies[key]

    def length_forecast(self, page_size: int) -> KVForecast:
        """The response-length model admissions forecast from (`engine/kv_forecast.py`), for pools of `page_size`
        tokens per page, created on first use and kept from call to call."""
        from s3r_hf.engine.kv_forecast import KVForecast

        if page_size not in self.length_forecasts:
            self.length_forecasts[page_size] = KVForecast(page_size)
        return self.length_forecasts[page_size]

    def call_seed(self, seed: int) -> int:
        """The generator seed of this call for a fixed `S3RConfig.seed`: different on every rank and for every
        call on the model (counted since the model's first call or its last `release`), so an RL loop with a fixed
        seed does not replay one random stream each step, nor draw the same one on every rank (TRL seeds each
        device apart for the same reason). The first call on rank 0 uses `seed` itself. The n-th call with a seed on
        a rank is reproducible: the same seed, rank and count give the same stream."""
        count = self.seed_calls.get(seed, 0)
        self.seed_calls[seed] = count + 1
        rank = process_rank()
        if rank == 0 and count == 0:
            return seed
        digest = hashlib.blake2b(f"s3r-hf:{seed}:{rank}:{count}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1  # 63 bits: any torch.Generator seed

    # ---------------------------------------------------------------- KV pool
    def reusable_cache(
        self, model: PreTrainedModel, config: S3RConfig, pages_wanted: int, longest_pages: int, max_requests: int,
        device: torch.device,
    ) -> S3RCache | None:
        """The kept pool, emptied, if a call of `max_requests` requests wanting `pages_wanted` pages, the longest
        `longest_pages`, fits it; else None. An explicit `config.num_pages` is honoured exactly (it sets how much KV
        pressure the call sees).

        A pool sized by default holds every request at full length, far more than a rollout whose responses end at
        EOS ever fills; a call that wants up to `POOL_TOLERANCE` times as many pages still reuses it (its requests
        would wait or be paused if they all ran to the limit at once, and nothing is lost)."""
        cache = self.cache
        if cache is None:
            return None
        fits = (
            kv_shape(model.config) == (cache.num_layers, cache.num_kv_heads, cache.head_dim)
            and cache.page_size == config.page_size
            and cache.dtype == model.dtype
            and cache.device == device
            and cache.max_requests >= max_requests
            and cache.num_pages >= longest_pages
            and (
                cache.num_pages == config.num_pages if config.num_pages
                else pages_wanted <= self._pages_wanted * POOL_TOLERANCE
            )
        )
        if not fits:
            logger.info("the kept KV pool (%d pages for %d requests) does not fit a call of %d requests wanting %d "
                        "pages: a new one is made", cache.num_pages, cache.max_requests, max_requests, pages_wanted)
            return None
        cache.reset()  # a call that failed may have left slots open
        return cache

    def adopt_cache(self, cache: S3RCache, model: PreTrainedModel, pages_wanted: int) -> None:
        """Make `cache` the runtime's pool (after `drop_device_state`), with the forward that runs on it."""
        self.cache = cache
        self.forward = ModelForward(model, cache)
        self._pages_wanted = pages_wanted
        self._note_made()

    def drop_device_state(self) -> None:
        """Free the pool, the graphs and the fused weights (their memory returns to torch's allocator)."""
        self.cache = self.forward = self.graphs = self.fused = None
        self.draft_weights = {}
        self._pages_wanted = 0
        self._has_inference_tensors = False

    def _note_made(self) -> None:
        self._has_inference_tensors |= torch.is_inference_mode_enabled()

    # ---------------------------------------------------------------- graphs and fused weights
    def graphs_for(self, max_pages: int, config: S3RConfig) -> DecodeGraphs:
        """The kept CUDA graphs if they cover `max_pages` pages per request for `config` (draft length, budget, and
        the layers' implementation: compiled, fused, the draft passes' matmul precision, autocast, which a graph
        records); otherwise new ones, the old ones dropped.

        New graphs are sized `GRAPH_HEADROOM` times past `max_pages`, and for at least `GRAPH_MIN_TOKENS` tokens: the
        next RL step's longest prompt is longer or shorter, and a graph replays any request that fits its block
        table.
        """
        graphs = self.graphs
        page_size = self.cache.page_size
        if (
            graphs is None
            or graphs.draft_len != config.draft_len
            or graphs.max_pages < max_pages
            or graphs.max_candidates != config.budget(graphs.max_pages * page_size)
            or self._graphs_layers != _layers_of(config, self.cache.device)
        ):
            if graphs is not None:
                logger.info("the kept CUDA graphs (%d pages per request, draft length %d) do not serve a call of %d "
                            "pages, draft length %d: captured again", graphs.max_pages, graphs.draft_len, max_pages,
                            config.draft_len)
            self.graphs = None  # freed before the new graphs capture
            pages = max(math.ceil(max_pages * GRAPH_HEADROOM), -(-GRAPH_MIN_TOKENS // page_size))
            budget = config.budget(pages * page_size)
            graphs = self.graphs = DecodeGraphs(self.cache, self.forward, pages, config.draft_len, budget)
            self._graphs_layers = _layers_of(config, self.cache.device)
            self._note_made()
        return graphs

    def fused_projections(self, make) -> FusedProjections:
        """The kept fused projections, or `make()`'s on first use."""
        if self.fused is None:
            self.fused = make()
            self._note_made()
        return self.fused

    def quantized_draft_weights(self, key: tuple[bool, str], make) -> DraftWeights:
        """The kept 8-bit draft weights for `key` (layers compiled or not, `S3RConfig.draft_weights`), or `make()`'s
        where there are none or they were built for modules the layers no longer hold."""
        weights = self.draft_weights.get(key)
        if weights is None or not weights.matches():
            weights = self.draft_weights[key] = make()
            self._note_made()
        return weights

    def device_bytes(self) -> int:
        """Device memory the runtime holds besides the graphs' own pools: the KV pool, index views, fused weights."""
        total = 0
        if self.cache is not None:
            total += sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)
            total += self.cache.index_views.positions.nbytes
        if self.fused is not None:
            total += self.fused.nbytes
        total += sum(weights.nbytes for weights in self.draft_weights.values())
        return total


def _layers_of(config: S3RConfig, device: torch.device) -> tuple:
    """What a captured graph fixes about the decoder layers it replays: their implementation, the dtype autocast
    runs their products in when the call is made under it, and the float32 matmul precision and reduced-precision
    reductions cuBLAS was allowed (a graph replays the kernels of its capture, whatever the user sets later)."""
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    matmul = torch.backends.cuda.matmul
    cublas = (
        tf32_matmuls(),
        matmul.allow_bf16_reduced_precision_reduction,
        matmul.allow_fp16_reduced_precision_reduction,
    )
    return (config.compile_layers, config.fused_layers, config.draft_matmul_precision, config.draft_weights, autocast,
            cublas)


def process_rank() -> int:
    """This process's rank among the data-parallel workers: torch.distributed's when it is initialized, else the
    `RANK` variable that `accelerate launch` and `torchrun` set, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _fingerprint(model: torch.nn.Module) -> tuple:
    """Where the model's tensors live, and which modules and forward hooks it runs: a module swapped in (a wrapper
    around the same parameters) or a hook added or removed since the kept state was built would otherwise meet fused
    projections that put the old module back, and graphs that replay the old code."""
    tensors = tuple(
        (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device)
        for tensors in (model.parameters(), model.buffers())
        for tensor in tensors
    )
    modules = tuple(
        (name, id(module), _hook_kinds(module._forward_pre_hooks), _hook_kinds(module._forward_hooks),
         _scalar_attributes(module))
        for name, module in model.named_modules()
    )
    # Hooks registered for every module (`torch.nn.modules.module.register_module_forward_hook`) run in the
    # forwards a graph captures as much as a module's own.
    global_hooks = tuple(_hook_kinds(hooks) for hooks in (
        module_hooks._global_forward_pre_hooks, module_hooks._global_forward_hooks))
    return tensors, modules, global_hooks


# Module flags that leave what an accepted call computes unchanged: dropout in training mode is refused
# (`validation.check_no_active_dropout`), and gradient checkpointing changes nothing without gradients (where it
# would drop the cache, `validation.check_checkpointing_keeps_the_cache` refuses the call). A training loop that
# switches them between calls must not pay a rebuild, every graph captured again, for them.
_UNFINGERPRINTED_ATTRIBUTES = frozenset({"training", "gradient_checkpointing"})


def _scalar_attributes(module: torch.nn.Module) -> tuple:
    """A module's plain scalar attributes (an attention `scaling`, an adapter's on/off flag or active name): a CUDA
    graph bakes in the values its forward read while it was captured, so a change must drop the graphs."""
    return tuple(
        (key, type(value), value)
        for key, value in vars(module).items()
        if key not in _UNFINGERPRINTED_ATTRIBUTES
        and (value is None or isinstance(value, (bool, int, float, complex, str, bytes)))
    )


def _hook_kinds(hooks: dict) -> frozenset:
    """The distinct functions among a module's hooks. Not their handles or count: TRL turns gradient checkpointing on
    around every rollout, and transformers then registers its `make_inputs_require_grads` hook on the embeddings again
    without removing the last one, so those change at every step while what the forward computes does not."""
    return frozenset(_hook_identity(hook) for hook in hooks.values())


def _hook_identity(hook) -> tuple:
    """A function by its code and what its closure holds: hooks a factory makes share their code and differ only in
    the values they close over (a scale, a mask), which a captured graph bakes in. Any other callable (a bound
    method, a `functools.partial`) by the object itself."""
    code = getattr(hook, "__code__", None)
    if code is None:
        return ("object", id(hook))
    return ("function", code, tuple(_cell_identity(cell) for cell in hook.__closure__ or ()))


def _cell_identity(cell) -> tuple:
    try:
        value = cell.cell_contents
    except ValueError:  # a cell not yet filled
        return ("empty",)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return ("value", type(value), value)
    return ("object", id(value))


_lock = threading.Lock()
_runtimes: weakref.WeakKeyDictionary[torch.nn.Module, ModelRuntime] = weakref.WeakKeyDictionary()


def runtime_for(model: torch.nn.Module) -> ModelRuntime:
    """The model's kept runtime, created on first use."""
    with _lock:
        runtime = _runtimes.get(model)
        if runtime is None:
            runtime = _runtimes[model] = ModelRuntime()
        return runtime


def call_seed(model: PreTrainedModel, config: S3RConfig) -> int:
    """The seed of a `generate` call's random streams: `config.seed`'s stream for this call and rank
    (`ModelRuntime.call_seed`), else one drawn from torch's global generator, as `generate` follows its seed."""
    if config.seed is not None:
        return runtime_for(model).call_seed(config.seed)
    return int(torch.randint(0, 2**62, (1,)).item())


def adaptive_policy(model: torch.nn.Module, config: S3RConfig) -> AdaptiveDraftLength:
    """The model's adaptive draft-length rule for `config.draft_len`, `config.refresh_interval` and
    `config.adaptive_draft_lengths`, kept across calls."""
    return runtime_for(model).policy(config.draft_len, config.refresh_interval, config.adaptive_draft_lengths)


def release(model: torch.nn.Module) -> None:
    """Free what S3R keeps for `model` between calls: the KV pool, CUDA graphs and fused weights, the draft-length
    rule's measurements (the next call builds and measures afresh) and the count of calls per fixed seed. Call it
    when the memory is needed elsewhere; `S3RConfig(keep_state=False)` keeps no device state in the first place."""
    with _lock:
        runtime = _runtimes.pop(model, None)
    if runtime is not None:
        runtime.drop_device_state()


def free_device_state(model: torch.nn.Module) -> None:
    """Free the KV pool, CUDA graphs and fused weights kept for `model`, and keep what costs no device memory: the
    draft-length rule's measurements and the count of calls per fixed seed (the next call builds device state
    again; a seeded run's streams go on as without it)."""
    with _lock:
        runtime = _runtimes.get(model)
    if runtime is not None:
        runtime.drop_device_state()


@contextlib.contextmanager
def kept_state(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, S3R calls on `model` share one runtime; it is released when the block exits."""
    try:
        yield
    finally:
        release(model)
