"""A linear layer at decode row counts with half-precision or 8-bit weights: the torch reference of
`decode_linear_triton.decode_linear`, and the quantization of weights to int8 or float8 (e4m3) with a scale per output
feature, or per group of consecutive weights along a row. Torch only, so the CPU engine runs it without Triton."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
INT8_MAX = 127
QUANTIZED = (FP8, torch.int8)  # weight dtypes that come with scales


def quantize_rows(weight: torch.Tensor, dtype: torch.dtype = FP8, group: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(quantized weight, float32 scales)` with `weight ~= quantized.float() * scale[:, None]`: each row scaled so
    that its largest magnitude is the largest value of `dtype` (float8 e4m3, or int8 rounded to the nearest integer).
    With `group`, each run of `group` consecutive weights of a row has its own scale: `scale` is
    `[out_features, in_features // group]`, and `weight ~= quantized.float() * scale.repeat_interleave(group, 1)`."""
    if dtype not in QUANTIZED:
        raise ValueError(f"quantize_rows: weights quantize to {QUANTIZED}, not {dtype}")
    if group is not None:
        if group < 1 or weight.shape[1] % group:
            raise ValueError(f"quantize_rows: a group of {group} weights does not divide rows of {weight.shape[1]}")
        quantized, scale = quantize_rows(weight.reshape(-1, group), dtype)
        return quantized.view(weight.shape), scale.view(weight.shape[0], -1)
    amax = weight.detach().abs().amax(dim=1).float().clamp(min=1e-12)
    scale = amax / (FP8_MAX if dtype == FP8 else INT8_MAX)
    scaled = weight.detach().float() / scale[:, None]
    if dtype == torch.int8:
        scaled = scaled.round().clamp(-INT8_MAX, INT8_MAX)
    return scaled.to(dtype), scale


def decode_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                            launch: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """`x @ (weight * scale).T` in float32, returned in `x`'s dtype, with `scale` per output feature `[N]` or per
    group `[N, K // group]` (`quantize_rows`); `launch` is the kernel's and ignored."""
    if scale is None:
        w = weight.float()
    elif scale.dim() == 1:
        w = weight.float() * scale.float()[:, None]
    else:
        w = weight.float() * scale.float().repeat_interleave(weight.shape[1] // scale.shape[1], dim=1)
    return (x.float() @ w.T).to(x.dtype)
