"""tools/draft_weights_acceptance.py's emulated setting on CPU: the float8 rounding is the kernel's quantization, and
the draft phases of an emulated call see the rounded weights while every other forward, and the model after the
call, sees its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from s3r_hf import S3RConfig, enable
from s3r_hf.kernels.decode_linear_reference import FP8, quantize_rows
from tests.conftest import left_padded_batch, tiny_model

TOOL = Path(__file__).resolve().parents[1] / "tools" / "draft_weights_acceptance.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("draft_weights_acceptance", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_emulated_rounding(tool):
    weight = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    quantized, scale = quantize_rows(weight, FP8)
    assert torch.equal(tool.rounded(weight), quantized.float() * scale[:, None])
    assert not torch.equal(tool.rounded(weight), weight)
    assert set(tool.SETTINGS) == {"model", "int8", "int8-g64", "int8-g128", "float8-emulated"}


def test_only_draft_phases_see_the_emulated_weights(tool):
    model = enable(tiny_model(seed=5))
    own = {name: p.detach().clone() for name, p in model.named_parameters()}
    seen = []
    run = tool.draft_phase_module.DraftPhase.__call__
    q_proj = model.model.layers[0].self_attn.q_proj

    def recording(self, *args, **kwargs):
        seen.append(q_proj.weight.data.clone())
        return run(self, *args, **kwargs)

    tool.draft_phase_module.DraftPhase.__call__ = recording
    try:
        input_ids, attention_mask = left_padded_batch([12, 9], vocab=model.config.vocab_size, seed=6)
        with tool.emulated(model, "float8-emulated"):
            model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8,
                           s3r_config=S3RConfig(adaptive=False, draft_len=3, min_budget=2, page_size=4))
    finally:
        tool.draft_phase_module.DraftPhase.__call__ = run
    assert seen and all(torch.equal(w, tool.rounded(own["model.layers.0.self_attn.q_proj.weight"])) for w in seen)
    assert all(torch.equal(p, own[name]) for name, p in model.named_parameters())
