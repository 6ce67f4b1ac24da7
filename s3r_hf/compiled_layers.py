"""`torch.compile` of the decoder layers for engine forwards (`S3RConfig.compile_layers`).

At rollout batch sizes a decode forward of a small model costs its kernel count, not its memory traffic: an
eager HF decoder layer launches about 40 kernels (RMSNorm alone is six, rotary ten), so a 30-layer model runs
over a thousand per forward. Compiling each layer lets inductor fuse the elementwise work around the GEMMs
(norm, rotary, SiLU·mul, residual adds). The S3R attention function and the cache's K/V write are excluded from
the compiled graphs (`torch.compiler.disable`): they launch Triton kernels on the step plan's metadata, and a
graph break there costs nothing once the whole forward is replayed as a CUDA graph.

Inside the compiled layers the linears that read one input (Q/K/V, gate/up) run as one GEMM each
(`fused_projections.py`): at these batch sizes a GEMM costs its launch.

The compiled forwards are installed on the layers only while an engine runs, so the model's own forward (the
training step of an RL loop, plain `generate`) is never touched. One compiled function serves every layer of a
class and lives for the process, so later calls recompile only for new shapes; parameters are read at call
time, so optimizer steps between rollouts need no recompilation.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.nn.modules import module as module_hooks
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import output_capturing

from s3r_hf.fused_projections import FusedProjections, MergeIdenticalGemms
from s3r_hf.model_session import owns
from s3r_hf.validation import UnsupportedModelError

# One compiled function per decoder-layer class, shared by its layers (and by every model of that class).
_compiled_forwards: dict[type, Callable] = {}
RECOMPILE_LIMIT = 64


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' `GradientCheckpointingLayer` subclasses), in order."""
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if not layers:
        raise UnsupportedModelError(
            f"{type(model).__name__}: S3RConfig.compile_layers needs decoder layers derived from transformers' "
            "GradientCheckpointingLayer; none were found"
        )
    return layers


def check_no_hooks_in_layers(model: PreTrainedModel, option: str) -> None:
    """Refuse forward hooks on the modules inside decoder layers, which `option` (compiled or fused layers) does not
    run as modules: fused projections replace the Q/K/V and gate/up linears, fused layers call none of their parts,
    and a compiled layer traced before a hook was added keeps running without it. Hooks on a layer itself (FSDP2
    registers its own there) run around the replaced forward and are kept; transformers' own output-capturing hooks
    (`is_output_capturing_hook`) are inactive in an S3R call and pass."""
    # Hooks registered for every module (`register_module_forward_hook`, `..._pre_hook`) reach the parts too.
    if module_hooks._global_forward_pre_hooks or module_hooks._global_forward_hooks:
        raise ValueError(
            f"S3RConfig({option}=True) does not run forward hooks inside decoder layers, and a global module forward "
            "hook is registered (torch.nn.modules.module.register_module_forward_hook or _pre_hook); remove it, or "
            f"generate with {option}=False"
        )
    names = {module: name for name, module in model.named_modules()}
    for layer in decoder_layers(model):
        for module in layer.modules():
            hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
            if module is not layer and not all(map(is_output_capturing_hook, hooks)):
                raise ValueError(
                    f"S3RConfig({option}=True) does not run forward hooks inside decoder layers, and module "
                    f"{names[module]!r} has one; remove it, or generate with {option}=False"
                )


def is_output_capturing_hook(hook: Callable) -> bool:
    """Whether `hook` is one transformers installs on a model's modules the first time a forward asks for hidden
    states or attentions (`transformers.utils.output_capturing`). It records only while such a forward runs, and
    S3R refuses those outputs, so an S3R forward that skips it loses nothing."""
    return getattr(hook, "__module__", None) == output_capturing.__name__ and (
        getattr(hook, "__name__", None) == "output_capturing_hook"
    )


def fused_projections_for(model: PreTrainedModel) -> FusedProjections:
    """The fused Q/K/V and gate/up projections of the model's decoder layers, active in the thread holding the model
    for S3R. They refer to the model weakly, so a runtime kept for the model does not keep the model alive."""
    model_ref = weakref.ref(model)

    def active() -> bool:
        held = model_ref()
        return held is not None and owns(held)

    return FusedProjections(decoder_layers(model), active)


