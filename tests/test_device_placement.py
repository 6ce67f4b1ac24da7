"""A model on another CUDA device than the current one: S3R launches its kernels and captures its graphs on the
model's device (`model_session.on_device`), as torch ops on the model's tensors would run there."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig, candidate_generator, model_session
from tests.conftest import left_padded_batch, tiny_model

generate_module = importlib.import_module("s3r_hf.generate")  # the package's `generate` attribute is the function


@pytest.fixture
def entered_devices(monkeypatch):
    """The devices `on_device` is entered with."""
    devices = []
    real = model_session.on_device

    def recording(device: torch.device) -> contextlib.AbstractContextManager:
        devices.append(device)
        return real(device)

    monkeypatch.setattr(generate_module, "on_device", recording)
    monkeypatch.setattr(candidate_generator, "on_device", recording)
    return devices


def test_batched_and_assisted_calls_run_on_the_models_device(entered_devices):
    model = s3r_hf.enable(tiny_model("llama", seed=3))
    input_ids, attention_mask = left_padded_batch([5, 8], seed=4)
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False,
                   s3r_config=S3RConfig(draft_len=2, min_budget=2))
    assert entered_devices == [model.device]
    plain = tiny_model("llama", seed=3)  # transformers passes `s3r_config` on to a custom generate
    plain.generate(input_ids[1:], max_new_tokens=4, do_sample=False, custom_generate=s3r_hf.assisted_generate,
                   s3r_config=S3RConfig(draft_len=2, min_budget=2))
    assert entered_devices == [model.device, model.device]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_model_on_a_second_gpu_generates_as_dense_with_graphs_and_fused_layers():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    assert torch.cuda.current_device() != device.index
    model = s3r_hf.enable(tiny_model("qwen3", seed=5, head_dim=32).to(device))
    input_ids, attention_mask = (t.to(device) for t in left_padded_batch([9, 14, 6], seed=6))
    dense = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
    config = S3RConfig(draft_len=3, min_budget=4, cuda_graphs=True, fused_layers=True, adaptive=False)
    for _ in range(2):  # the second call replays the kept graphs
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False,
                             s3r_config=config)
        assert torch.equal(out, dense)
    assert torch.cuda.current_device() != device.index  # restored on return
