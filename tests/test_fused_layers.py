"""Fused decoder layers (`S3RConfig.fused_layers`): the Triton kernels against their torch reference, the fused
engine against dense decoding (greedy identity on Llama, Qwen2 and Qwen3; the G-test and its power check), weights
read live, and refusals that name what does not fit.

On CPU the engine runs the reference functions (`layer_reference`) and the kernels run through Triton's interpreter;
with `S3R_HF_TEST_DEVICE=cuda` everything runs on the GPU, the G-test also with CUDA graphs.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import s3r_hf
from s3r_hf import S3RConfig, fused_layers
from s3r_hf.kernels import layer_reference
from s3r_hf.lm_head import autocast_changes
from s3r_hf.matmul_precision import float32_matmul_precision
from s3r_hf.validation import UnsupportedModelError
from tests.conftest import TINY, left_padded_batch, tiny_model
from tests.exact_distribution import (
    count_continuations,
    exact_continuation_distribution,
    g_test,
    sampling_warpers,
    tiny_enumerable_model,
)

layer_triton = pytest.importorskip("s3r_hf.kernels.layer_triton", reason="triton is not installed")

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
# The interpreter has no bfloat16 arithmetic: float16 stands in for the half-precision path on CPU.
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32, torch.float16]
FUSABLE = dict(head_dim=32)  # the kernels need a head dimension of 32, 64 or 128


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance)


def _qkv_inputs(rows, hidden, head_dim, heads, kv_heads, dtype, bias, head_norm, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)

    angles = torch.randn(rows, head_dim // 2, generator=generator)
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype).to(DEVICE)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype).to(DEVICE)
    return dict(
        x=randn(rows, hidden), norm_weight=1 + randn(hidden, scale=0.1), eps=1e-6,
        q_weight=randn(heads * head_dim, hidden, scale=0.1), k_weight=randn(kv_heads * head_dim, hidden, scale=0.1),
        v_weight=randn(kv_heads * head_dim, hidden, scale=0.1),
        q_bias=randn(heads * head_dim) if bias else None, k_bias=randn(kv_heads * head_dim) if bias else None,
        v_bias=randn(kv_heads * head_dim) if bias else None, cos=cos, sin=sin, head_dim=head_dim,
        q_norm_weight=1 + randn(head_dim, scale=0.1) if head_norm else None,
        k_norm_weight=1 + randn(head_dim, scale=0.1) if head_norm else None,
        # Distinct epsilons, as a model may hold: a kernel that used one for both heads would not match.
        q_norm_eps=1e-6, k_norm_eps=0.25,
    )


# ---------------------------------------------------------------------------------------------- kernels
@pytest.fixture(params=["chosen", "split"])
def launch(request, monkeypatch):
    """The kernels at their chosen launch settings, and with 16-wide K blocks split over several programs (a
    96-long reduction is six blocks: three splits of two; 80 is five: three splits of two, two and one) and the
    norm's pass over the row as a loop, as for rows wider than `UNROLLED_NORM_MAX`."""
    if request.param == "split":
        monkeypatch.setattr(layer_triton, "LAUNCH_OVERRIDE", (16, 1, 4))
        monkeypatch.setattr(layer_triton, "MAX_SPLITS", 4)
        monkeypatch.setattr(layer_triton, "UNROLLED_NORM_MAX", 0)
    yield request.param
    # Every device's buffer: keyed by `torch.device("cuda", 0)`, it is not found under `torch.device("cuda")`.
    assert not any(counts.any() for counts in layer_triton._arrival_counts.values()), (
        "a split launch left its arrival counts set"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 24, 40])
@pytest.mark.parametrize("variant", ["llama", "qwen2-bias", "qwen3-head-norm"])
def test_norm_qkv_rope_matches_reference(dtype, rows, variant, launch):
    inputs = _qkv_inputs(rows, 96, 32, heads=3, kv_heads=1, dtype=dtype, bias=variant == "qwen2-bias",
                         head_norm=variant == "qwen3-head-norm")
    expected = layer_reference.norm_qkv_rope(**inputs)
    actual = layer_triton.norm_qkv_rope(**inputs)
    assert actual.shape == (rows, 5, 32) and actual.dtype == dtype
    _close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [7, 24])