@contextlib.contextmanager
def compiled_decoder_layers(model: PreTrainedModel, fused: FusedProjections | None = None) -> Iterator[None]:
    """Run the block with every decoder layer's `forward` replaced by its compiled version, then restore it.

    `fused` (default: built for this block) are the layers' fused projections, refilled from the model's weights on
    entry. The replacement runs the compiled forward only in the thread holding the model for S3R
    (`model_session.owns`): another thread's forward of the same model during the call (a dense `generate`) runs the
    layer's own code.
    """
    layers = decoder_layers(model)
    fused = fused if fused is not None else fused_projections_for(model)
    # `layer_idx` would otherwise be a constant of each layer's graph: one recompilation per layer. The frames between
    # the attention's graph breaks see a new token count in every kind of step (prefill chunks, each CUDA-graph bucket
    # of dense steps, draft passes and verify blocks) until torch marks the count dynamic, and dynamo's default limit
    # of eight recompilations per frame is reached within a first call: past it a frame runs eagerly, uncompiled,
    # for every new shape, with only a warning. A higher limit lets each frame settle on its dynamic graph instead.
    config = torch._dynamo.config
    limit = {"recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit": RECOMPILE_LIMIT}

    def compiled(layer: torch.nn.Module, eager: Callable) -> Callable:
        return _owner_dispatch(model, types.MethodType(_compiled_forward(type(layer)), layer), eager)

    wrapped = [module for layer in layers for module in layer.modules() if _kernel_func_wrapper(module) is not None]
    with config.patch(allow_unspec_int_on_nn_module=True, **limit), fused.installed():
        with replaced_forwards(layers, compiled), replaced_forwards(wrapped, _unwrapped_when_compiling):
            yield


def _kernel_func_wrapper(module: torch.nn.Module) -> Callable | None:
    """The wrapped `forward` of a module whose class the `kernels` package decorated with `use_kernelized_func`
    (transformers' attention classes since 5.25), unless the model was kernelized (hub kernels chosen for it).

    The wrapper runs the class's forward inside a `try`/`finally`, and dynamo cannot resume a frame like that after a
    graph break: the S3R attention and the K/V write break the graph in every attention forward, so the whole
    attention module (projections, norms, rotary) would run eagerly, uncompiled, in every compiled layer. Without
    hub kernels the wrapper only routes its functions to their own code."""
    funcs = module.__dict__.get("_kernel_funcs")
    original = getattr(type(module).forward, "__wrapped__", None)
    if not funcs or original is None or any("forward" in vars(func) for func in funcs.values()):
        return None
    return original


def _unwrapped_when_compiling(module: torch.nn.Module, own: Callable) -> Callable:
    """`module`'s forward without the `kernels` wrapper while dynamo traces it (a compiled decoder layer, which only
    the thread holding the model runs), its own forward otherwise."""
    original = _kernel_func_wrapper(module)

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            return original(module, *args, **kwargs)
        return own(*args, **kwargs)

    return forward


def _compiled_forward(cls: type) -> Callable:
    """The compiled `forward` of a decoder-layer class, compiled on first use."""
    if cls not in _compiled_forwards:
        options = {"post_grad_custom_pre_pass": MergeIdenticalGemms()}
        _compiled_forwards[cls] = torch.compile(cls.forward, options=options)
    return _compiled_forwards[cls]


@contextlib.contextmanager
def replaced_forwards(
    layers: list[torch.nn.Module], make_forward: Callable[[torch.nn.Module, Callable], Callable]
) -> Iterator[None]:
    """Within the block each layer's `forward` is `make_forward(layer, own)`, `own` being the forward the layer had on
    entry (its class's, or one installed before); every layer gets that forward back afterwards."""
    saved = [(layer, layer.__dict__.get("forward")) for layer in layers]
    try:
        for layer, previous in saved:
            own = previous if previous is not None else types.MethodType(type(layer).forward, layer)
            layer.forward = make_forward(layer, own)
        yield
    finally:
        for layer, previous in saved:
            if previous is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = previous


def compile_counters() -> tuple[int, float]:
    """`(graphs compiled, seconds spent compiling)` by `torch.compile` in this process so far; the engine reports
    the difference over a call (`S3RStats.compiled_graphs`, `compile_seconds`)."""
    from torch._dynamo import utils

    seconds = sum(utils.compilation_time_metrics.get("_compile.compile_inner", ()))
    return int(utils.counters["stats"]["unique_graphs"]), float(seconds)


def _owner_dispatch(model: PreTrainedModel, compiled: Callable, eager: Callable) -> Callable:
    """`compiled` in the thread running S3R on `model`, `eager` in any other thread.

    The hidden states reach the compiled forward detached when no gradient is recorded: transformers' gradient
    checkpointing (on by default in TRL's GRPO) marks the embedding output as requiring grad with a hook that runs
    under `no_grad` too, so the first layer's input would require grad and the others' would not, and every compiled
    frame guards on that flag: the first layer would compile apart from the rest (half again as many graphs in a first
    call, and recompilations in later ones). Detaching changes no value.
    """

    def forward(*args, **kwargs):
        if not owns(model):
            return eager(*args, **kwargs)
        if torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args = (args[0].detach(), *args[1:])
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor) and kwargs["hidden_states"].requires_grad:
            kwargs["hidden_states"] = kwargs["hidden_states"].detach()
        return compiled(*args, **kwargs)

    return forward
