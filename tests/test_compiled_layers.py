"""`S3RConfig.compile_layers`: compiled decoder layers decode exactly what eager ones do, only while S3R runs."""

from __future__ import annotations

import os
import re

import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.compiled_layers import decoder_layers
from s3r_hf.validation import UnsupportedModelError
from tests.conftest import left_padded_batch, tiny_model

# On a GPU machine (`S3R_HF_TEST_DEVICE=cuda`) the compiled layers also run inside CUDA graphs.
DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))


def test_compiled_layers_greedy_match_dense_and_are_removed_afterwards():
    model = s3r_hf.enable(tiny_model("llama", seed=31, num_hidden_layers=3).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([5, 17, 33, 9], seed=32))
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20)
    config = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, compile_layers=True,
                       cuda_graphs=DEVICE.type == "cuda")
    torch._dynamo.reset()
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert out.s3r_stats.drafted > out.s3r_stats.accepted
    assert out.s3r_stats.compiled_graphs > 0 and out.s3r_stats.compile_seconds > 0
    # A second call reuses the compiled graphs.
    compiled_frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert compiled_frames > 0
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=20,
                         s3r_config=config)
    assert torch.equal(out, dense)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled_frames, "a second call recompiled"
    assert out.s3r_stats.compiled_graphs == 0 and out.s3r_stats.compile_seconds == 0
    # The model's own forward (training, plain generate) is eager again.
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))


def test_compile_layers_needs_transformers_decoder_layers():
    with pytest.raises(UnsupportedModelError, match="GradientCheckpointingLayer"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_compiled_layers_run_qkv_and_gate_up_as_one_gemm_each():
    """Seven linears per layer become four GEMMs (Q/K/V, O, gate/up, down); the model's linears come back after."""
    from torch._inductor.utils import run_and_get_code

    model = s3r_hf.enable(tiny_model("qwen3", seed=33, num_hidden_layers=2))
    linears = [module for module in model.modules() if type(module) is torch.nn.Linear]
    input_ids, attention_mask = left_padded_batch([5, 11], seed=34)
    dense = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8)
    config = S3RConfig(adaptive=False, draft_len=2, budget_ratio=0.2, min_budget=2, page_size=4, compile_layers=True)
    torch._dynamo.reset()
    out, sources = run_and_get_code(lambda: model.generate(
        input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8, s3r_config=config))
    assert torch.equal(out, dense)
    gemms = [len(re.findall(r"extern_kernels\.(?:mm|addmm)\(", source)) for source in sources]
    # Each shape class (prefill chunks, single-token steps, verify blocks) compiles one set of layer graphs, split
    # at the attention: Q/K/V | O | gate/up, down. Unfused, the first and last would hold three GEMMs each.
    assert max(gemms) == 2 and sum(gemms) == 4 * gemms.count(2), gemms
    assert [module for module in model.modules() if type(module) is torch.nn.Linear] == linears


def test_merge_identical_gemms_keeps_one_of_each():
    from s3r_hf.fused_projections import MergeIdenticalGemms

    def three_projections(x, w):
        return torch.mm(x, w.t())[:, :2] + torch.mm(x, w.t())[:, 2:4] * torch.mm(x, w.t())[:, 4:]

    aten_graph = torch.fx.experimental.proxy_tensor.make_fx(three_projections)(torch.ones(3, 4), torch.ones(6, 4))
    before = sum(node.target is torch.ops.aten.mm.default for node in aten_graph.graph.nodes)
    MergeIdenticalGemms()(aten_graph.graph)
    aten_graph.recompile()
    after = sum(node.target is torch.ops.aten.mm.default for node in aten_graph.graph.nodes)
    assert (before, after) == (3, 1)
    x, w = torch.randn(3, 4), torch.randn(6, 4)
    torch.testing.assert_close(aten_graph(x, w), three_projections(x, w))


