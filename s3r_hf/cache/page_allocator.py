"""`PageAllocator`: hands out fixed-size KV pages from a pool shared by all layers."""

from __future__ import annotations


class KVCapacityError(RuntimeError):
    """The KV pool cannot hold what was asked of it."""


class PageAllocator:
    """A free list of page ids `0..num_pages-1`. A page id addresses the same slot in every layer's pool."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages; raise `KVCapacityError` (taking none) if fewer are free."""
        if count > len(self._free):
            raise KVCapacityError(
                f"KV cache out of pages: {count} more page(s) needed, {len(self._free)} free of {self.num_pages}"
            )
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool (latest-freed are reused first)."""
        self._free.extend(reversed(pages))
