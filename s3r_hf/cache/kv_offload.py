"""`KVOffloader`: moves a paused request's K/V pages to host memory and back on a CUDA stream of its own.

A request is paused under KV pressure in the middle of a rollout, and its pages can come to hundreds of megabytes.
Copied on the compute stream, they would hold up the next step's kernels for the whole transfer. On a stream of
their own the transfers run while the model's kernels do, and the compute stream waits only where it reads what a
restore brought back.

Why every copy stays exact:
- offload: the pages are gathered into one device buffer on the compute stream, in stream order after every write
  to them and before any later one. So the allocator may hand the pages out again at once. The side stream waits
  for the gather, then copies the buffer into pinned host memory. `record_stream` keeps the buffer alive until that
  copy is done.
- restore: the side stream copies the host memory into a device buffer, after the request's own offload copy in its
  order. The compute stream waits for that copy, then scatters the buffer into the request's new pages.

Pinned host memory comes from torch's caching host allocator. It keeps freed pinned blocks for reuse, so a rollout
that pauses and restores again and again does not register new host memory each time. On CPU both directions are
plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from s3r_hf.staging import to_device


@dataclass
class OffloadedRequest:
    """K/V of one paused request in host memory, restored page by page into new pages.

    `kv` is `[2, layers, pages, page_size, kv_heads, head_dim]`: keys then values of every layer, for the pages
    that hold the request's `length` valid positions.
    """

    kv: torch.Tensor
    length: int

    @property
    def num_pages(self) -> int:
        return self.kv.shape[2]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class KVOffloader:
    """Copies pages of per-layer K/V pools (objects with `keys` and `values` tensors `[pages, ...]`) to host memory
    and back; on CUDA on a side stream (see the module docstring for the ordering)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def offload(self, layers: Sequence, pages: list[int], length: int) -> OffloadedRequest:
        """Copy `pages` of every layer to host memory. Once this returns, the pages may be written again."""
        first = layers[0].keys
        gathered = torch.empty((2, len(layers), len(pages), *first.shape[1:]), dtype=first.dtype, device=self.device)
        if pages:
            index = to_device(pages, self.device)
            for i, layer in enumerate(layers):
                torch.index_select(layer.keys, 0, index, out=gathered[0, i])
                torch.index_select(layer.values, 0, index, out=gathered[1, i])
        if self.stream is None:
            return OffloadedRequest(kv=gathered, length=length)  # on CPU the gather is the copy
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(gathered, non_blocking=True)
        gathered.record_stream(self.stream)
        return OffloadedRequest(kv=host, length=length)

    def restore(self, saved: OffloadedRequest, layers: Sequence, pages: list[int]) -> None:
        """Write `saved` into `pages` (as many as it holds) of every layer."""
        if not pages:
            return
        kv = saved.kv
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                kv = saved.kv.to(self.device, non_blocking=True)
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.stream)
            kv.record_stream(compute)  # allocated on the side stream, read on the compute stream
        index = to_device(pages, self.device)
        for i, layer in enumerate(layers):
            layer.keys.index_copy_(0, index, kv[0, i])
            layer.values.index_copy_(0, index, kv[1, i])
