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


def tf32_matmuls() -> bool:
    """Whether float32 CUDA matmuls may run on TF32 tensor cores now. torch has two settings for it, the legacy
    `torch.backends.cuda.matmul.allow_tf32` and the newer `fp32_precision` (on `torch.backends` or its `cuda.matmul`),
    and refuses to read the legacy one once the newer one was set: this reads whichever the process uses."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # set through the newer API
        return matmul.fp32_precision == "tf32"


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """Inside the block, float32 CUDA matmuls at `precision` (`"high"`: on TF32 tensor cores; `"highest"`: left as
    they are); the setting is restored after it, through the same API (legacy or newer) the process uses."""
    if precision == "highest":
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        name, before, on = "allow_tf32", matmul.allow_tf32, True
    except RuntimeError:  # set through the newer API, which refuses legacy reads from then on
        name, before, on = "fp32_precision", matmul.fp32_precision, "tf32"
    setattr(matmul, name, on)
    try:
        yield
    finally:
        setattr(matmul, name, before)