@pytest.mark.parametrize("variant", ["llama", "qwen3-head-norm"])
def test_norm_qkv_rope_writes_the_pools_as_the_cache_does(dtype, rows, variant, launch):
    """With pools the kernel also writes each row's keys and values at its flat pool row (the cache's K/V write,
    fused): the same values as the reference writes, in the same places, and nothing anywhere else."""
    inputs = _qkv_inputs(rows, 96, 32, heads=3, kv_heads=2, dtype=dtype, bias=False,
                         head_norm=variant == "qwen3-head-norm")
    pool_rows = torch.randperm(4 * 8, generator=torch.Generator().manual_seed(4))[:rows].to(DEVICE)
    heads = layer_reference.norm_qkv_rope(**inputs)
    pools = {}
    for name, ops in (("reference", layer_reference), ("triton", layer_triton)):
        key_pool, value_pool = (torch.full((4, 8, 2, 32), -7.0, dtype=dtype, device=DEVICE) for _ in range(2))
        out = ops.norm_qkv_rope(**inputs, key_pool=key_pool, value_pool=value_pool, pool_rows=pool_rows)
        _close(out, heads, dtype)
        pools[name] = key_pool.view(-1, 2, 32), value_pool.view(-1, 2, 32), out
    for index in range(2):
        actual, expected = pools["triton"][index], pools["reference"][index]
        _close(actual, expected, dtype)
        untouched = torch.ones(actual.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[pool_rows] = False
        assert (actual[untouched] == -7.0).all()
        # The pools hold what the kernel returned, bit for bit: keys after the queries, values last.
        torch.testing.assert_close(actual[pool_rows], pools["triton"][2][:, 3 + 2 * index : 5 + 2 * index],
                                   atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 24, 33])
def test_norm_gate_up_silu_matches_reference(dtype, rows, launch):
    generator = torch.Generator().manual_seed(1)
    x, norm, gate, up = (
        (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)
        for shape, scale in (((rows, 96), 1.0), ((96,), 1.0), ((80, 96), 0.1), ((80, 96), 0.1))
    )
    expected = layer_reference.norm_gate_up_silu(x, norm, 1e-5, gate, up)
    actual = layer_triton.norm_gate_up_silu(x, norm, 1e-5, gate, up)
    assert actual.shape == (rows, 80)
    _close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_residual_matches_reference(dtype, bias, launch):
    generator = torch.Generator().manual_seed(2)
    x, weight, residual, b = (
        (torch.randn(*shape, generator=generator) * scale).to(dtype).to(DEVICE)
        for shape, scale in (((17, 80), 1.0), ((96, 80), 0.1), ((17, 96), 1.0), ((96,), 1.0))
    )
    expected = layer_reference.linear_residual(x, weight, b if bias else None, residual)
    actual = layer_triton.linear_residual(x, weight, b if bias else None, residual)
    _close(actual, expected, dtype)
    # Split partial sums are added in split order, not in arrival order: every launch gives the same bits.
    assert torch.equal(layer_triton.linear_residual(x, weight, b if bias else None, residual), actual)


