"""One GEMM for the linears that read the same input (Q/K/V, gate/up) in compiled engine forwards.

At rollout batch sizes a small model's projection GEMM costs its launch, not its bytes (H200, SmolLM2-135M,
B=64: 3–4 µs each, seven per layer), so Q/K/V as one GEMM and gate/up as one save three launches per layer and
forward. The model code still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)`: while an engine runs with compiled
layers, each of those linears is replaced by a `FusedLinearSlice` that computes the GEMM over the group's
concatenated weights and returns its own columns. Traced together, the group's slices hold identical GEMMs, and
`MergeIdenticalGemms` (an inductor graph pass) keeps one of them. Eagerly the slices would run the whole GEMM once
per member, so they are installed only under `torch.compile` (`compiled_layers.py`).

The concatenated weights are copies made when the engine starts (so an optimizer step between rollouts is
picked up) and dropped when it ends; the model's own parameters are never touched. The copies cost memory for
the call: 139 MB for SmolLM2-135M, 1.9 GB for Qwen3-1.7B in bf16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

# Sibling linears that read the same input in the decoders S3R supports (Llama, Qwen2/3, Mistral, SmolLM).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinearSlice(torch.nn.Module):
    """Columns `columns` of `F.linear(x, weight, bias)`, where `weight` stacks the group's linears.

    Only the S3R call's compiled layers run the fused GEMM (`active()` is true in the thread holding the model, and
    traced code is S3R's): a forward of the same model in another thread during the call gets the `original` linear,
    bit for bit.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, columns: slice, original: torch.nn.Module,
        active: Callable[[], bool],
    ) -> None:
        super().__init__()
        self.weight = weight  # shared by the group's slices (a plain tensor: not a parameter of the model)
        self.bias = bias
        # A slice object rather than two int attributes: ints on modules are traced as symbolic sizes here.
        self.columns = columns
        # Kept out of the module tree (a tuple, not a submodule): the model's parameter names stay as they are.
        self.original = (original,)
        self.active = active

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or self.active():
            return F.linear(hidden_states, self.weight, self.bias)[..., self.columns]
        return self.original[0](hidden_states)


def _fusable(linears: list[torch.nn.Module]) -> bool:
    """Plain `nn.Linear`s (not LoRA or quantized wrappers) on one input size, dtype and device, biased alike."""
    first = linears[0]
    return all(
        type(linear) is torch.nn.Linear
        and linear.in_features == first.in_features
        and linear.weight.dtype == first.weight.dtype
        and linear.weight.device == first.weight.device
        and (linear.bias is None) == (first.bias is None)
        for linear in linears
    )


@contextlib.contextmanager
def fused_projections(layers: list[torch.nn.Module], active: Callable[[], bool]) -> Iterator[None]:
    """Within the block, replace each fusable group of the layers' linears by slices of one GEMM (used where
    `active()`, see `FusedLinearSlice`); the original linears are put back afterwards."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        with torch.no_grad():
            for layer in layers:
                for parent in layer.modules():
                    for names in FUSED_GROUPS:
                        linears = [getattr(parent, name, None) for name in names]
                        if any(linear is None for linear in linears) or not _fusable(linears):
                            continue
                        weight = torch.cat([linear.weight for linear in linears])
                        bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
                        start = 0
                        for name, linear in zip(names, linears):
                            stop = start + linear.out_features
                            swapped.append((parent, name, linear))
                            setattr(parent, name, FusedLinearSlice(weight, bias, slice(start, stop), linear, active))
                            start = stop
        yield
    finally:
        for parent, name, linear in reversed(swapped):
            setattr(parent, name, linear)


class MergeIdenticalGemms(CustomGraphPass):
    """Inductor post-grad pass: GEMM nodes (and the views and transposes feeding them) with identical inputs
    become one node. All of these ops are pure, so a duplicate is the same value computed again."""

    _PURE = (
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.permute.default,
        torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
        torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default,
    )

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in self._PURE:
                continue
            key = (node.target, _hashable(node.args), _hashable(tuple(sorted(node.kwargs.items()))))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> str:
        return "s3r_hf.MergeIdenticalGemms.v1"


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(item) for item in value)
    return value
