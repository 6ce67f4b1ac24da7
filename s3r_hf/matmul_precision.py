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


@contextlib.contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """Inside the block, float32 CUDA matmuls at `precision` (`"high"`: on TF32 tensor cores; `"highest"`: left as
    they are); the setting is restored after it."""
    if precision == "highest":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
