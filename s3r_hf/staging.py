"""Host-to-device copies that never stall the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, which waits for the device's queue to
drain: one such call per layer or per step serialises host and device. Step metadata (positions, block tables,
write slots) is built on the host every step, so it goes through pinned memory and an asynchronous copy.
"""

from __future__ import annotations

import torch


def to_device(values: list[int] | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a tensor on `device`, copied asynchronously through pinned memory when `device` is CUDA."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    # Pinned blocks come from torch's caching host allocator, which keeps a block until its copy has finished.
    return host.pin_memory().to(device, non_blocking=True)
