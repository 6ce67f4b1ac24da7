"""One GEMM for the linears that read the same input (Q/K/V, gate/up) in compiled engine forwards.

At rollout batch sizes a small model's projection GEMM costs its launch, not its bytes (docs/benchmarks.md, log of
2026-11-29), so Q/K/V as one GEMM and gate/up as one save three launches per layer and forward. The model code
still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)`: while an engine runs with compiled layers, each of those
linears is replaced by a `FusedLinearSlice` that computes the GEMM over the group's concatenated weights and
returns its own columns. Traced together, the group's slices hold identical GEMMs, and
`MergeIdenticalGemms` (an inductor graph pass) keeps one of them. Eagerly the slices would run the whole GEMM once
per member, so they are installed only under `torch.compile` (`compiled_layers.py`).

The concatenated weights are copies, refilled from the model's linears each time an engine starts (so an
optimizer step between rollouts is picked up); the model's own parameters are never touched. The copies are kept
with the model's runtime between calls (`runtime_state.py`; their size is in docs/architecture.md).
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


class FusedProjections:
    """The concatenated weights of every fusable group of `layers`' linears, and the slices that read them.

    Built once per model runtime (`runtime_state.py`) and kept across calls: CUDA graphs captured in one call read
    these weights by address in the next, so they are refilled in place from the model's linears each time they are
    installed (`installed`), never reallocated. An optimizer step between calls is therefore picked up.
    """

    def __init__(self, layers: list[torch.nn.Module], active: Callable[[], bool]) -> None:
        self.groups: list[tuple[torch.Tensor, torch.Tensor | None, list[torch.nn.Module]]] = []
        self.swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, FusedLinearSlice]] = []
        for layer in layers:
            for parent in layer.modules():
                for names in FUSED_GROUPS:
                    linears = [getattr(parent, name, None) for name in names]
                    if any(linear is None for linear in linears) or not _fusable(linears):
                        continue
                    first = linears[0].weight
                    rows = sum(linear.out_features for linear in linears)
                    like = dict(dtype=first.dtype, device=first.device)
                    weight = torch.empty(rows, first.shape[1], **like)
                    bias = None if linears[0].bias is None else torch.empty(rows, **like)
                    self.groups.append((weight, bias, linears))
                    start = 0
                    for name, linear in zip(names, linears):
                        stop = start + linear.out_features
                        fused = FusedLinearSlice(weight, bias, slice(start, stop), linear, active)
                        self.swaps.append((parent, name, linear, fused))
                        start = stop

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes + (b.nbytes if b is not None else 0) for w, b, _ in self.groups)

    def refresh(self) -> None:
        """Copy the linears' current weights into the concatenated ones, in place."""
        with torch.no_grad():
            for weight, bias, linears in self.groups:
                torch.cat([linear.weight for linear in linears], out=weight)
                if bias is not None:
                    torch.cat([linear.bias for linear in linears], out=bias)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block, each group's linears are replaced by slices of one GEMM over freshly copied weights
        (used where `active()`, see `FusedLinearSlice`); the original linears are put back afterwards."""
        for parent, name, linear, _ in self.swaps:
            if getattr(parent, name) is not linear:  # `runtime_state` rebuilds these when the model's modules change
                raise RuntimeError(f"fused projections built for a {name} module the model no longer holds")
        self.refresh()
        with swapped_modules(self.swaps):
            yield


@contextlib.contextmanager
def swapped_modules(swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module]]) -> Iterator[None]:
    """Within the block, each `(parent, name, original, replacement)` of `swaps` has `replacement` as its `parent`'s
    child `name`; the originals are put back afterwards, in reverse order."""
    try:
        for parent, name, _, replacement in swaps:
            setattr(parent, name, replacement)
        yield
    finally:
        for parent, name, original, _ in reversed(swaps):
            setattr(parent, name, original)


class MergeIdenticalGemms(CustomGraphPass):
    """Inductor post-grad pass: GEMM nodes (and the views and transposes feeding them) with identical inputs
    become one node. All of these ops are pure, so a duplicate is the same value computed again."""

    _PURE = (
        torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.permute.default,
        torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
        torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default,
    )
    # The 8-bit draft GEMM (`draft_weights.py`) a fused group's members each call, by the op's name
    _PURE_CUSTOM = ("s3r_hf::quantized_linear",)

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or not self._pure(node.target):
                continue
            key = (node.target, _hashable(node.args), _hashable(tuple(sorted(node.kwargs.items()))))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def _pure(self, target) -> bool:
        return target in self._PURE or (
            isinstance(target, torch._ops.OpOverload) and target.name() in self._PURE_CUSTOM
        )

    def uuid(self) -> str:
        return "s3r_hf.MergeIdenticalGemms.v2"


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(item) for item in value)
    return value
