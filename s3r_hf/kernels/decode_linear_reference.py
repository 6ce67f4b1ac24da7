"""A linear layer at decode row counts with half-precision or 8-bit weights: the torch reference of
`decode_linear_triton.decode_linear`, and the quantization of weights to int8 or float8 (e4m3) with a scale per output
feature. Torch only, so the CPU engine runs it without Triton."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
INT8_MAX = 127
QUANTIZED = (FP8, torch.int8)  # weight dtypes that come with a scale per output feature


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """`(quantized weight, float32 scale per output feature)` with `weight ~= quantized.float() * scale[:, None]`:
    each row scaled so that its largest magnitude is the largest value of `dtype` (float8 e4m3, or int8 rounded to
    the nearest integer)."""
    if dtype not in QUANTIZED:
        raise ValueError(f"quantize_rows: weights quantize to {QUANTIZED}, not {dtype}")
    amax = weight.detach().abs().amax(dim=1).float().clamp(min=1e-12)
    scale = amax / (FP8_MAX if dtype == FP8 else INT8_MAX)
    scaled = weight.detach().float() / scale[:, None]
    if dtype == torch.int8:
        scaled = scaled.round().clamp(-INT8_MAX, INT8_MAX)
    return scaled.to(dtype), scale


def decode_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                            launch: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """`x @ (weight * scale[:, None]).T` in float32, returned in `x`'s dtype; `launch` is the kernel's and ignored."""
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    return (x.float() @ w.T).to(x.dtype)
