"""Host-device copies that never stall the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for the device's queue to
drain: one such call per layer or per step serialises host and device. Step metadata (positions, block tables,
write slots) is built on the host every step, so it goes through pinned memory and an asynchronous copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def to_device(values: list[int] | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a tensor on `device`, copied asynchronously through pinned memory when `device` is CUDA."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    # Pinned blocks come from torch's caching host allocator, which keeps a block until its copy has finished.
    return host.pin_memory().to(device, non_blocking=True)


def to_device_packed(
    lists: list[list[int]], device: torch.device, dtype: torch.dtype = torch.long
) -> list[torch.Tensor]:
    """Each of `lists` as a 1-D tensor on `device`, all from one copy: a step's metadata costs one pinned staging
    buffer and one transfer instead of one each. Each tensor starts on a 16-byte boundary, as a tensor of its own
    would, so kernels keep their pointer-alignment specialization."""
    per_line = 16 // torch.empty(0, dtype=dtype).element_size()
    packed, starts = [], []
    for values in lists:
        starts.append(len(packed))
        packed += values
        packed += [0] * (-len(packed) % per_line)
    on_device = to_device(packed, device, dtype)
    return [on_device[start : start + len(values)] for start, values in zip(starts, lists)]


def start_host_copy(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Queue a copy of `tensor` to host memory and return a function that waits for it and returns the copy.

    Device work queued between the two calls runs while the host waits and afterwards, instead of after the host
    has read the copy (a plain `.tolist()` waits for everything queued before it and leaves the device idle
    until the host queues more).
    """
    if tensor.device.type != "cuda":
        return lambda: tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> torch.Tensor:
        copied.synchronize()
        return host

    return wait
