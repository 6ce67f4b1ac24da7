"""8-bit copies of the decoder layers' weights for the draft passes (`S3RConfig.draft_weights`).

A draft pass at rollout batch sizes reads every layer's weights once for a few dozen rows, so its GEMMs cost their
weights' bytes; int8 weights with a scale per output feature, or per group of 64 or 128 weights along a row, halve
them. A draft is only a proposal: the verify forward runs the model's own weights and the acceptance test divides by
the scores the drafts were sampled from, so samples stay exactly the dense model's. The rounding can only change how
often drafts are accepted (docs/benchmarks.md measures it on real text).

While an engine runs, each linear inside a decoder layer (after `compile_layers` fused its Q/K/V and gate/up
projections: the fused GEMM's weights) is wrapped by a `QuantizedDraftLinear`, which runs the wrapped module in
every forward but a draft pass, and in every other thread's forward. `ModelForward` marks the draft passes
(`draft_pass`): the forwards whose plan holds sparse queries only. Compiled layers read the mark while they are
traced, so they compile once for draft passes and once for the rest; CUDA graphs keep the kernels of their capture.

The copies are refilled in place from the model's weights each time an engine starts (an optimizer step between
calls is picked up; captured graphs read them by address), and kept with the model's runtime between calls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from s3r_hf.fused_projections import FusedLinearSlice, swapped_modules
from s3r_hf.kernels.decode_linear_reference import decode_linear_reference, quantize_rows

# Read by `QuantizedDraftLinear.forward`: whether a draft pass runs (compiled layers guard on it), and in which thread.
# Another thread's forward of the model during the pass (a dense `generate`) runs the model's own weights.
_drafting = False
_drafting_thread: int | None = None


@contextlib.contextmanager
def draft_pass(on: bool = True) -> Iterator[None]:
    """Within the block, wrapped linears read their 8-bit copies (if `on`) in this thread."""
    global _drafting, _drafting_thread
    before = _drafting, _drafting_thread
    _drafting, _drafting_thread = on, threading.get_ident()
    try:
        yield
    finally:
        _drafting, _drafting_thread = before


def drafting() -> bool:
    """Whether this thread runs a draft pass."""
    return _drafting and _drafting_thread == threading.get_ident()


@torch.library.custom_op("s3r_hf::quantized_linear", mutates_args=())
def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ (weight * scale).T` for 8-bit `weight` with a scale per output feature or per group (`quantize_rows`), in
    `x`'s dtype: the Triton kernel on CUDA, its torch reference elsewhere."""
    flat = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from s3r_hf.kernels.decode_linear_triton import decode_linear

        out = decode_linear(flat.contiguous(), weight, scale)
    else:
        out = decode_linear_reference(flat, weight, scale)
    return out.view(*x.shape[:-1], weight.shape[0])


@quantized_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class QuantizedDraftLinear(torch.nn.Module):
    """`inner(x)` outside draft passes; in them, columns `columns` of the 8-bit product with `weight`, `scale`
    (shared by a fused group's members) plus `bias`."""

    def __init__(
        self, inner: torch.nn.Module, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
        columns: slice | None,
    ) -> None:
        super().__init__()
        self.weight8 = weight
        self.scale = scale
        self.bias = bias
        self.columns = columns
        self.inner = (inner,)  # out of the module tree: the model's parameter names stay as they are

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Compiled code runs in the drafting thread only (`compiled_layers._owner_dispatch`), and reads no thread id.
        if not _drafting or not (torch.compiler.is_compiling() or _drafting_thread == threading.get_ident()):
            return self.inner[0](hidden_states)
        out = torch.ops.s3r_hf.quantized_linear(hidden_states, self.weight8, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out if self.columns is None else out[..., self.columns]


def quantizable(module: torch.nn.Module) -> bool:
    """Whether `module` is a plain linear whose weight the draft passes read as an 8-bit copy."""
    return type(module) is torch.nn.Linear and module.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _source(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, slice | None] | None:
    """`(weight, bias, columns)` a wrapped module computes with, or None for a module left alone: plain linears, and
    the fused projections' slices (their group's concatenated weight, and their columns of it)."""
    if isinstance(module, FusedLinearSlice):
        return module.weight, module.bias, module.columns
    if quantizable(module):
        return module.weight, module.bias, None
    return None


class DraftWeights:
    """`dtype` copies (8-bit) of the weights of every linear in `layers`, as the modules stand when it is
    built, with a scale per output feature or, with `group`, per `group` weights along a row; and the
    `QuantizedDraftLinear`s that read them. A weight shared by several modules (a fused group) is copied once."""

    def __init__(self, layers: list[torch.nn.Module], dtype: torch.dtype, group: int | None = None) -> None:
        self.dtype, self.group = dtype, group
        # id(weight): the weight, its copy, the copy's scales
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, QuantizedDraftLinear]] = []
        for index, layer in enumerate(layers):
            for prefix, parent in layer.named_modules():
                for name, module in parent.named_children():
                    source = _source(module)
                    if source is None:
                        continue
                    weight, bias, columns = source
                    if group is not None and weight.shape[1] % group:
                        path = f"{prefix}.{name}" if prefix else name
                        raise ValueError(
                            f"S3RConfig.draft_weights with a scale per {group} weights: decoder layer {index}'s "
                            f"{path} has rows of {weight.shape[1]} weights, which groups of {group} do not divide"
                        )
                    if id(weight) not in self.copies:
                        scales = (weight.shape[0],) if group is None else (weight.shape[0], weight.shape[1] // group)
                        self.copies[id(weight)] = (
                            weight,
                            torch.empty(weight.shape, dtype=dtype, device=weight.device),
                            torch.empty(scales, dtype=torch.float32, device=weight.device),
                        )
                    _, weight8, scale = self.copies[id(weight)]
                    wrapped = QuantizedDraftLinear(module, weight8, scale, bias, columns)
                    self.swaps.append((parent, name, module, wrapped))

    @property
    def nbytes(self) -> int:
        return sum(weight8.nbytes + scale.nbytes for _, weight8, scale in self.copies.values())

    def refresh(self) -> None:
        """Quantize the current weights into the copies, in place."""
        with torch.no_grad():
            for weight, weight8, scale in self.copies.values():
                quantized, scales = quantize_rows(weight, self.dtype, self.group)
                weight8.copy_(quantized)
                scale.copy_(scales)

    def matches(self) -> bool:
        """Whether the wrapped modules are still where they were (the model's modules, and whether the fused
        projections are installed, decide which modules there are)."""
        return bool(self.swaps) and all(getattr(parent, name) is module for parent, name, module, _ in self.swaps)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block, each linear is its `QuantizedDraftLinear`, over freshly quantized weights."""
        if not self.matches():
            raise RuntimeError("draft weights built for modules the model's layers no longer hold")
        self.refresh()
        with swapped_modules(self.swaps):
            yield
