"""`S3RConfig.draft_weights`: 8-bit copies of the decoder layers' weights in the draft passes only.

Drafts read the copies and nothing else does, so greedy outputs equal dense decoding's (the G-test in
`test_exactness_sampling.py` checks the sampled distribution and its power); the copies follow the model's weights
from call to call; the model's modules are its own again after every call; and the fused projections' GEMM stays
one GEMM per group in compiled draft passes.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig, draft_weights
from s3r_hf.config import DRAFT_WEIGHTS
from s3r_hf.kernels.decode_linear_reference import quantize_rows
from s3r_hf.model_forward import ModelForward
from s3r_hf.runtime_state import runtime_for
from tests.conftest import left_padded_batch, tiny_model

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
CONFIG = dict(adaptive=False, draft_len=4, budget_ratio=0.2, min_budget=2, page_size=4)


def _coarse_int8(model) -> None:
    """One huge weight per row of the down projections sets the row's int8 scale, so every other weight of the row
    rounds to 0 in the copies; that weight reads an activation held at 0, so the model's own outputs keep it out."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[:, 0] = 1e4
            layer.mlp.gate_proj.weight[0] = 0.0


def _counting(monkeypatch) -> list[tuple[bool, int]]:
    """Record each forward (whether a draft pass) and how many 8-bit products it ran."""
    forwards: list[tuple[bool, int]] = []
    products = [0]
    reference, call = draft_weights.decode_linear_reference, ModelForward.__call__

    def counted_reference(*args, **kwargs):
        products[0] += 1
        return reference(*args, **kwargs)

    def recording(self, ids, plan, keep=None):
        before = products[0]
        out = call(self, ids, plan, keep)
        forwards.append((plan.sparse is not None and plan.dense is None, products[0] - before))
        return out

    monkeypatch.setattr(draft_weights, "decode_linear_reference", counted_reference)
    monkeypatch.setattr(ModelForward, "__call__", recording)
    return forwards


@pytest.mark.parametrize("weights", ["int8", "int8-g64"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("phase", [True, False], ids=["draft-phase", "host-driven-passes"])
def test_greedy_equals_dense_and_only_drafts_read_the_copies(monkeypatch, family, phase, weights):
    model = s3r_hf.enable(tiny_model(family, seed=81).to(DEVICE))
    names = [name for name, _ in model.named_modules()]
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21, 14], seed=82))
    # A logits processor that reads the history drafts pass by pass from the host instead of in one phase.
    processors = {} if phase else {"repetition_penalty": 1.0001}
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24, **processors)
    forwards = _counting(monkeypatch) if DEVICE.type == "cpu" else None
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24,
                         s3r_config=S3RConfig(**CONFIG, draft_weights=weights), **processors)
    assert torch.equal(out, dense) and out.s3r_stats.drafted > 0
    if forwards is not None:  # seven linears in each of the model's layers, in every draft pass and nowhere else
        layers = model.config.num_hidden_layers
        assert {count for is_draft, count in forwards if is_draft} == {7 * layers}
        assert {count for is_draft, count in forwards if not is_draft} == {0}
    assert [name for name, _ in model.named_modules()] == names
    assert all(torch.equal(p, parameters[name]) for name, p in model.named_parameters())
    s3r_hf.release(model)


def test_the_drafts_differ_from_the_models_own():
    """The copies are used: rounded weights propose other tokens than the model's own, so fewer drafts are accepted
    where the views hold every position (there the model's own drafts are all accepted)."""
    model = s3r_hf.enable(tiny_model("llama", seed=83).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21, 14], seed=84))
    _coarse_int8(model)
    whole = dict(CONFIG, min_budget=1000)
    stats = {
        weights: model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24,
                                s3r_config=S3RConfig(**whole, draft_weights=weights)).s3r_stats
        for weights in ("model", "int8", "int8-g64")
    }
    assert stats["model"].accepted == stats["model"].drafted > 0
    assert stats["int8"].accepted < stats["int8"].drafted
    # A scale per 64 weights confines the huge weight's scale to its own group of each down projection's row
    # (128 weights, two groups): the other group keeps its weights, so more drafts are accepted than with one scale
    assert stats["int8"].accepted < stats["int8-g64"].accepted
    s3r_hf.release(model)


