"""State kept across `generate` calls (`runtime_state.py`): reused when a call fits, exact after the weights change,
rebuilt when they move, freed on release, and never keeping the model alive."""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.cuda_graphs import DecodeGraphs
from s3r_hf.draft_phase import DraftPhase
from s3r_hf.logits import RaggedLogitsProcessor
from s3r_hf.runtime_state import GRAPH_HEADROOM, GRAPH_MIN_TOKENS, ModelRuntime, runtime_for
from s3r_hf.validation import CHECKPOINTING_DROPS_THE_CACHE
from tests.conftest import left_padded_batch, tiny_model

# On a GPU machine (`S3R_HF_TEST_DEVICE=cuda`) the kept state includes CUDA graphs.
DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
ON_CUDA = DEVICE.type == "cuda"


def _config(**overrides) -> S3RConfig:
    settings = dict(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, cuda_graphs=ON_CUDA)
    return S3RConfig(**{**settings, **overrides})


def _batch(lengths=(6, 19, 11), seed=41):
    return tuple(t.to(DEVICE) for t in left_padded_batch(list(lengths), seed=seed))


def _greedy(model, input_ids, attention_mask, config=None, max_new_tokens=16):
    return model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens,
                          s3r_config=config)


def _rebuilt_and_dense(model, input_ids, attention_mask, pool, config=None) -> None:
    """The next S3R call made a new kept pool (the state was rebuilt) and decodes as dense does now."""
    dense = _greedy(model, input_ids, attention_mask)
    out = _greedy(model, input_ids, attention_mask, config if config is not None else _config())
    assert runtime_for(model).cache is not pool
    assert torch.equal(out, dense)


def test_a_second_call_reuses_the_kv_pool_and_stays_exact():
    model = s3r_hf.enable(tiny_model("qwen3", seed=40).to(DEVICE))
    input_ids, attention_mask = _batch()
    dense = _greedy(model, input_ids, attention_mask)
    first = _greedy(model, input_ids, attention_mask, _config())
    pool = runtime_for(model).cache
    assert pool is not None
    second = _greedy(model, input_ids, attention_mask, _config())
    assert runtime_for(model).cache is pool
    assert torch.equal(first, dense) and torch.equal(second, dense)
    # A slightly longer call (an RL step whose longest prompt grew) and a smaller one reuse it too.
    longer = _greedy(model, input_ids, attention_mask, _config(), max_new_tokens=18)
    assert runtime_for(model).cache is pool
    assert torch.equal(longer, _greedy(model, input_ids, attention_mask, max_new_tokens=18))
    fewer = _greedy(model, input_ids[:2], attention_mask[:2], _config(), max_new_tokens=8)
    assert runtime_for(model).cache is pool
    assert torch.equal(fewer, _greedy(model, input_ids[:2], attention_mask[:2], max_new_tokens=8))
    s3r_hf.release(model)


def test_state_made_under_inference_mode_is_rebuilt_for_a_call_outside_it():
    """`torch.inference_mode` makes inference tensors, which no call outside it may write: a pool (and graphs) made in
    a call under it is rebuilt for the next plain call, while state made outside it serves calls under it."""
    model = s3r_hf.enable(tiny_model("llama", seed=46).to(DEVICE))
    input_ids, attention_mask = _batch(seed=47)
    dense = _greedy(model, input_ids, attention_mask)
    with torch.inference_mode():
        assert torch.equal(_greedy(model, input_ids, attention_mask, _config()), dense)
    pool = runtime_for(model).cache
    assert pool.layers[0].keys.is_inference()
    _rebuilt_and_dense(model, input_ids, attention_mask, pool)
    plain_pool = runtime_for(model).cache
    with torch.inference_mode():
        assert torch.equal(_greedy(model, input_ids, attention_mask, _config()), dense)
    assert runtime_for(model).cache is plain_pool  # the other way round it is kept
    assert torch.equal(_greedy(model, input_ids, attention_mask, _config()), dense)
    s3r_hf.release(model)


