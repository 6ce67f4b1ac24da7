"""`S3RConfig.draft_matmul_precision`: float32 draft passes may run their matmuls in TF32 on CUDA; the verify stays
in full float32, so greedy outputs equal dense decoding (the G-tests on CUDA check the sampled distribution)."""

from __future__ import annotations

import os

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.draft_phase import DraftInputs
from s3r_hf.engine.model_runner import ModelRunner
from s3r_hf.matmul_precision import float32_matmul_precision
from s3r_hf.model_forward import ModelForward
from s3r_hf.sampler import draw_noise
from tests.conftest import left_padded_batch, tiny_model

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))


def test_the_precision_is_set_inside_the_block_and_restored_after_it():
    before = torch.backends.cuda.matmul.allow_tf32
    with float32_matmul_precision("highest"):
        assert torch.backends.cuda.matmul.allow_tf32 == before
    with pytest.raises(RuntimeError):
        with float32_matmul_precision("high"):
            assert torch.backends.cuda.matmul.allow_tf32
            raise RuntimeError("a failing draft pass")
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_the_precision_follows_torchs_newer_setting_too():
    """A process that set TF32 through torch's newer `fp32_precision` API, after which torch refuses reads of the
    legacy `allow_tf32`: the draft precision block and the float32 kernels' dot precision read and restore it."""
    from s3r_hf.kernels.triton_backend import _dot_precision

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):
            matmul.allow_tf32  # noqa: B018 - torch refuses the legacy read now
        assert _dot_precision(torch.float32) == "tf32"
        with float32_matmul_precision("high"):
            assert _dot_precision(torch.float32) == "tf32"
        assert matmul.fp32_precision == "tf32"
        matmul.fp32_precision = "ieee"  # the legacy switch reads again, and the block sets and restores through it
        assert _dot_precision(torch.float32) == "tf32x3"
        with float32_matmul_precision("high"):
            assert _dot_precision(torch.float32) == "tf32"
        assert matmul.fp32_precision == "ieee" and _dot_precision(torch.float32) == "tf32x3"
    finally:
        matmul.fp32_precision = before


@pytest.mark.parametrize("phase", [True, False], ids=["draft-phase", "host-driven-passes"])
@pytest.mark.parametrize("forced", [False, True], ids=["as-configured", "forced-on"])
def test_tf32_drafts_change_only_the_draft_forwards_and_greedy_stays_dense(monkeypatch, phase, forced):
    """Draft forwards run with TF32 allowed (float32 on CUDA only; elsewhere the setting is left alone), verify and
    prefill forwards without it; the outputs are dense decoding's. `forced` applies the setting on any device (on
    CPU the flag changes nothing but is still set and restored where a CUDA run would set it)."""
    seen = []
    call = ModelForward.__call__
    if forced:
        init = ModelRunner.__init__

        def forcing(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.draft_precision = self.config.draft_matmul_precision

        monkeypatch.setattr(ModelRunner, "__init__", forcing)

    def recording(self, ids, plan, keep=None):
        seen.append((plan.sparse is not None and plan.dense is None, torch.backends.cuda.matmul.allow_tf32))
        return call(self, ids, plan, keep)

    monkeypatch.setattr(ModelForward, "__call__", recording)
    model = s3r_hf.enable(tiny_model("llama", seed=71).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21, 14], seed=72))
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24)
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.2, min_budget=2, page_size=4,
                       draft_matmul_precision="high")
    # A logits processor that reads the history drafts pass by pass from the host instead of in one phase.
    processors = {} if phase else {"repetition_penalty": 1.0001}
    before = torch.backends.cuda.matmul.allow_tf32
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24,
                         s3r_config=config, **processors)
    assert torch.backends.cuda.matmul.allow_tf32 == before
    if not phase:  # the same greedy tokens need the same processor in the reference
        dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24,
                               **processors)
    assert torch.equal(out, dense)
    drafts = [tf32 for is_draft, tf32 in seen if is_draft]
    others = [tf32 for is_draft, tf32 in seen if not is_draft]
    assert drafts and others and out.s3r_stats.drafted > 0
    assert set(drafts) == {forced or DEVICE.type == "cuda" or before} and set(others) == {before}
    s3r_hf.release(model)


class _EagerGraphs:
    """Stands in for `DecodeGraphs` on any device: says it replays every draft phase, records the process-wide TF32
    flag and the precision it was handed, and runs the phase eagerly (as a capture would, under that precision)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.calls: list[tuple[bool, str]] = []
        self.captures, self.capture_seconds, self.capture_log = 0, 0.0, []

    def supports(self, plan, num_tokens) -> bool:
        return False  # every other forward runs eagerly

    @staticmethod
    def supports_draft_phase(rows: int) -> bool:
        return True

    def run_draft_phase(self, phase, inputs: DraftInputs, generator, passes=None, precision="highest"):
        self.calls.append((torch.backends.cuda.matmul.allow_tf32, precision))
        noise = phase.noise_buffer(inputs.pending.shape[0], inputs.pending.device)
        inputs.noise = None if noise is None else draw_noise(noise, generator)
        with float32_matmul_precision(precision):
            return phase(inputs, self.capacity, passes=passes)


def test_graph_replays_leave_the_process_wide_flag_alone(monkeypatch):
    """With CUDA graphs the runner hands the draft precision to the graphs, which set it around a capture only: a
    replay runs the kernels captured, so the process-wide flag (which another thread's float32 matmuls would see)
    stays as it was around every replay."""
    init = ModelRunner.__init__
    graphs = []

    def with_graphs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.draft_precision = "high"  # as on CUDA in float32
        self.graphs = _EagerGraphs(capacity=64)
        graphs.append(self.graphs)

    monkeypatch.setattr(ModelRunner, "__init__", with_graphs)
    model = s3r_hf.enable(tiny_model("llama", seed=73).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([9, 21, 14], seed=74))
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24)
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.2, min_budget=2, page_size=4)
    before = torch.backends.cuda.matmul.allow_tf32
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=24,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert out.s3r_stats.drafted > 0 and graphs[-1].calls
    assert set(graphs[-1].calls) == {(before, "high")}
    assert torch.backends.cuda.matmul.allow_tf32 == before
    s3r_hf.release(model)
