"""S3R on a model sharded with FSDP2: gather the full parameters once for the whole rollout.

A sharded model all-gathers each layer's parameters in that layer's forward and frees them after it. An S3R call
runs hundreds of forwards per request, different numbers on different ranks (drafts are accepted differently), so
per-forward collectives would leave ranks waiting on each other (transformers' `synced_gpus` keeps dense
generation in lockstep for this reason), and CUDA graphs cannot hold collectives or parameters that move. So
`gathered_parameters(model)` unshards every FSDP2 module once, keeps it unsharded through every forward of the
block (no collective runs inside it), and reshards on exit, the way TRL gathers a ZeRO-3 model for its own
generation. Each rank then runs S3R on its own, as on an unsharded model.

FSDP1 (`FullyShardedDataParallel` wrappers) is refused: its wrappers refuse forwards while their full parameters
are summoned. DeepSpeed ZeRO-3 is refused too: it is not tested here.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

_gathered: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's FSDP2 modules (`fully_shard` applied), outermost first; empty for an unsharded model."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def check_shardable(model: torch.nn.Module) -> None:
    """Raise for sharding schemes S3R cannot run under (FSDP1, DeepSpeed ZeRO-3), naming what works instead."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
        raise NotImplementedError(
            "S3R rollouts under FSDP1 (FullyShardedDataParallel) are not supported: its wrappers refuse forwards "
            "while their full parameters are summoned. Use FSDP2 (accelerate: fsdp_version: 2), DDP, or "
            "use_s3r=False"
        )
    if any(hasattr(parameter, "ds_id") for parameter in model.parameters()):
        raise NotImplementedError(
            "S3R rollouts under DeepSpeed ZeRO-3 are not supported (not tested); use FSDP2 (accelerate: "
            "fsdp_version: 2), DDP, or use_s3r=False"
        )


def is_gathered(model: torch.nn.Module) -> bool:
    """Whether `model`'s parameters are gathered by `gathered_parameters` (S3R may then run on every rank alone)."""
    return model in _gathered


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every FSDP2 module of `model` holds its full parameters and keeps them through its
    forwards; on exit they are sharded again as before. A no-op for a model without FSDP2 modules.

    The full parameters take the memory of an unsharded model for the block. Gradients are not involved (rollouts
    run under `torch.no_grad`).
    """
    check_shardable(model)
    modules = fsdp2_modules(model)
    if not modules or model in _gathered:
        yield
        return
    resharded_after_forward = [_reshards_after_forward(module) for module in modules]
    try:
        for module in modules:
            module.set_reshard_after_forward(False)
        for module in modules:
            module.unshard()
        _gathered.add(model)
        yield
    finally:
        _gathered.discard(model)
        for module, reshard in zip(modules, resharded_after_forward):
            module.reshard()
            module.set_reshard_after_forward(reshard)


def _reshards_after_forward(module: torch.nn.Module) -> bool:
    """Whether an FSDP2 module frees its full parameters after each forward (its setting, restored on exit)."""
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None