def test_a_call_that_does_not_fit_builds_a_new_pool():
    model = s3r_hf.enable(tiny_model("qwen3", seed=42).to(DEVICE))
    input_ids, attention_mask = _batch()
    _greedy(model, input_ids[:1], attention_mask[:1], _config())
    small = runtime_for(model).cache
    out = _greedy(model, input_ids, attention_mask, _config())  # more requests than the kept pool has slots
    assert runtime_for(model).cache is not small
    assert torch.equal(out, _greedy(model, input_ids, attention_mask))
    # An explicit pool size is honoured exactly: it sets the KV pressure a call sees.
    _greedy(model, input_ids, attention_mask, _config(num_pages=40))
    assert runtime_for(model).cache.num_pages == 40
    s3r_hf.release(model)


@pytest.mark.parametrize("compile_layers", [False, True])
def test_outputs_follow_weights_changed_in_place_between_calls(compile_layers):
    """An optimizer step between rollouts changes the weights in place. Compiled layers run Q/K/V and gate/up over
    kept concatenated copies, and CUDA graphs read every weight by address: a copy that was not refilled would
    decode with the old weights, silently."""
    model = s3r_hf.enable(tiny_model("llama", seed=43).to(DEVICE))
    input_ids, attention_mask = _batch(seed=44)
    config = _config(compile_layers=compile_layers)
    if compile_layers:
        torch._dynamo.reset()
    before = _greedy(model, input_ids, attention_mask, config)
    assert torch.equal(before, _greedy(model, input_ids, attention_mask))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    dense_after = _greedy(model, input_ids, attention_mask)
    assert not torch.equal(dense_after, before), "the weight change must change the output for the test to have power"
    after = _greedy(model, input_ids, attention_mask, config)
    assert torch.equal(after, dense_after)
    s3r_hf.release(model)


def test_weights_that_move_rebuild_the_kept_state():
    model = s3r_hf.enable(tiny_model("qwen3", seed=45).to(DEVICE))
    input_ids, attention_mask = _batch(seed=46)
    _greedy(model, input_ids, attention_mask, _config())
    pool = runtime_for(model).cache
    # A new parameter tensor (as `load_state_dict(..., assign=True)` or `model.to(...)` would make).
    layer = model.model.layers[0].mlp
    layer.up_proj.weight = torch.nn.Parameter(layer.up_proj.weight.detach() * 1.5)
    out = _greedy(model, input_ids, attention_mask, _config())
    assert runtime_for(model).cache is not pool
    assert torch.equal(out, _greedy(model, input_ids, attention_mask))
    s3r_hf.release(model)


class _Scaled(torch.nn.Module):
    """A parameter-free wrapper around a linear (as an adapter library might add): the parameters stay the same."""

    def __init__(self, linear: torch.nn.Module, factor: float) -> None:
        super().__init__()
        self.linear, self.factor = linear, factor

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden_states) * self.factor


@pytest.mark.parametrize("compile_layers", [False, True])
def test_a_module_swapped_in_between_calls_rebuilds_the_kept_state(compile_layers):
    """Kept fused projections swap the Q/K/V linears they were built for: a wrapper swapped in around the same
    parameters used to be replaced by the old linear during the call and after it (wrong output, model changed)."""
    model = s3r_hf.enable(tiny_model("llama", seed=51).to(DEVICE))
    input_ids, attention_mask = _batch(seed=52)
    config = _config(compile_layers=compile_layers)
    if compile_layers:
        torch._dynamo.reset()
    _greedy(model, input_ids, attention_mask, config)
    pool = runtime_for(model).cache
    attention = model.model.layers[0].self_attn
    attention.q_proj = wrapper = _Scaled(attention.q_proj, 3.0)
    _rebuilt_and_dense(model, input_ids, attention_mask, pool, config)
    assert attention.q_proj is wrapper
    s3r_hf.release(model)