@pytest.mark.parametrize("weights, group", [("int8", None), ("int8-g64", 64)])
def test_the_copies_follow_the_models_weights_between_calls(weights, group):
    model = s3r_hf.enable(tiny_model("llama", seed=85).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21], seed=86))
    config = S3RConfig(**CONFIG, draft_weights=weights)
    model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16, s3r_config=config)
    (first,) = runtime_for(model).draft_weights.values()
    with torch.no_grad():  # an optimizer step, in place
        for p in model.parameters():
            p.mul_(1.01).add_(0.001)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16,
                         s3r_config=config)
    assert torch.equal(out, dense)
    (kept,) = runtime_for(model).draft_weights.values()
    assert kept is first  # kept from the first call (its pool fits the second), and requantized
    for weight in (model.model.layers[0].self_attn.q_proj.weight, model.model.layers[1].mlp.down_proj.weight):
        weight8, scale = kept.copies[id(weight)][1:]
        expected8, expected_scale = quantize_rows(weight, torch.int8, group)
        assert torch.equal(weight8, expected8) and torch.equal(scale, expected_scale)
    assert kept.copies[id(weight)][2].shape == ((64,) if group is None else (64, 128 // group))
    s3r_hf.release(model)


def test_compiled_draft_passes_run_one_product_per_fused_group(monkeypatch):
    """With compiled layers the Q/K/V and gate/up linears run as one GEMM per group (`fused_projections.py`); their
    8-bit products merge the same way: four per layer and draft pass, not seven."""
    torch._dynamo.reset()
    model = s3r_hf.enable(tiny_model("llama", seed=87).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21, 14], seed=88))
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    forwards = _counting(monkeypatch)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=16,
                         s3r_config=S3RConfig(**CONFIG, draft_weights="int8", compile_layers=True))
    assert torch.equal(out, dense) and out.s3r_stats.drafted > 0
    if DEVICE.type == "cpu":
        layers = model.config.num_hidden_layers
        assert {count for is_draft, count in forwards if is_draft} == {4 * layers}
        assert {count for is_draft, count in forwards if not is_draft} == {0}
    s3r_hf.release(model)


def test_bad_values_are_refused_by_name():
    for value in ("fp4", "float8", 8, "int8-g32"):
        with pytest.raises(ValueError, match="draft_weights must be one of"):
            S3RConfig(draft_weights=value)
    with pytest.raises(ValueError, match="fused_layers"):
        S3RConfig(draft_weights="int8", fused_layers=True)
    assert DRAFT_WEIGHTS == ("model", "int8", "int8-g64", "int8-g128")


def test_groups_that_do_not_divide_a_linear_are_refused_by_name():
    """The tiny model's linears read 64 or 128 inputs: groups of 128 do not divide the 64-wide ones."""
    model = s3r_hf.enable(tiny_model("llama", seed=91).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21], seed=92))
    with pytest.raises(ValueError, match="per 128 weights: decoder layer 0's self_attn.q_proj has rows of 64"):
        model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8,
                       s3r_config=S3RConfig(**CONFIG, draft_weights="int8-g128"))
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8,
                         s3r_config=S3RConfig(**CONFIG, draft_weights="int8-g64"))
    assert torch.equal(out, dense)
    s3r_hf.release(model)


def test_another_threads_forwards_during_a_draft_pass_read_the_models_weights(monkeypatch):
    """The S3R call pauses inside a draft pass, after its first 8-bit product; meanwhile a dense `generate` of the
    same model in the main thread runs the model's own weights, bit for bit."""
    model = s3r_hf.enable(tiny_model("llama", seed=89).to(DEVICE))
    _coarse_int8(model)  # so that the copies' products would change the dense tokens
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21], seed=90))
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    dense = model.generate(**kwargs)
    inside, proceed = threading.Event(), threading.Event()
    reference = draft_weights.decode_linear_reference

    def pausing(*args, **kw):
        if threading.current_thread() is not threading.main_thread() and not inside.is_set():
            inside.set()
            assert proceed.wait(60)
        return reference(*args, **kw)

    monkeypatch.setattr(draft_weights, "decode_linear_reference", pausing)
    result = {}
    call = threading.Thread(target=lambda: result.update(out=model.generate(
        **kwargs, s3r_config=S3RConfig(**CONFIG, draft_weights="int8"))))
    call.start()
    try:
        assert inside.wait(60)
        assert draft_weights._drafting and not draft_weights.drafting()
        assert torch.equal(model.generate(**kwargs), dense)
    finally:
        proceed.set()
        call.join(60)
    assert torch.equal(result["out"], dense)
    s3r_hf.release(model)
