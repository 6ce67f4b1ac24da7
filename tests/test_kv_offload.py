"""Offload and restore of a paused request's K/V (`s3r_hf/cache/kv_offload.py`): bit-exact round trips while the
freed pages are written at once, in fp32 and bf16.

On a GPU machine (`S3R_HF_TEST_DEVICE=cuda`) the copies run on the offloader's own CUDA stream, and the pools are
large enough (hundreds of megabytes per request) that a copy missing its ordering with the compute stream would read
or write pages another request already owns.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig

from s3r_hf.cache.s3r_cache import S3RCache

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
ON_CUDA = DEVICE.type == "cuda"
# A request of `PAGES` pages: 2 x 4 layers x 1,024 pages x 16 x 8 x 128 values = 256 MiB in fp32 on CUDA; on CPU
# a few pages keep the test fast.
PAGES = 1024 if ON_CUDA else 12
PAGE_SIZE, LAYERS, KV_HEADS, HEAD_DIM = (16, 4, 8, 128) if ON_CUDA else (4, 2, 2, 8)


def _cache(dtype: torch.dtype) -> S3RCache:
    config = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS,
                         hidden_size=KV_HEADS * HEAD_DIM, vocab_size=32)
    return S3RCache(config, num_pages=2 * PAGES + 4, page_size=PAGE_SIZE, max_requests=4, dtype=dtype, device=DEVICE)


def _fill_random(cache: S3RCache, seed: int) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    for layer in cache.layers:
        for pool in (layer.keys, layer.values):
            pool.copy_(torch.randn(pool.shape, generator=generator, device=DEVICE, dtype=torch.float32))


def _slot_kv(cache: S3RCache, slot: int) -> list[torch.Tensor]:
    """The slot's valid K/V of every layer, bits as integers (a bit-exact comparison, NaN-proof)."""
    index = torch.tensor(cache.page_lists[slot], device=DEVICE)
    bits = torch.int32 if cache.dtype == torch.float32 else torch.int16
    length = cache.lengths[slot]
    flat = [pool[index].flatten(0, 1)[:length] for layer in cache.layers for pool in (layer.keys, layer.values)]
    return [kv.view(bits).clone() for kv in flat]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_restored_request_is_bit_exact_after_its_freed_pages_were_overwritten(dtype):
    cache = _cache(dtype)
    _fill_random(cache, seed=0)
    request, other = cache.add_request(), cache.add_request()
    length = PAGES * PAGE_SIZE - 3  # the last page partly valid
    cache.reserve(request, length)
    cache.set_length(request, length)
    before = _slot_kv(cache, request)
    freed = list(cache.page_lists[request])

    saved = cache.offload(request)
    assert saved.num_pages == PAGES and saved.length == length and saved.kv.device.type == "cpu"
    assert saved.nbytes == 2 * LAYERS * PAGES * PAGE_SIZE * KV_HEADS * HEAD_DIM * dtype.itemsize
    # Another request takes the freed pages and overwrites them straight away, on the compute stream, while the
    # copy to host memory may still be running.
    cache.reserve(other, length)
    assert cache.page_lists[other] == freed
    index = torch.tensor(freed, device=DEVICE)
    for layer in cache.layers:
        layer.keys[index] = -1.0
        layer.values[index] = 2.0
    cache.release(other)  # the restore takes the same pages again

    cache.restore(request, saved)
    assert cache.page_lists[request] == freed and cache.lengths[request] == length
    # Read on the compute stream right after the restore: it must see the restored bits, not the overwrite.
    after = _slot_kv(cache, request)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


@pytest.mark.skipif(not ON_CUDA, reason="the side stream exists on CUDA only (S3R_HF_TEST_DEVICE=cuda)")
def test_copies_run_on_a_stream_of_their_own_into_pinned_memory():
    cache = _cache(torch.bfloat16)
    slot = cache.add_request()
    cache.reserve(slot, 64)
    cache.set_length(slot, 64)
    saved = cache.offload(slot)
    assert cache.offloader.stream is not None and cache.offloader.stream != torch.cuda.current_stream(DEVICE)
    assert saved.kv.is_pinned()
    torch.cuda.synchronize(DEVICE)