# `(rows, attention width, hidden, intermediate)` of `mlp_block`: partial tiles everywhere, one and two 16-row blocks
# and two 64-row blocks; on CUDA also SmolLM2's widths at a verify block's rows, where many programs wait on others.
MLP_SHAPES = [(1, 80, 96, 72), (24, 80, 96, 72), (70, 64, 80, 104)] + (
    [(448, 576, 576, 1536)] if DEVICE.type == "cuda" else []
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MLP_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_mlp_block_matches_reference(dtype, shape, bias, persistent, monkeypatch):
    """`mlp_block` as three launches and as one persistent launch (16-wide K blocks there: several per tile)."""
    monkeypatch.setattr(layer_triton, "PERSISTENT_MLP", persistent)
    if persistent:
        monkeypatch.setattr(layer_triton, "LAUNCH_OVERRIDE", (16, 1, 4))
    rows, width, hidden, inter = shape
    generator = torch.Generator().manual_seed(4)
    attended, o, o_bias, x, norm, gate, up, down = (
        (torch.randn(*size, generator=generator) * scale).to(dtype).to(DEVICE)
        for size, scale in (((rows, width), 1.0), ((hidden, width), width**-0.5), ((hidden,), 1.0),
                            ((rows, hidden), 1.0), ((hidden,), 0.1), ((inter, hidden), hidden**-0.5),
                            ((inter, hidden), hidden**-0.5), ((hidden, inter), inter**-0.5))
    )
    args = (attended, o, o_bias if bias else None, x, 1 + norm, 1e-5, gate, up, down)
    actual = layer_triton.mlp_block(*args)
    _close(actual, layer_reference.mlp_block(*args), dtype)
    # The same bits in every launch, whichever program claims which tile; the counters are left at zero.
    assert torch.equal(layer_triton.mlp_block(*args), actual)
    assert not any(counts.any() for counts in layer_triton._arrival_counts.values()), "the launch left its counters set"


def test_mlp_block_reference_is_the_three_steps():
    generator = torch.Generator().manual_seed(5)
    attended, o, x, norm, gate, up, down = (
        torch.randn(*size, generator=generator)
        for size in ((3, 8), (12, 8), (3, 12), (12,), (10, 12), (10, 12), (12, 10))
    )
    mixed = layer_reference.linear_residual(attended, o, None, x)
    expected = layer_reference.linear_residual(
        layer_reference.norm_gate_up_silu(mixed, norm, 1e-6, gate, up), down, None, mixed
    )
    assert torch.equal(layer_reference.mlp_block(attended, o, None, x, norm, 1e-6, gate, up, down), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 30, 40, 130])
def test_lm_head_matches_reference(dtype, rows):
    """One and two 16-row blocks, one and two 128-row blocks; a vocabulary that leaves the last 128-column tile
    partly empty, a hidden size of several K tiles with a partial last one."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 80, generator=generator).to(dtype).to(DEVICE)
    weight = (torch.randn(300, 80, generator=generator) * 0.1).to(dtype).to(DEVICE)
    actual = layer_triton.lm_head(x, weight)
    assert actual.shape == (rows, 300) and actual.dtype == dtype
    _close(actual, layer_reference.lm_head(x, weight), dtype)
    assert layer_triton.lm_head(x[:0], weight).shape == (0, 300)


def test_float32_products_follow_torchs_tf32_switch(launch):
    """float32 products run as three TF32 products (float32's accuracy, the tests above) unless torch allows TF32 for
    float32 matmuls, as the draft passes do (`S3RConfig.draft_matmul_precision`): then as one, like cuBLAS. Half
    precision is unaffected. On CUDA the TF32 kernel agrees with the reference under the same switch, within TF32's
    rounding, and differs from the float32-accurate kernel."""
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default, which every other test here runs under
    generator = torch.Generator().manual_seed(3)
    x, weight, residual = (
        (torch.randn(*shape, generator=generator) * scale).to(DEVICE)
        for shape, scale in (((17, 80), 1.0), ((96, 80), 0.1), ((17, 96), 1.0))
    )
    accurate = layer_triton.linear_residual(x, weight, None, residual)
    assert layer_triton._dot_precision(torch.float32) == "tf32x3"
    with float32_matmul_precision("high"):
        assert layer_triton._dot_precision(torch.float32) == "tf32"
        assert layer_triton._dot_precision(torch.float16) == layer_triton._dot_precision(torch.bfloat16) == "tf32"
        expected = layer_reference.linear_residual(x, weight, None, residual)
        actual = layer_triton.linear_residual(x, weight, None, residual)
    torch.testing.assert_close(actual, expected, atol=1e-2, rtol=1e-2)
    if DEVICE.type == "cuda":  # the interpreter computes every precision in float32
        assert not torch.equal(actual, accurate)


@pytest.mark.parametrize(
    "rows, columns, inner, expected", [(64, 576, 576, 3), (64, 576, 1536, 4), (64, 2048, 6144, 2), (448, 4096, 2048, 1)]
)
def test_split_count_fills_the_sms_without_empty_programs(rows, columns, inner, expected, monkeypatch):
    """SmolLM2's O projection (18 column tiles, 9 K blocks) and down projection (18 tiles, 24 blocks), Qwen3-1.7B's
    down projection (64 tiles) at 64 rows, and a verify block whose 448 tiles fill the SMs unsplit."""
    monkeypatch.setattr(layer_triton, "_sm_count", lambda device: 132)
    monkeypatch.setattr(layer_triton, "LAUNCH_OVERRIDE", (64, 3, 4))
    tiles = layer_triton._tiles(DEVICE, rows, columns, inner, torch.bfloat16)
    splits, grid = tiles.splits, tiles.grid
    assert splits == expected and grid[2] == splits
    assert grid[0] * grid[1] * splits <= 132 or splits == 1
    k_blocks = -(-inner // 64)
    assert tiles.blocks_per_split == -(-k_blocks // splits)
    assert -(-k_blocks // splits) * (splits - 1) < k_blocks  # the last split has K blocks too


def test_reference_layer_equals_the_models_own_layer():
    """The reference functions chained as `fused_forward` chains them compute the model's decoder layer (fp32)."""
    model = tiny_model("qwen3", **FUSABLE)
    layer = model.model.layers[0]
    parts = fused_layers.layer_parts(layer)
    hidden = torch.randn(1, 9, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    positions = torch.arange(9)[None]
    cos, sin = model.model.rotary_emb(hidden, positions)
    qkv = layer_reference.norm_qkv_rope(
        hidden[0], parts.input_norm.weight, parts.input_norm.variance_epsilon, parts.q.weight, parts.k.weight,
        parts.v.weight, None, None, None, cos[0], sin[0], parts.head_dim, parts.q_norm.weight, parts.k_norm.weight,
        parts.q_norm.variance_epsilon, parts.k_norm.variance_epsilon,
    )
    heads, kv_heads = TINY["num_attention_heads"], TINY["num_key_value_heads"]
    q, k, v = (t.transpose(0, 1) for t in qkv.split([heads, kv_heads, kv_heads], dim=1))  # [H, N, D]
    group = heads // kv_heads
    attended = torch.nn.functional.scaled_dot_product_attention(
        q[None], k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None], is_causal=True,
        scale=parts.attention.scaling,
    )[0].transpose(0, 1).reshape(9, -1)
    mixed = layer_reference.linear_residual(attended, parts.o.weight, None, hidden[0])
    activated = layer_reference.norm_gate_up_silu(
        mixed, parts.post_norm.weight, parts.post_norm.variance_epsilon, parts.gate.weight, parts.up.weight
    )
    fused = layer_reference.linear_residual(activated, parts.down.weight, None, mixed)
    with torch.no_grad():
        own = layer(hidden, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)
    own = own[0] if isinstance(own, tuple) else own
    torch.testing.assert_close(fused, own[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- engine
def _qwen2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**{**TINY, **FUSABLE})).eval()  # biased Q/K/V
    with torch.no_grad():  # biases start at zero: make them count
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.self_attn, name).bias.normal_(0, 0.5)
    return model


