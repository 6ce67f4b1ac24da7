"""`S3RCache`: a transformers `Cache` over paged K/V storage, shared by sparse drafting and dense verification."""

from __future__ import annotations

import threading
import weakref

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from s3r_hf.cache.index_view import SparseIndexViews
from s3r_hf.cache.kv_offload import KVOffloader, OffloadedRequest
from s3r_hf.cache.page_allocator import KVCapacityError, PageAllocator
from s3r_hf.cache.score_recorder import VerifyScoreRecorder
from s3r_hf.kernels import get_backend
from s3r_hf.staging import to_device
from s3r_hf.validation import UnsupportedModelError

# Plain-mode handoff (see `S3RCache.update`): the attention function of the same layer, called right after
# `update` on the same thread, picks up which cache and layer it serves. Packed engine steps do not use it.
_plain_handoff = threading.local()


def take_plain_handoff(layer_idx: int) -> S3RCache | None:
    """The `S3RCache` whose plain-mode `update` for `layer_idx` just ran on this thread, if any (consumed)."""
    handoff = getattr(_plain_handoff, "value", None)
    _plain_handoff.value = None
    if handoff is not None and handoff[1] == layer_idx:
        return handoff[0]
    return None


class PagedKVLayer(CacheLayerMixin):
    """One layer's K and V page pools, `[num_pages, page_size, num_kv_heads, head_dim]` each.

    Bookkeeping (block tables, lengths) is shared by all layers and lives on the owning `S3RCache`.
    """

    is_croppable = True

    def __init__(self, cache: S3RCache, layer_idx: int, key_pool: torch.Tensor, value_pool: torch.Tensor) -> None:
        super().__init__()
        # A weak reference: a cycle cache -> layer -> cache would keep gigabytes of pools alive until Python's
        # cyclic garbage collector happens to run.
        self.cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.keys = key_pool
        self.values = value_pool
        self.is_initialized = True
        self.device = key_pool.device
        self.dtype = key_pool.dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Pools are allocated eagerly by `S3RCache`; nothing to do."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()


def kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """`(layers, KV heads, head dim)` of a model config (its text config for multimodal models)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return text_config.num_hidden_layers, num_kv_heads, head_dim


def _check_kv_fits_pool(layer_idx: int, pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Raise `UnsupportedModelError` where the keys or values a layer caches (`[B, heads, T, head dim]`) do not have
    the pool's heads and head dim (`[pages, page, KV heads, head dim]`, sized from the config): S3R cannot serve that
    layer's attention, and says so rather than fail inside a kernel."""
    heads, dim = pool.shape[2:]
    if keys.shape[1] != heads or keys.shape[-1] != dim or values.shape[1] != heads or values.shape[-1] != dim:
        raise UnsupportedModelError(
            f"layer {layer_idx} caches keys of (heads, head dim) ({keys.shape[1]}, {keys.shape[-1]}) and values of "
            f"({values.shape[1]}, {values.shape[-1]}), while S3R's KV pool holds ({heads}, {dim}) (the config's "
            "num_key_value_heads and head_dim): S3R cannot serve this model's attention"
        )