def test_a_scalar_attribute_changed_between_calls_rebuilds_the_kept_state():
    """A CUDA graph bakes in the scalars its forward read when it was captured (a wrapper's scale here; an adapter's
    on/off flag or an attention `scaling` alike): a change must drop the kept graphs, or later calls replay the old
    value and sample from another model."""
    model = s3r_hf.enable(tiny_model("llama", seed=65).to(DEVICE))
    input_ids, attention_mask = _batch(seed=66)
    attention = model.model.layers[0].self_attn
    attention.q_proj = wrapper = _Scaled(attention.q_proj, 3.0)
    _greedy(model, input_ids, attention_mask, _config())
    pool = runtime_for(model).cache
    wrapper.factor = -2.0
    _rebuilt_and_dense(model, input_ids, attention_mask, pool)
    s3r_hf.release(model)


def test_training_and_checkpointing_flags_keep_the_kept_state():
    """A training loop switches training mode and gradient checkpointing between its rollouts; neither changes what
    an accepted call computes, so neither may cost a rebuild (every graph captured again). Where transformers drops
    the cache from checkpointed layers even without gradients, the call is refused instead
    (`test_defects_options::test_checkpointing_that_drops_the_cache_is_refused`)."""
    model = s3r_hf.enable(tiny_model("llama", seed=67).to(DEVICE))
    input_ids, attention_mask = _batch(seed=68)
    _greedy(model, input_ids, attention_mask, _config())
    pool = runtime_for(model).cache
    model.train()
    assert torch.equal(_greedy(model, input_ids, attention_mask, _config()), _greedy(model, input_ids, attention_mask))
    assert runtime_for(model).cache is pool
    # The flag alone: the input hook `gradient_checkpointing_enable` also registers is fingerprinted as any hook is.
    for layer in model.model.layers:
        layer.gradient_checkpointing = True
    if CHECKPOINTING_DROPS_THE_CACHE:
        with pytest.raises(ValueError, match="gradient checkpointing is on in training mode"):
            _greedy(model, input_ids, attention_mask, _config())
    else:
        out = _greedy(model, input_ids, attention_mask, _config())
        assert runtime_for(model).cache is pool
        assert torch.equal(out, _greedy(model, input_ids, attention_mask))
    s3r_hf.release(model)


def test_a_hook_added_between_calls_rebuilds_the_kept_state():
    """CUDA graphs replay the kernels of the forward they captured: a hook added (or removed) since runs only if
    the kept graphs are dropped."""
    model = s3r_hf.enable(tiny_model("llama", seed=53).to(DEVICE))
    input_ids, attention_mask = _batch(seed=54)
    _greedy(model, input_ids, attention_mask, _config())
    pool = runtime_for(model).cache
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: output * 2.0)
    _rebuilt_and_dense(model, input_ids, attention_mask, pool)
    handle.remove()
    assert torch.equal(_greedy(model, input_ids, attention_mask, _config()), _greedy(model, input_ids, attention_mask))
    s3r_hf.release(model)


def test_a_hook_from_the_same_factory_with_other_values_rebuilds_the_kept_state():
    """Hooks made by one factory share their code; a graph bakes in the values they close over, so a hook that
    replaces another of the same code but a different scale must drop the kept graphs too."""
    model = s3r_hf.enable(tiny_model("llama", seed=61).to(DEVICE))
    input_ids, attention_mask = _batch(seed=62)

    def scaled(factor: float):
        return lambda module, args, output: output * factor

    mlp = model.model.layers[1].mlp
    handle = mlp.register_forward_hook(scaled(2.0))
    _greedy(model, input_ids, attention_mask, _config())
    pool = runtime_for(model).cache
    handle.remove()
    handle = mlp.register_forward_hook(scaled(-3.0))
    _rebuilt_and_dense(model, input_ids, attention_mask, pool)
    handle.remove()
    s3r_hf.release(model)


