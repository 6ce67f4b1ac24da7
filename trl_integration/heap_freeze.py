"""`HeapFreeze`: the objects alive after the first rollout kept out of Python's garbage collector for a training run
(`S3RGRPOConfig.freeze_gc_after_first_rollout`)."""

from __future__ import annotations

import gc

from transformers.utils import logging

logger = logging.get_logger(__name__)


class HeapFreeze:
    """Freezes the heap once (`gc.freeze`) and thaws it at the end, where this process's collector is free to.

    The first rollout compiles layers, Triton kernels and CUDA graphs, leaving many long-lived objects behind. Every
    later full collection traverses them all again: a pause of about half a second in an otherwise steady training
    step. Frozen, they are skipped; objects made later are collected as before.
    """

    def __init__(self) -> None:
        self.armed = False  # set for a training run: a rollout called outside one freezes nothing it would not thaw
        self.frozen = False
        self.frozen_before = 0  # objects something else had frozen when this froze the heap

    def freeze(self) -> None:
        """Collect once, then freeze what is alive. Does nothing unless armed, if already frozen here, or if the
        collector is off (the user decides when it runs). Objects frozen before (a process may freeze some at
        start-up) do not stop it: the pause comes from the objects of the first rollout all the same."""
        if not self.armed or self.frozen or not gc.isenabled():
            return
        self.frozen_before = gc.get_freeze_count()
        gc.collect()
        gc.freeze()
        self.frozen = True

    def thaw(self) -> None:
        """Undo `freeze` (the objects go back to the oldest generation, collected as usual from then on) and disarm.
        Where objects had been frozen before, nothing is thawed: `gc.unfreeze` cannot tell them from the rest, and
        thawing them would undo a freeze made on purpose."""
        self.armed = False
        if not self.frozen:
            return
        self.frozen = False
        if self.frozen_before:
            logger.info(
                "the objects frozen after the first rollout stay frozen after training: %d objects had been frozen "
                "before it, and gc.unfreeze() would thaw those too; call it yourself to thaw them all",
                self.frozen_before,
            )
            return
        gc.unfreeze()