def test_compiled_layers_follow_weight_updates_between_calls():
    """An RL loop updates the weights between rollouts: the compiled layers (and the fused Q/K/V and gate/up weight
    copies) must decode with the new weights, not the ones they were compiled or copied with."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=35, num_hidden_layers=2).to(DEVICE))
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([7, 12, 20], seed=36))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=16)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, compile_layers=True,
                       cuda_graphs=DEVICE.type == "cuda")
    before = model.generate(input_ids, s3r_config=config, **kwargs)
    assert torch.equal(before, model.generate(input_ids, **kwargs))
    generator = torch.Generator().manual_seed(37)
    with torch.no_grad():  # what an optimizer step does: the same parameter tensors, new values
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator).to(parameter))
    dense = model.generate(input_ids, **kwargs)
    assert not torch.equal(dense, before), "the update must change the greedy continuations"
    assert torch.equal(model.generate(input_ids, s3r_config=config, **kwargs), dense)


def test_the_input_grad_hook_of_gradient_checkpointing_compiles_no_extra_graphs():
    """transformers' gradient checkpointing (TRL's GRPO turns it on by default) hooks the embedding output to require
    grad, under `no_grad` too. Only the first layer's input then requires grad, and compiled frames guard on the flag:
    without care the first layer compiles apart from the others. The compiled layers must compile as many graphs as
    for a model without the hook, and decode the same tokens."""
    input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch([7, 19, 12], seed=38))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=16, return_dict_in_generate=True)
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, compile_layers=True,
                       cuda_graphs=DEVICE.type == "cuda")
    compiled, outputs = [], []
    for hooked in (False, True):
        torch._dynamo.reset()
        model = s3r_hf.enable(tiny_model("llama", seed=39, num_hidden_layers=2).to(DEVICE))
        if hooked:
            model.enable_input_require_grads()
            with torch.no_grad():
                assert model.get_input_embeddings()(input_ids).requires_grad  # the hook acts under no_grad too
        out = model.generate(input_ids, s3r_config=config, **kwargs)
        compiled.append(out.s3r_stats.compiled_graphs)
        outputs.append(out.sequences)
        s3r_hf.release(model)
    assert compiled[1] == compiled[0] > 0
    assert torch.equal(outputs[1], outputs[0])


def test_calls_of_new_shapes_settle_without_falling_back_to_eager():
    """Each call brings new token counts (prompt chunks, batch sizes, verify blocks). Past dynamo's default limit of
    eight recompilations a frame would run uncompiled for every new shape, silently; the compiled layers must settle
    on dynamic graphs instead, and later calls compile nothing."""
    from torch._dynamo.utils import counters

    model = s3r_hf.enable(tiny_model("qwen3", seed=35, num_hidden_layers=2).to(DEVICE))
    config = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, compile_layers=True,
                       cuda_graphs=DEVICE.type == "cuda")
    torch._dynamo.reset()
    compiled = []
    for call, lengths in enumerate([[5, 9, 13, 7], [6, 11, 4], [8, 8, 8, 8, 8], [12, 3], [7, 14, 9, 10, 5, 6]]):
        input_ids, attention_mask = (t.to(DEVICE) for t in left_padded_batch(lengths, seed=call))
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=20,
                             s3r_config=config)
        compiled.append(out.s3r_stats.compiled_graphs)
    assert counters["frames"]["ok"] == counters["frames"]["total"], "a frame fell back to eager"
    assert compiled[0] > 0 and compiled[-2:] == [0, 0], compiled


def test_a_kernels_wrapped_forward_is_traced_unwrapped_so_its_graph_breaks_resume():
    """transformers' attention classes (5.25 on) run their forward inside a `kernels` wrapper with a `try`/`finally`,
    which dynamo cannot resume after a graph break (the S3R attention breaks the graph in every attention forward):
    the whole forward would fall back to eager. While compiling, the compiled layers call the class's own forward;
    eagerly (another thread, the model's own code) the wrapper still runs, and a kernelized module keeps it."""
    kernels = pytest.importorskip("kernels", reason="the `kernels` package wraps forwards (transformers >= 5.25)")
    from torch._dynamo.utils import counters

    from s3r_hf.compiled_layers import _kernel_func_wrapper, _unwrapped_when_compiling

    @kernels.use_kernel_forward_from_hub("S3RTestDouble")
    def double(x):
        return 2 * x

    @kernels.use_kernelized_func(double)
    class Doubler(torch.nn.Module):
        def forward(self, x):
            y = double(x)
            torch._dynamo.graph_break()  # as the S3R attention does
            return y + 1

    module, x = Doubler(), torch.ones(3)
    assert _kernel_func_wrapper(module) is Doubler.forward.__wrapped__
    for forward, falls_back in ((module.forward, True), (_unwrapped_when_compiling(module, module.forward), False)):
        torch._dynamo.reset()
        counters.clear()
        assert torch.equal(torch.compile(forward, backend="eager")(x), torch.full((3,), 3.0))
        assert (counters["frames"]["ok"] < counters["frames"]["total"]) == falls_back
    assert torch.equal(_unwrapped_when_compiling(module, module.forward)(x), module(x))  # eager: the wrapper runs
    vars(next(iter(module._kernel_funcs.values())))["forward"] = lambda y: 2 * y  # as `kernelize` installs one
    assert _kernel_func_wrapper(module) is None