def test_a_global_module_hook_added_between_calls_rebuilds_the_kept_state():
    """A hook registered for every module runs in the forwards a CUDA graph captures, as a module's own does: the
    kept graphs must go when one is added."""
    model = s3r_hf.enable(tiny_model("llama", seed=57).to(DEVICE))
    input_ids, attention_mask = _batch(seed=58)
    _greedy(model, input_ids, attention_mask, _config())
    pool = runtime_for(model).cache

    def doubled_mlps(module, args, output):
        return output * 2.0 if type(module).__name__.endswith("MLP") else None

    handle = torch.nn.modules.module.register_module_forward_hook(doubled_mlps)
    try:
        _rebuilt_and_dense(model, input_ids, attention_mask, pool)
    finally:
        handle.remove()
    s3r_hf.release(model)


@pytest.mark.parametrize("option", ["compile_layers", "fused_layers"])
@pytest.mark.parametrize("when", ["pre", "post"])
def test_global_module_hooks_are_refused_with_compiled_or_fused_layers(option, when):
    """Hooks registered for every module reach the parts of a decoder layer, which compiled and fused layers do not
    run as modules: refused, as a hook on one of those parts is (they were silently skipped)."""
    model = s3r_hf.enable(tiny_model("llama", seed=59).to(DEVICE))
    input_ids, attention_mask = _batch(seed=60)
    register = getattr(torch.nn.modules.module, f"register_module_forward{'_pre' if when == 'pre' else ''}_hook")
    handle = register(lambda module, *args: None)
    try:
        with pytest.raises(ValueError, match=rf"{option}=True.*global module forward hook"):
            _greedy(model, input_ids, attention_mask, _config(**{option: True}))
    finally:
        handle.remove()
    s3r_hf.release(model)


@pytest.mark.parametrize("option", ["compile_layers", "fused_layers"])
def test_hooks_inside_decoder_layers_are_refused_with_compiled_or_fused_layers(option):
    """Compiled layers replace the Q/K/V and gate/up linears by fused slices and fused layers call none of a layer's
    modules, so a hook on them would silently not run: refused by name. A hook on the layer itself still runs."""
    model = s3r_hf.enable(tiny_model("llama", seed=55).to(DEVICE))
    input_ids, attention_mask = _batch(seed=56)
    handle = model.model.layers[1].self_attn.k_proj.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match=rf"{option}=True.*'model.layers.1.self_attn.k_proj'"):
        _greedy(model, input_ids, attention_mask, _config(**{option: True}))
    handle.remove()
    calls = []
    model.model.layers[1].register_forward_hook(lambda module, args, output: calls.append(1))
    _greedy(model, input_ids, attention_mask, _config(keep_state=False))
    assert calls, "a hook on a decoder layer runs in engine forwards"
    s3r_hf.release(model)