@pytest.fixture
def count_fused(monkeypatch):
    """How many layer forwards ran fused."""
    calls = []
    real = fused_layers.fused_forward
    monkeypatch.setattr(fused_layers, "fused_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("kind", ["llama", "llama-biased", "qwen2", "qwen3"])
def test_fused_greedy_equals_dense_and_the_layers_are_restored(kind, count_fused):
    """Llama; Llama with `attention_bias` (Q/K/V and O biased); Qwen2 (Q/K/V biased); Qwen3 (per-head norms)."""
    if kind == "qwen2":
        model = _qwen2()
    elif kind == "llama-biased":
        model = tiny_model("llama", attention_bias=True, **FUSABLE)
        with torch.no_grad():  # biases start at zero: make them count
            for layer in model.model.layers:
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(layer.self_attn, name).bias.normal_(0, 0.5)
    else:
        model = tiny_model(kind, **FUSABLE)
    model = s3r_hf.enable(model.to(DEVICE))
    ids, mask = left_padded_batch([12, 7, 15], seed=4)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         s3r_config=S3RConfig(min_budget=4, fused_layers=True, adaptive=False))
    assert torch.equal(out, dense)
    assert count_fused, "no layer forward ran fused"
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def test_prefill_chunks_above_the_limit_run_the_layers_own_forward(monkeypatch, count_fused):
    """Forwards of more than FUSED_MAX_TOKENS tokens (here: the prompts) run the model's layers; decode-shaped ones
    run fused; the output is dense decoding's either way."""
    monkeypatch.setattr(fused_layers, "FUSED_MAX_TOKENS", 12)
    model = s3r_hf.enable(tiny_model("llama", **FUSABLE).to(DEVICE))
    ids, mask = left_padded_batch([30, 25], seed=5)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                         s3r_config=S3RConfig(min_budget=4, fused_layers=True, adaptive=False))
    assert torch.equal(out, dense)
    assert count_fused


