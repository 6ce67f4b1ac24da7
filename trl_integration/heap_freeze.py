"""`HeapFreeze`: the objects alive after the first rollout kept out of Python's garbage collector for a training run
(`S3RGRPOConfig.freeze_gc_after_first_rollout`)."""

from __future__ import annotations

import gc


class HeapFreeze:
    """Freezes the heap once (`gc.freeze`) and thaws it at the end, where this process's collector is free to.

    The first rollout compiles layers, Triton kernels and CUDA graphs, leaving many long-lived objects behind. Every
    later full collection traverses them all again: a pause of about half a second in an otherwise steady training
    step. Frozen, they are skipped; objects made later are collected as before.
    """

    def __init__(self) -> None:
        self.armed = False  # set for a training run: a rollout called outside one freezes nothing it would not thaw
        self.frozen = False

    def freeze(self) -> None:
        """Collect once, then freeze what is alive. Does nothing unless armed, if already frozen here, if the
        collector is off (the user decides when it runs) or if something else froze objects (thawing at the end
        would thaw those too)."""
        if not self.armed or self.frozen or not gc.isenabled() or gc.get_freeze_count():
            return
        gc.collect()
        gc.freeze()
        self.frozen = True

    def thaw(self) -> None:
        """Undo `freeze` (the objects go back to the oldest generation, collected as usual from then on) and disarm."""
        self.armed = False
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