@pytest.mark.parametrize("option", ["compile_layers", "fused_layers"])
def test_transformers_output_capturing_hooks_pass_with_compiled_or_fused_layers(option):
    """A forward asking for hidden states or attentions leaves transformers' output-capturing hooks on the layers'
    modules for good; they record only inside such a forward, so S3R's compiled and fused layers run beside them
    (they were refused as the user's hooks, with a remedy the user could not apply)."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=61, head_dim=32).to(DEVICE))
    input_ids, attention_mask = _batch(seed=62)
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask, output_hidden_states=True, output_attentions=True)
    attention = model.model.layers[0].self_attn
    assert attention._forward_hooks, "transformers no longer installs its capturing hooks: this test checks nothing"
    assert torch.equal(_greedy(model, input_ids, attention_mask, _config(**{option: True})),
                       _greedy(model, input_ids, attention_mask))
    handle = attention.register_forward_hook(lambda module, args, output: None)  # beside them, a user's hook
    with pytest.raises(ValueError, match=rf"{option}=True.*'model.layers.0.self_attn'"):
        _greedy(model, input_ids, attention_mask, _config(**{option: True}))
    handle.remove()
    s3r_hf.release(model)


def test_release_and_kept_state_free_the_pool():
    model = s3r_hf.enable(tiny_model("qwen3", seed=47).to(DEVICE))
    input_ids, attention_mask = _batch(seed=48)
    _greedy(model, input_ids, attention_mask, _config())
    pool = weakref.ref(runtime_for(model).cache)
    gc.collect()
    gc.disable()  # reference counting alone must free it
    try:
        s3r_hf.release(model)
        assert pool() is None
        with s3r_hf.kept_state(model):
            _greedy(model, input_ids, attention_mask, _config())
            pool = weakref.ref(runtime_for(model).cache)
            assert pool() is not None
        assert pool() is None
    finally:
        gc.enable()


def test_keep_state_false_frees_the_pool_when_the_call_returns():
    model = s3r_hf.enable(tiny_model("qwen3", seed=49).to(DEVICE))
    input_ids, attention_mask = _batch(seed=50)
    out = _greedy(model, input_ids, attention_mask, _config(keep_state=False))
    assert runtime_for(model).cache is None
    assert torch.equal(out, _greedy(model, input_ids, attention_mask))
    s3r_hf.release(model)


def test_the_kept_state_does_not_keep_the_model_alive():
    model = s3r_hf.enable(tiny_model("qwen3", seed=51).to(DEVICE))
    input_ids, attention_mask = _batch(seed=52)
    _greedy(model, input_ids, attention_mask, _config(compile_layers=True))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_a_failed_call_drops_the_kept_state():
    model = s3r_hf.enable(tiny_model("qwen3", seed=53).to(DEVICE))
    input_ids, attention_mask = _batch(seed=54)
    _greedy(model, input_ids, attention_mask, _config())

    class Failing:
        def __call__(self, input_ids, scores, **kwargs):
            raise RuntimeError("criterion failed")

    with pytest.raises(RuntimeError, match="criterion failed"):
        model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8,
                       stopping_criteria=[Failing()], s3r_config=_config())
    assert runtime_for(model).cache is None
    assert torch.equal(_greedy(model, input_ids, attention_mask, _config()), _greedy(model, input_ids, attention_mask))
    s3r_hf.release(model)


def _phase(processors: LogitsProcessorList, greedy: bool = False) -> DraftPhase:
    return DraftPhase(lambda ids, plan: None, RaggedLogitsProcessor(processors, 2), 3, 4, 0, greedy, 16)


def test_draft_phase_graphs_are_told_apart_by_their_processors():
    """A draft-phase graph bakes the logits processors in: a later call replays it only with equal settings."""
    warm = _phase(LogitsProcessorList([TemperatureLogitsWarper(0.7)]))
    same = _phase(LogitsProcessorList([TemperatureLogitsWarper(0.7)]))
    colder = _phase(LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
    assert DecodeGraphs.draft_variant(warm) == DecodeGraphs.draft_variant(same)
    assert DecodeGraphs.draft_variant(warm) != DecodeGraphs.draft_variant(colder)
    assert DecodeGraphs.draft_variant(warm) != DecodeGraphs.draft_variant(
        _phase(LogitsProcessorList([TemperatureLogitsWarper(0.7)]), greedy=True)
    )
    # Settings that are not plain scalars cannot be compared: each such phase is a variant of its own.
    opaque = TemperatureLogitsWarper(0.7)
    opaque.extra = torch.ones(1)
    first, second = _phase(LogitsProcessorList([opaque])), _phase(LogitsProcessorList([opaque]))
    assert first.signature is None
    assert DecodeGraphs.draft_variant(first) != DecodeGraphs.draft_variant(second)


@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs need S3R_HF_TEST_DEVICE=cuda")
def test_a_second_call_captures_no_graph():
    model = s3r_hf.enable(tiny_model("qwen3", seed=55).to(DEVICE))
    input_ids, attention_mask = _batch(seed=56)
    config = _config(compile_layers=True)
    sample = dict(do_sample=True, temperature=0.8, max_new_tokens=24, return_dict_in_generate=True)
    first = model.generate(input_ids, attention_mask=attention_mask, s3r_config=config, **sample)
    assert first.s3r_stats.graph_captures > 0
    second = model.generate(input_ids, attention_mask=attention_mask, s3r_config=config, **sample)
    assert second.s3r_stats.graph_captures == 0
    assert len(first.s3r_stats.captured_graphs) == first.s3r_stats.graph_captures
    assert second.s3r_stats.captured_graphs == []
    # Other sampling settings are other draft-phase graphs; the forward graphs stay.
    hotter = model.generate(input_ids, attention_mask=attention_mask, s3r_config=config,
                            **{**sample, "temperature": 1.2})
    assert 0 < hotter.s3r_stats.graph_captures < first.s3r_stats.graph_captures
    assert torch.equal(_greedy(model, input_ids, attention_mask, config), _greedy(model, input_ids, attention_mask))
    s3r_hf.release(model)


def test_a_longer_single_request_does_not_reuse_a_pool_it_cannot_fit():
    """One request that grew by less than the pool's tolerance still needs room for itself alone."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=59).to(DEVICE))
    input_ids, attention_mask = _batch(lengths=(12,), seed=60)
    _greedy(model, input_ids, attention_mask, _config(), max_new_tokens=30)
    pool = runtime_for(model).cache
    out = _greedy(model, input_ids, attention_mask, _config(), max_new_tokens=36)
    assert runtime_for(model).cache is not pool
    assert torch.equal(out, _greedy(model, input_ids, attention_mask, max_new_tokens=36))
    s3r_hf.release(model)


