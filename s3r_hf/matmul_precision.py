"""`float32_matmul_precision`: float32 CUDA matmuls on TF32 tensor cores inside a block, for the draft passes
(`S3RConfig.draft_matmul_precision`).

torch keeps the setting per process, so while it is on, float32 matmuls launched by any thread run in TF32. The
engine therefore sets it only around work it launches itself: an eager draft pass, or the capture of a draft graph
(a captured graph keeps the kernels chosen then, so its replays need no setting at all).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _tf32_setting() -> tuple[str, object, object]:
    """`(attribute of torch.backends.cuda.matmul, its value now, its value for TF32)` of the setting the process uses.
    torch has two, the legacy `allow_tf32` and the newer `fp32_precision` (on `torch.backends` or its `cuda.matmul`),
    and refuses to read the legacy one once the newer one was set to TF32."""
    matmul = torch.backends.cuda.matmul
    try:
        return "allow_tf32", matmul.allow_tf32, True
    except RuntimeError:  # set through the newer API
        return "fp32_precision", matmul.fp32_precision, "tf32"


def tf32_matmuls() -> bool:
    """Whether float32 CUDA matmuls may run on TF32 tensor cores now, by whichever setting the process uses."""
    _, value, on = _tf32_setting()
    return value == on


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """Inside the block, float32 CUDA matmuls at `precision` (`"high"`: on TF32 tensor cores; `"highest"`: left as
    they are); the setting is restored after it, through the same API (legacy or newer) the process uses."""
    if precision == "highest":
        yield
        return
    matmul = torch.backends.cuda.matmul
    name, before, on = _tf32_setting()
    setattr(matmul, name, on)
    try:
        yield
    finally:
        setattr(matmul, name, before)
