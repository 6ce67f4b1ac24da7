"""Sparse index views: per (request, layer, KV head) sorted positions into the shared paged KV storage."""

from __future__ import annotations

import torch

from s3r_hf.kernels.reference import UNUSED_POSITION, merge_index_views


class SparseIndexViews:
    """Index views of all requests of one `S3RCache`.

    A view is a sorted list of committed positions of one request; the draft attention reads K/V at those
    positions through the request's block table, so a view never copies K/V. All layers and KV heads of a
    request share the view length (the budget depends only on the context length) but not the positions.

    Storage: `positions` `[num_layers, max_requests, num_kv_heads, capacity]` int32 and one `lengths`
    `[max_requests]` int32 shared by the layers. One tensor for all layers lets a refresh rebuild every layer's
    views in a handful of batched operations.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, max_requests: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.device = device
        self.capacity = 0
        self.positions = torch.zeros(num_layers, max_requests, num_kv_heads, 0, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(max_requests, dtype=torch.int32, device=device)

    def ensure_capacity(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        # Grow geometrically so refreshes at growing context lengths rarely reallocate; a multiple of 16, so the
        # views' strides keep the same Triton specialization at every size (`kernels/triton_backend.py`).
        new_capacity = -(-max(capacity, 2 * self.capacity, 64) // 16) * 16
        grown = self.positions.new_zeros(*self.positions.shape[:3], new_capacity)
        grown[..., : self.capacity] = self.positions
        self.positions = grown
        self.capacity = new_capacity

    def build(
        self,
        layer: int | None,
        slots: torch.Tensor,
        candidates: torch.Tensor,
        history_lens: torch.Tensor,
        context_lens: torch.Tensor,
        budgets: torch.Tensor,
        width: int | None = None,
    ) -> None:
        """Set the views of `slots` in `layer` (every layer when `None`) to `R ∪ TopK_{K-|R|}`: the recent positions
        plus the top-scored ones.

        Args:
            layer: the layer, or `None` for all layers at once.
            slots: `[S]` request slots.
            candidates: `[S, Hkv, C]` history positions in descending score order (`-1` = none); with
                `layer=None`, `[num_layers, S, Hkv, C]`.
            history_lens: `[S]`; the recent window is `R = [history_lens, context_lens)`.
            context_lens: `[S]` committed length `|C|` after the refresh.
            budgets: `[S]` view size `K` (`<= context_lens`).
            width: `max(budgets)` when the caller knows it on the host (saves a device read-back).
        """
        device = candidates.device
        candidates = candidates if layer is None else candidates[None]  # [L, S, Hkv, C]
        if width is None:
            width = int(budgets.max()) if budgets.numel() else 0
        merged = merge_index_views(candidates, history_lens, context_lens, budgets, width)
        if merged.device.type == "cpu":  # a cheap invariant check where it costs no device synchronisation
            in_budget = torch.arange(width, device=device)[None, :] < budgets.to(device)[:, None]  # [S, width]
            short = (merged == UNUSED_POSITION) & in_budget[None, :, None, :]
            if bool(short.any()):  # the caller asked for fewer candidates than the budget needs
                raise RuntimeError("index view refresh has fewer candidate positions than its budget")
        self.store(layer, slots, merged, budgets)

    def store(self, layer: int | None, slots: torch.Tensor, views: torch.Tensor, budgets: torch.Tensor) -> None:
        """Set the views of `slots` to `views` (`[L, S, Hkv, width]` for every layer when `layer` is None, else
        `[1, S, Hkv, width]`), built by `merge_index_views` or `select_index_views`, of lengths `budgets` `[S]`."""
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        self.ensure_capacity(views.shape[-1])
        self.positions[layers, slots.long(), :, : views.shape[-1]] = views
        if layer in (None, 0):
            self.lengths[slots.long()] = budgets.to(self.device, torch.int32)

    def extend(
        self, slots: torch.Tensor, old_context_lens: torch.Tensor, context_lens: torch.Tensor, max_new: int
    ) -> None:
        """Append the positions `[old_context_lens, context_lens)` to every layer's and KV head's views of `slots`:
        a round without a refresh (`S3RConfig.refresh_interval`), whose committed tokens join the recent window.

        A view holds positions below the old committed length only, so the appended ones keep it sorted. All
        `max_new` columns past each view's length are written (those past the new length are stale by contract),
        so nothing is read back to the host; the capacity must hold `length + max_new`.
        """
        if max_new <= 0 or slots.numel() == 0:
            return
        device = self.device
        slots = slots.to(device).long()
        old_context_lens, context_lens = old_context_lens.to(device).long(), context_lens.to(device).long()
        lengths = self.lengths[slots].long()  # [S]
        offsets = torch.arange(max_new, device=device)
        columns = lengths[:, None] + offsets[None, :]  # [S, max_new]
        values = (old_context_lens[:, None] + offsets[None, :]).to(torch.int32)
        shape = (self.num_layers, slots.numel(), self.num_kv_heads, max_new)
        self.positions[:, slots[:, None, None], torch.arange(self.num_kv_heads, device=device)[None, :, None],
                       columns[:, None, :]] = values[None, :, None, :].expand(shape)
        self.lengths[slots] = (lengths + context_lens - old_context_lens).to(torch.int32)

    def set_full(self, slots: torch.Tensor, context_lens: torch.Tensor, width: int | None = None) -> None:
        """Views covering the whole context (where the budget is the whole context); `width` is the longest context
        when the caller knows it on the host (saves a device read-back)."""
        if width is None:
            width = int(context_lens.max()) if context_lens.numel() else 0
        self.ensure_capacity(width)
        positions = torch.arange(width, device=self.device, dtype=torch.int32)
        self.positions[:, slots.long(), :, :width] = positions
        self.lengths[slots.long()] = context_lens.to(torch.int32)

    def view(
        self, layer: int | None, slots: torch.Tensor, width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(positions [S, Hkv, width], lengths [S])` of `slots` in `layer` (`[num_layers, S, Hkv, width]` for
        every layer when `layer` is None); entries past a length are stale.

        `width` is the longest view among `slots` when the caller knows it on the host.
        """
        lengths = self.lengths[slots.long()]
        if width is None:
            width = int(lengths.max()) if lengths.numel() else 0
        layers = slice(None) if layer is None else layer
        return self.positions[layers, slots.long(), :, :width], lengths
