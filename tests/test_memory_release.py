"""A `generate` call's KV pool is handed back without waiting for Python's cycle collector: when the call returns
with `S3RConfig(keep_state=False)`, and on `s3r_hf.release(model)` when it was kept.

RL loops call `generate` once per training step, and a call that builds a pool sizes it from the free device memory
(`S3RConfig.kv_memory_fraction`): a pool kept alive by a reference cycle until the collector happens to run would
shrink that pool, or leave it no room at all.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from s3r_hf import S3RConfig, enable, release
from s3r_hf.cache import s3r_cache
from tests.conftest import left_padded_batch, tiny_model

# On CUDA the engine also holds CUDA graphs (and the draft phase's graph), which point into the pool.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["s3r", "ar"])
@pytest.mark.parametrize("keep_state", [False, True])
def test_the_kv_pool_is_freed_when_generate_returns_or_on_release(keep_state, mode, device, monkeypatch):
    pools: list[weakref.ref] = []
    original_init = s3r_cache.S3RCache.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        pools.append(weakref.ref(self))

    monkeypatch.setattr(s3r_cache.S3RCache, "__init__", recording_init)
    model = enable(tiny_model().to(device))
    input_ids, attention_mask = (t.to(device) for t in left_padded_batch([9, 14], seed=3))
    gc.collect()
    gc.disable()  # only reference counting may free the pool
    try:
        out = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
            eos_token_id=None, s3r_mode=mode,
            s3r_config=S3RConfig(budget_ratio=0.5, min_budget=4, cuda_graphs=device == "cuda", keep_state=keep_state),
        )
        assert len(pools) == 1
        if keep_state:
            assert pools[0]() is not None, "the pool was not kept for the next call"
            release(model)
        assert pools[0]() is None, "the engine's cache outlived the generate call (a reference cycle holds it)"
    finally:
        gc.enable()
    assert out.shape == (2, input_ids.shape[1] + 12)
    assert torch.all(out[:, : input_ids.shape[1]] == input_ids)