def test_fused_layers_read_the_weights_of_the_moment(count_fused):
    """No weight copy goes stale: an in-place update between calls (an optimizer step) shows in the next call."""
    model = s3r_hf.enable(tiny_model("qwen3", **FUSABLE).to(DEVICE))
    ids, mask = left_padded_batch([10, 14], seed=6)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    config = S3RConfig(min_budget=4, fused_layers=True, adaptive=False)
    model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, s3r_config=config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-3.0)
            layer.self_attn.q_norm.weight.add_(0.5)
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, s3r_config=config)
    assert torch.equal(out, dense)


def test_fused_layers_use_each_head_norms_own_epsilon(count_fused):
    """Qwen3's q_norm and k_norm each have their own `variance_epsilon`; the fused kernel once used q_norm's for
    both, and a model whose two differ decoded otherwise than dense."""
    model = s3r_hf.enable(tiny_model("qwen3", initializer_range=0.2, **FUSABLE).to(DEVICE))
    ids, mask = left_padded_batch([9, 13, 6], seed=7)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
    before = model.generate(ids, **kwargs)
    for layer in model.model.layers:
        layer.self_attn.k_norm.variance_epsilon = 5.0
    dense = model.generate(ids, **kwargs)
    assert not torch.equal(dense, before), "the epsilon should change dense decoding"
    out = model.generate(ids, **kwargs, s3r_config=S3RConfig(min_budget=4, fused_layers=True, adaptive=False))
    assert torch.equal(out, dense)
    assert count_fused


def test_under_autocast_to_another_dtype_the_layers_run_their_own_forward(count_fused):
    """`accelerate`'s mixed precision runs a float32 model's forward under bf16 autocast, which the kernels would
    ignore: those layers run their own forward, so S3R computes what the model computes. Autocast to the weights'
    own dtype leaves the fused layers on."""
    autocast_dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    model = s3r_hf.enable(tiny_model("llama", **FUSABLE).to(DEVICE))
    ids, mask = left_padded_batch([10, 13], seed=8)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    options = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True)
    outputs = {}
    with torch.autocast(DEVICE.type, dtype=autocast_dtype):
        for fused in (False, True):
            config = S3RConfig(min_budget=4, fused_layers=fused, adaptive=False)
            outputs[fused] = model.generate(ids, attention_mask=mask, s3r_config=config, **options)
    assert not count_fused
    assert torch.equal(outputs[True].sequences, outputs[False].sequences)
    for fused_scores, own_scores in zip(outputs[True].scores, outputs[False].scores):
        assert torch.equal(fused_scores, own_scores)
    with torch.autocast(DEVICE.type, dtype=autocast_dtype):
        assert not autocast_changes(autocast_dtype, DEVICE)
        assert autocast_changes(torch.float32, DEVICE)


def test_unfusable_models_are_refused_with_the_reason():
    model = s3r_hf.enable(tiny_model("llama"))  # head_dim 16
    ids, mask = left_padded_batch([6], seed=7)
    with pytest.raises(UnsupportedModelError, match="head_dim 16"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, s3r_config=S3RConfig(fused_layers=True))
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    wide = s3r_hf.enable(tiny_model("llama", head_dim=256))
    with pytest.raises(UnsupportedModelError, match="head_dim 256"):
        wide.generate(ids, attention_mask=mask, max_new_tokens=4, s3r_config=S3RConfig(fused_layers=True))
    with pytest.raises(ValueError, match="fused_layers must be a bool"):
        S3RConfig(fused_layers="yes")


# ---------------------------------------------------------------------------------------------- G-test
PROMPT_LEN, NEW_TOKENS, VOCAB = 24, 4, 8
S3R = dict(adaptive=False, draft_len=2, budget_ratio=0.05, min_budget=1, page_size=4, fused_layers=True)
# "+persistent-mlp": `mlp_block` as one persistent launch (`layer_triton.PERSISTENT_MLP`; the reference on CPU has one
# path only).
RUNTIMES = (
    {"eager": {}, "graphs": {"cuda_graphs": True}, "graphs+persistent-mlp": {"cuda_graphs": True}}
    if DEVICE.type == "cuda" else {"eager": {}}
)


