"""The float32 LM head of S3R's engine forwards (`s3r_hf.lm_head`): it runs the kernel in every engine forward,
whichever way the layers run, never in a dense `generate`; greedy outputs stay dense decoding's; it reads the head's
weight live; other heads, and autocast to another dtype, keep the head's own forward.

The kernel against its reference is in `test_fused_layers.py`; the sampling G-tests and their power checks
(`test_exactness_sampling.py`) run float32 models, so their S3R samples go through this head too.
"""

from __future__ import annotations

import os

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.kernels import layer_reference
from s3r_hf.lm_head import fusable_head
from tests.conftest import left_padded_batch, tiny_model

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
FUSABLE = dict(head_dim=32)  # the fused layers need a head dimension of 32, 64 or 128


@pytest.fixture
def head_rows(monkeypatch):
    """The row counts of the kernel's launches (the reference on CPU, the Triton kernel on CUDA)."""
    calls = []
    modules = [layer_reference]
    if DEVICE.type == "cuda":
        modules.append(pytest.importorskip("s3r_hf.kernels.layer_triton"))
    for ops in modules:
        monkeypatch.setattr(ops, "lm_head", lambda x, w, real=ops.lm_head: calls.append(x.shape[0]) or real(x, w))
    return calls


def _batch():
    ids, mask = left_padded_batch([9, 12], seed=9)
    return ids.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("layers", ["eager", "fused"])
def test_float32_heads_run_the_kernel_in_engine_forwards_only(layers, head_rows):
    model = s3r_hf.enable(tiny_model("llama", **FUSABLE).to(DEVICE))
    ids, mask = _batch()
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert not head_rows
    config = S3RConfig(min_budget=4, adaptive=False, draft_len=3, fused_layers=layers == "fused")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, s3r_config=config)
    assert torch.equal(out, dense)
    assert 2 * 4 in head_rows  # the verify block of two requests, four queries each
    assert 2 in head_rows  # a draft pass
    assert "forward" not in model.lm_head.__dict__  # the head's own forward is back


def test_the_head_reads_its_weight_live(head_rows):
    """An update of the head's weight in place between calls (an optimizer step) is what the next call computes
    with: its greedy output is dense decoding's with the new weight."""
    model = s3r_hf.enable(tiny_model("llama", seed=4).to(DEVICE))
    ids, mask = _batch()
    config = S3RConfig(min_budget=4, adaptive=False, draft_len=3)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, s3r_config=config)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.5)
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, s3r_config=config)
    assert torch.equal(out, dense)


def test_other_heads_keep_their_own_forward(head_rows):
    """Half-precision heads keep cuBLAS (at its floor there), biased heads and other modules their own code."""
    assert fusable_head(tiny_model("llama").lm_head)
    assert not fusable_head(tiny_model("llama").to(torch.bfloat16).lm_head)
    assert not fusable_head(torch.nn.Linear(64, 256))  # biased
    assert not fusable_head(None)
    model = s3r_hf.enable(tiny_model("llama").to(torch.float16 if DEVICE.type == "cuda" else torch.bfloat16))
    model = model.to(DEVICE)
    ids, mask = _batch()
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                   s3r_config=S3RConfig(min_budget=4, adaptive=False, draft_len=3))
    assert not head_rows


def test_under_autocast_to_another_dtype_the_head_runs_its_own_forward(head_rows):
    autocast_dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    model = s3r_hf.enable(tiny_model("llama").to(DEVICE))
    ids, mask = _batch()
    with torch.autocast(DEVICE.type, dtype=autocast_dtype):
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                       s3r_config=S3RConfig(min_budget=4, adaptive=False, draft_len=3))
    assert not head_rows


def test_a_float32_head_over_a_half_precision_model_runs_its_own_casting_forward(head_rows):
    """TRL's `cast_lm_head_to_fp32` makes the head float32 and gives it a forward that casts the half-precision
    hidden states up: the logits S3R samples from are that forward's float32 ones (they used to be the kernel's,
    computed on the half-precision input and rounded to it)."""
    model = tiny_model("llama", seed=5).to(torch.float16 if DEVICE.type == "cuda" else torch.bfloat16).to(DEVICE)
    head = model.lm_head = model.lm_head.float()
    head.forward = lambda hidden: torch.nn.functional.linear(hidden.to(torch.float32), head.weight)  # as TRL does
    s3r_hf.enable(model)
    ids, mask = _batch()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, s3r_config=S3RConfig(min_budget=4, adaptive=False, draft_len=3))
    logits = torch.stack(out.logits)
    assert logits.dtype == torch.float32
    rounded = (logits == logits.to(model.model.embed_tokens.weight.dtype).float()).float().mean()
    assert rounded < 0.05, "the logits are the half-precision input's, not the head's float32 forward's"
    assert not head_rows