def test_graphs_are_captured_again_when_the_layers_they_replay_change():
    """A graph records the layers' kernels: a call with other compiled / fused layers, another draft matmul
    precision, another autocast dtype or another float32 matmul precision than the kept graphs were captured with gets
    new graphs rather than replaying the old layers."""
    model = tiny_model("qwen3", seed=62)
    runtime = ModelRuntime()
    cache = S3RCache(model.config, num_pages=64, page_size=4, max_requests=4)
    runtime.adopt_cache(cache, model, 64)
    config = _config()
    kept = runtime.graphs_for(10, config)
    assert runtime.graphs_for(10, _config()) is kept
    for change in ({"compile_layers": True}, {"fused_layers": True}, {"draft_matmul_precision": "highest"}):
        changed = dataclasses.replace(config, **change)
        graphs = runtime.graphs_for(10, changed)
        assert graphs is not kept
        assert runtime.graphs_for(10, changed) is graphs
        kept = runtime.graphs_for(10, config)
        assert kept is not graphs
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's dtype is part of what a capture records
        graphs = runtime.graphs_for(10, config)
        assert graphs is not kept and runtime.graphs_for(10, config) is graphs
    kept = runtime.graphs_for(10, config)
    assert kept is not graphs
    # So is the float32 matmul precision the user set (TF32 or not: cuBLAS picks other kernels).
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "highest" else "highest")
    try:
        graphs = runtime.graphs_for(10, config)
        assert graphs is not kept and runtime.graphs_for(10, config) is graphs
    finally:
        torch.set_float32_matmul_precision(precision)
    assert runtime.graphs_for(10, config) is not graphs


def test_graphs_serve_later_steps_with_prompts_several_times_longer():
    """RL prompts vary several-fold in length; the kept graphs are sized for at least `GRAPH_MIN_TOKENS` tokens per
    request, so a step whose longest request is four times the first's replays them instead of capturing again."""
    model = tiny_model("qwen3", seed=61)
    runtime = ModelRuntime()
    cache = S3RCache(model.config, num_pages=64, page_size=4, max_requests=4)
    runtime.adopt_cache(cache, model, 64)
    config = _config()
    first = runtime.graphs_for(10, config)  # 40 tokens per request
    assert first.max_pages * 4 >= GRAPH_MIN_TOKENS
    assert runtime.graphs_for(40, config) is first
    assert runtime.graphs_for(GRAPH_MIN_TOKENS // 4, config) is first
    longer = runtime.graphs_for(GRAPH_MIN_TOKENS // 4 + 1, config)  # past the graphs' block tables
    assert longer is not first and longer.max_pages >= (GRAPH_MIN_TOKENS // 4 + 1) * GRAPH_HEADROOM