@pytest.fixture(scope="module")
def enumerable():
    """A fusable enumerable model (head_dim 32) on the CPU, its copy on `DEVICE`, a prompt, the exact law."""
    torch.set_num_threads(1)
    model = s3r_hf.enable(tiny_enumerable_model(VOCAB, seed=0, attention_gain=8.0, output_gain=8.0, **FUSABLE))
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(100))
    sampler = model if DEVICE.type == "cpu" else s3r_hf.enable(copy.deepcopy(model).to(DEVICE))
    probs, _ = exact_continuation_distribution(model, prompt, NEW_TOKENS, sampling_warpers(temperature=1.0))
    return sampler, prompt, probs


def _fused_samples(sampler, prompt, samples: int, mode: str, runtime: dict) -> torch.Tensor:
    out = sampler.generate(
        prompt.to(sampler.device), attention_mask=torch.ones_like(prompt).to(sampler.device), do_sample=True,
        temperature=1.0, top_k=None, top_p=None, max_new_tokens=NEW_TOKENS, num_return_sequences=samples,
        return_dict_in_generate=True, s3r_config=S3RConfig(**S3R, seed=11, **runtime), s3r_mode=mode,
    )
    stats = out.s3r_stats
    if mode == "s3r":
        assert 0 < stats.accepted < stats.drafted, "the drafter must be accepted and rejected both"
    return out.sequences.cpu()


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_fused_s3r_samples_follow_the_exact_dense_distribution(enumerable, runtime, count_fused, monkeypatch):
    monkeypatch.setattr(layer_triton, "PERSISTENT_MLP", runtime.endswith("+persistent-mlp"))
    sampler, prompt, probs = enumerable
    sequences = _fused_samples(sampler, prompt, 10_000, "s3r", RUNTIMES[runtime])
    assert count_fused
    result = g_test(count_continuations(sequences, PROMPT_LEN, VOCAB, NEW_TOKENS), probs)
    assert result["impossible"] == 0 and result["dof"] >= 40
    assert result["p_value"] > 1e-3, f"fused S3R samples are not distributed as dense sampling: {result}"


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_fused_unverified_drafts_are_rejected(enumerable, runtime, monkeypatch):
    """Power: the same test tells the fused sparse drafter's own samples from the dense law."""
    monkeypatch.setattr(layer_triton, "PERSISTENT_MLP", runtime.endswith("+persistent-mlp"))
    sampler, prompt, probs = enumerable
    sequences = _fused_samples(sampler, prompt, 2_500, "unverified", RUNTIMES[runtime])
    counts = count_continuations(sequences, PROMPT_LEN, VOCAB, NEW_TOKENS)
    result = g_test(counts, probs, exclude_impossible=True)
    assert result["p_value"] < 1e-6, f"the test failed to reject unverified fused drafts: {result}"


@pytest.mark.parametrize("persistent", [False, True])
def test_fused_greedy_with_the_triton_kernels_equals_dense(persistent, monkeypatch):
    """The engine with the Triton layer and attention kernels (the interpreter on CPU), kept small: the interpreter
    runs each program in Python. With `persistent`, `mlp_block` runs as one launch."""
    monkeypatch.setattr(layer_triton, "PERSISTENT_MLP", persistent)
    calls = []
    for name in ("norm_qkv_rope", "mlp_block"):
        real = getattr(layer_triton, name)
        monkeypatch.setattr(layer_triton, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    model = s3r_hf.enable(tiny_model("qwen3", seed=21, **FUSABLE).to(DEVICE))
    ids, mask = (t.to(DEVICE) for t in left_padded_batch([9, 5], seed=22))
    dense = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6)
    monkeypatch.setenv("S3R_HF_KERNELS", "triton")
    config = S3RConfig(adaptive=False, draft_len=2, min_budget=2, page_size=4, fused_layers=True)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, s3r_config=config)
    assert torch.equal(out, dense)
    assert calls, "the Triton layer kernels did not run"


def test_layer_backend_selection(monkeypatch):
    from s3r_hf.kernels import get_layer_backend

    assert get_layer_backend("cpu") is layer_reference
    monkeypatch.setenv("S3R_HF_KERNELS", "triton")
    assert get_layer_backend("cpu") is layer_triton
