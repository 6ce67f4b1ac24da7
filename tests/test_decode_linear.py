"""`decode_linear`, the Triton linear at decode row counts, against its torch reference: half-precision and float8
weights with a scale per output feature or per group, split and unsplit K, ragged shapes; and its refusals.

On CPU the kernel runs under Triton's interpreter, which has no bfloat16 arithmetic (float16 stands in for it);
with `S3R_HF_TEST_DEVICE=cuda` it runs on the GPU in bfloat16 and float16.
"""

from __future__ import annotations

import os

import pytest
import torch

from s3r_hf.kernels import decode_linear_reference as reference

decode_linear = pytest.importorskip("s3r_hf.kernels.decode_linear_triton", reason="triton is not installed")

DEVICE = torch.device(os.environ.get("S3R_HF_TEST_DEVICE", "cpu"))
DTYPES = [torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [torch.float16]
# (BLOCK_N, BLOCK_K, splits, warps, stages); None is the default choice
LAUNCHES = [None, (64, 64, 1, 4, 2), (32, 64, 3, 4, 2), (64, 128, 8, 4, 3)]


def _inputs(rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(dtype).to(DEVICE)
    weight = (torch.randn(out_features, in_features, generator=generator) * in_features**-0.5).to(dtype).to(DEVICE)
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("shape", [(5, 96, 128), (64, 256, 512), (17, 130, 300), (33, 64, 1000)])
def test_kernel_matches_reference(shape, launch, dtype):
    x, weight = _inputs(*shape, dtype)
    expected = reference.decode_linear_reference(x, weight)
    out = decode_linear.decode_linear(x, weight, launch=launch)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=4e-3, rtol=1e-2)


@pytest.mark.parametrize("quantized", [torch.float8_e4m3fn, torch.int8], ids=["float8", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launch", [None, (64, 64, 1, 4, 2), (32, 64, 4, 4, 2)])
def test_quantized_weights_match_their_reference(launch, dtype, quantized):
    x, weight = _inputs(40, 192, 384, dtype, seed=1)
    weight8, scale = reference.quantize_rows(weight, quantized)
    assert weight8.dtype == quantized and scale.shape == (192,)
    expected = reference.decode_linear_reference(x, weight8, scale)
    out = decode_linear.decode_linear(x, weight8, scale, launch=launch)
    torch.testing.assert_close(out.float(), expected.float(), atol=4e-3, rtol=1e-2)
    # The reference is the quantized product, not the original one: the two differ by the weights' rounding
    original = reference.decode_linear_reference(x, weight).float()
    assert 1e-3 < (expected.float() - original).abs().max() < 0.3


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launch", [None, (64, 256, 1, 4, 2), (32, 64, 3, 4, 2)])
def test_weights_with_a_scale_per_group_match_their_reference(launch, dtype, group):
    x, weight = _inputs(40, 96, 384, dtype, seed=3)
    # The first group of each row is far larger, and the rows read none of it: a scale per row would round the rest
    # on the large group's scale, a scale per group on their own
    weight[:, :group] *= 50
    x[:, :group] = 0
    weight8, scale = reference.quantize_rows(weight, torch.int8, group=group)
    assert scale.shape == (96, 384 // group)
    expected = reference.decode_linear_reference(x, weight8, scale)
    out = decode_linear.decode_linear(x, weight8, scale, launch=launch)
    torch.testing.assert_close(out.float(), expected.float(), atol=4e-3, rtol=1e-2)
    per_row = reference.decode_linear_reference(x, *reference.quantize_rows(weight, torch.int8)).float()
    original = reference.decode_linear_reference(x, weight).float()
    assert (expected.float() - original).abs().max() < (per_row - original).abs().max() / 8


@pytest.mark.parametrize("quantized", [torch.float8_e4m3fn, torch.int8], ids=["float8", "int8"])
def test_quantize_rows_keeps_each_row_within_its_scale(quantized):
    _, weight = _inputs(1, 64, 256, torch.float32, seed=2)
    weight[3] *= 100  # rows of very different magnitude keep their own scales
    weight8, scale = reference.quantize_rows(weight, quantized)
    restored = weight8.float() * scale[:, None]
    error = (restored - weight).abs()
    largest = reference.FP8_MAX if quantized == torch.float8_e4m3fn else reference.INT8_MAX
    assert weight8.float().abs().amax(dim=1).eq(largest).all()
    if quantized == torch.int8:  # half a step of the row's scale
        assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()
    else:  # e4m3 keeps three mantissa bits: within 1/16 of each weight, or of the smallest normal's spacing
        assert (error <= weight.abs() / 16 + scale[:, None] * 2**-9).all()
    with pytest.raises(ValueError, match="quantize to"):
        reference.quantize_rows(weight, torch.float16)
    with pytest.raises(ValueError, match="a group of 96 weights does not divide rows of 256"):
        reference.quantize_rows(weight, quantized, group=96)


def test_refusals_name_the_problem():
    x, weight = _inputs(4, 32, 64, DTYPES[0])
    with pytest.raises(ValueError, match="do not multiply"):
        decode_linear.decode_linear(x, weight[:, :32])
    weight8, scale = reference.quantize_rows(weight)
    with pytest.raises(ValueError, match="scale per output feature"):
        decode_linear.decode_linear(x, weight8)
    with pytest.raises(ValueError, match="scale per output feature"):
        decode_linear.decode_linear(x, reference.quantize_rows(weight, torch.int8)[0])
    with pytest.raises(ValueError, match="scale per output feature"):
        decode_linear.decode_linear(x, weight, scale)
    weight8, group_scale = reference.quantize_rows(weight, torch.int8, group=32)
    with pytest.raises(ValueError, match="groups of 64 or 128 weights"):
        decode_linear.decode_linear(x, weight8, group_scale)