def page_bytes(config: PretrainedConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV page takes over all layers (keys and values)."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * page_size * kv_heads * head_dim * dtype.itemsize


class S3RCache(Cache):
    """Paged KV cache for S3R, usable as a transformers `Cache`.

    Every request owns a *slot*: a block table (list of page ids) and a length. All layers share the block
    tables; page `p` of a slot addresses the same page in every layer's pool. Rolling back a request is a length
    change that frees the pages it no longer reaches. Sparse index views (`self.index_views`) are sorted
    positions into the same storage.

    Two ways of use:
    - **engine steps**: the engine sets `self.step` (a `StepPlan`) for one packed forward; `update` writes the
      new K/V at the plan's slots and the S3R attention function reads the pools directly.
    - **plain mode** (`self.step is None`): a batch of `B` rows behaves like `DynamicCache` (row `b` is slot
      `b`); `update` appends and returns the full K/V, so transformers' own loops (assisted decoding) work.

    Args:
        config: the model config (layers, KV heads, head dim).
        num_pages: pages per layer pool.
        page_size: tokens per page.
        max_requests: most slots alive at once.
        dtype, device: of the pools.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        num_pages: int,
        page_size: int = 16,
        max_requests: int = 64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = kv_shape(config)
        self.page_size = page_size
        self.max_requests = max_requests
        self.device = torch.device(device)
        self.dtype = dtype
        # One page beyond the allocator's: the scratch page where padding rows of fixed-size (CUDA graph) steps
        # write their K/V, so they never touch a request's pages.
        self.scratch_page = num_pages
        pool_shape = (num_pages + 1, page_size, self.num_kv_heads, self.head_dim)
        layers = [
            PagedKVLayer(
                self,
                idx,
                torch.zeros(pool_shape, dtype=dtype, device=self.device),
                torch.zeros(pool_shape, dtype=dtype, device=self.device),
            )
            for idx in range(self.num_layers)
        ]
        super().__init__(layers=layers)
        self.allocator = PageAllocator(num_pages)
        self.offloader = KVOffloader(self.device)
        self.page_lists: dict[int, list[int]] = {}
        # Host mirror of the page lists as one int32 table (row = slot), kept in step with every change, so a
        # round's block tables are one row gather instead of a tensor built per request.
        self._host_tables = torch.zeros(max_requests, 64, dtype=torch.int32)
        self.lengths: dict[int, int] = {}
        self._free_slots = list(range(max_requests - 1, -1, -1))
        # One view row beyond the slots: padding rows of fixed-size steps use it, and its length stays 0.
        self.padding_slot = max_requests
        self.index_views = SparseIndexViews(self.num_layers, self.num_kv_heads, max_requests + 1, self.device)
        self.step = None  # the StepPlan of the forward in flight, if any
        # Plain mode under transformers' assisted decoding: where the verify forward leaves its top-K positions.
        self.score_recorder: VerifyScoreRecorder | None = None

    # ---------------------------------------------------------------- slots and pages
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def pages_held(self, slot: int) -> int:
        """Pages reserved for `slot` (its valid length and any reserved past it)."""
        return len(self.page_lists[slot])

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def used_pages(self) -> int:
        return self.allocator.num_used

    def reserve_if_fits(self, slots: list[int], lengths: list[int]) -> bool:
        """Reserve pages for each slot's K/V up to its `lengths` entry if the free pages cover all of them at once;
        returns whether it did (reserving nothing otherwise). Called for every request twice per engine step, where
        most requests already hold their pages, so the loop compares lengths before anything else."""
        size, page_lists = self.page_size, self.page_lists
        short = [(slot, length) for slot, length in zip(slots, lengths) if length > len(page_lists[slot]) * size]
        needed = sum(self.pages_for(length) - len(page_lists[slot]) for slot, length in short)
        if needed > self.free_pages:
            return False
        for slot, length in short:
            self.reserve(slot, length)
        return True

    def add_request(self) -> int:
        """Open an empty slot and return its id."""
        if not self._free_slots:
            raise KVCapacityError(f"S3RCache has no free request slot (max_requests={self.max_requests})")
        slot = self._free_slots.pop()
        self.page_lists[slot] = []
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        """Free a slot and all its pages."""
        self._host_tables[slot].zero_()
        self.allocator.free(self.page_lists.pop(slot))
        del self.lengths[slot]
        self._free_slots.append(slot)

    def reserve(self, slot: int, length: int) -> None:
        """Make sure `slot` has pages for `length` tokens (does not change its length)."""
        pages = self.page_lists[slot]
        missing = self.pages_for(length) - len(pages)
        if missing > 0:
            held = len(pages)
            pages.extend(self.allocator.allocate(missing))
            self._mirror(slot, held)

    def set_length(self, slot: int, length: int, release_pages: bool = True) -> None:
        """Set the valid length of `slot`; shrinking rolls back, and with `release_pages` frees the pages beyond the
        new length (without, they stay reserved for the slot, as `reserve` left them)."""
        pages = self.page_lists[slot]
        if length > len(pages) * self.page_size:
            raise ValueError(f"slot {slot}: length {length} exceeds its {len(pages)} reserved pages")
        keep = self.pages_for(length)
        if release_pages and keep < len(pages):
            self.allocator.free(pages[keep:])
            self._host_tables.numpy()[slot, keep : len(pages)] = 0  # NumPy view: a tensor slice write costs far more
            del pages[keep:]
        self.lengths[slot] = length

    def block_tables(self, slots: list[int]) -> torch.Tensor:
        """`[len(slots), max_pages]` int32 block tables (unused entries 0)."""
        width = max((len(self.page_lists[s]) for s in slots), default=0)
        rows = self._host_tables.index_select(0, torch.tensor(slots, dtype=torch.long))
        return to_device(rows[:, : max(width, 1)].contiguous(), self.device, torch.int32)

    def _mirror(self, slot: int, start: int) -> None:
        """Copy `page_lists[slot][start:]` into the host table (grown to fit)."""
        pages = self.page_lists[slot]
        if len(pages) > self._host_tables.shape[1]:
            grown = torch.zeros(self.max_requests, max(len(pages), 2 * self._host_tables.shape[1]), dtype=torch.int32)
            grown[:, : self._host_tables.shape[1]] = self._host_tables
            self._host_tables = grown
        self._host_tables.numpy()[slot, start : len(pages)] = pages[start:]

    def flat_rows(self, slots: list[int], positions: list[int]) -> list[int]:
        """Flat pool row of one position per slot (a dense step's writes: one token for each request)."""
        page_lists, size = self.page_lists, self.page_size
        return [page_lists[slot][p // size] * size + p % size for slot, p in zip(slots, positions)]

    def flat_indices(self, slot: int, positions: range) -> list[int]:
        """Flat pool row (`page * page_size + offset`) of each position of `slot`."""
        pages, size = self.page_lists[slot], self.page_size
        return [pages[p // size] * size + p % size for p in positions]

    @property
    def utilization(self) -> float:
        return self.allocator.num_used / self.allocator.num_pages

    def copy_prefix(self, pairs: list[tuple[int, int]], length: int | list[int]) -> None:
        """For each `(source, target)` slot pair, copy the source's K/V of positions `[0, length)` (one length for all,
        or one per pair) into the target's reserved pages, whole pages at a time, and set the target's length. The
        target's positions past `length` in its last page hold the source's values until they are written."""
        lengths = [length] * len(pairs) if isinstance(length, int) else length
        source, target = [], []
        for (src, dst), size in zip(pairs, lengths):
            pages = self.pages_for(size)
            if len(self.page_lists[dst]) < pages:
                raise ValueError(f"slot {dst}: {len(self.page_lists[dst])} pages reserved, {pages} needed")
            source += self.page_lists[src][:pages]
            target += self.page_lists[dst][:pages]
        if source:
            src_index, dst_index = to_device(source, self.device), to_device(target, self.device)
            for layer in self.layers:
                layer.keys.index_copy_(0, dst_index, layer.keys.index_select(0, src_index))
                layer.values.index_copy_(0, dst_index, layer.values.index_select(0, src_index))
        for (_, dst), size in zip(pairs, lengths):
            self.lengths[dst] = size

    # ---------------------------------------------------------------- offload
    def offload(self, slot: int) -> OffloadedRequest:
        """Copy a slot's K/V to host memory and free its pages; the slot itself stays reserved. Only the pages that
        hold its valid length travel (pages reserved past it hold nothing yet). On CUDA the copy runs on a side
        stream (`KVOffloader`); the freed pages may be written at once."""
        held = self.page_lists[slot][: self.pages_for(self.lengths[slot])]
        saved = self.offloader.offload(self.layers, held, self.lengths[slot])
        self.allocator.free(self.page_lists[slot])
        self.page_lists[slot] = []
        self._host_tables[slot].zero_()
        self.lengths[slot] = 0
        return saved

    def restore(self, slot: int, saved: OffloadedRequest) -> None:
        """Bring an offloaded slot back into (newly allocated) pages; raises `KVCapacityError` if none fit. On CUDA
        the host-to-device copy runs on a side stream, and the compute stream waits for it before the scatter."""
        pages = self.allocator.allocate(saved.num_pages)
        self.offloader.restore(saved, self.layers, pages)
        self.page_lists[slot] = pages
        self._mirror(slot, 0)
        self.lengths[slot] = saved.length

    # ---------------------------------------------------------------- the transformers Cache API
    # Kept out of `torch.compile` graphs (`S3RConfig.compile_layers`): host page bookkeeping, plan-driven writes.
    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this forward's K/V (`[B, Hkv, T, D]`).

        During an engine step the tokens go to the plan's pool rows and the inputs are returned unchanged (the
        S3R attention reads the pools). In plain mode row `b` appends to slot `b` and the full K/V of every row
        is returned, as `DynamicCache` does.
        """
        layer = self.layers[layer_idx]
        if self.step is not None:
            _check_kv_fits_pool(layer_idx, layer.keys, key_states, value_states)
            get_backend(self.device).write_kv(
                layer.keys, layer.values, self.step.write_index, key_states[0].transpose(0, 1),
                value_states[0].transpose(0, 1),
            )
            return key_states, value_states
        return self._plain_update(key_states, value_states, layer_idx)

    def step_kv_target(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(key pool, value pool, flat pool rows)` where `update` writes layer `layer_idx`'s K/V during an engine
        step: for a caller that writes them itself (the fused layers' Q/K/V kernel) instead of calling `update`."""
        if self.step is None:
            raise RuntimeError("S3RCache.step_kv_target is for engine steps (no step is set)")
        layer = self.layers[layer_idx]
        return layer.keys, layer.values, self.step.write_index

    def _plain_update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        batch, _, new, _ = key_states.shape
        if layer_idx == 0:
            for row in range(batch):
                if row not in self.lengths:
                    if self._free_slots and self._free_slots[-1] == row:
                        self.add_request()
                    else:
                        raise ValueError("plain-mode S3RCache rows must be slots 0..B-1 opened in order")
                self.reserve(row, self.lengths[row] + new)
                self.lengths[row] += new
        layer = self.layers[layer_idx]
        length = self.lengths[0]
        positions = range(length - new, length)
        rows = torch.tensor(
            [self.flat_indices(row, positions) for row in range(batch)], dtype=torch.long, device=self.device
        )
        flat_keys = layer.keys.view(-1, self.num_kv_heads, self.head_dim)
        flat_values = layer.values.view(-1, self.num_kv_heads, self.head_dim)
        flat_keys[rows] = key_states.transpose(1, 2).to(layer.dtype)
        flat_values[rows] = value_states.transpose(1, 2).to(layer.dtype)
        everything = torch.tensor(
            [self.flat_indices(row, range(length)) for row in range(batch)], dtype=torch.long, device=self.device
        )
        _plain_handoff.value = (self, layer_idx)
        return flat_keys[everything].transpose(1, 2), flat_values[everything].transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Plain-mode length (slot 0's); engine steps carry explicit positions instead."""
        return self.lengths.get(0, 0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, max_length: int) -> None:
        """transformers' rollback: a negative value removes that many tokens, a positive one keeps that many.

        Zero removes nothing: transformers 5.2x calls `crop(-n)` with `n == 0` when all candidates pass.
        """
        if max_length == 0:
            return
        for slot, length in list(self.lengths.items()):
            target = length + max_length if max_length < 0 else min(length, max_length)
            self.set_length(slot, max(target, 0))

    def reset(self) -> None:
        for slot in list(self.lengths):
            self.release(slot)
        if self.score_recorder is not None:
            self.score_recorder.take()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("S3RCache does not support beam search")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("S3RCache does not support batch_repeat_interleave (beam search / contrastive)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("S3RCache does not support batch_select_indices (beam search / contrastive)")

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def batch_size(self) -> int:
        return len(self.lengths)
