"""Programmatic dependent launch (PDL) for the decode kernels: each kernel of a layer's chain starts while the one
before it finishes.

At decode batch sizes a forward is a chain of short dependent kernels (a fused layer's four and the attention's,
thirty layers deep), and each pays its launch and the ramp of its programs before its first load. On GPUs of compute
capability 9.0 and later a kernel launched with PDL may be scheduled once every program of the kernel before it has
signalled `gdc_launch_dependents`, and its programs run up to their `gdc_wait`, which returns when that kernel has
completed and its writes are visible. The kernels here signal right after their own wait, so the next kernel's launch
and setup overlap their work.

The rule that keeps this correct: before `inputs_ready` a kernel computes addresses and reads only what no kernel of
the same forward writes (the model's parameters, and the step's metadata: block tables, index views, positions,
K/V destinations, filled before the forward's first kernel). Every store, and every read of an activation, K/V or a
split's partial sums, comes after it. Because each kernel waits before it signals, every kernel before the one just
launched has completed by the time a kernel starts.

The switch is per process: `S3R_HF_PDL=0` in the environment launches every kernel plainly (for measurements and
for ruling PDL out when debugging). CPU tensors (the Triton interpreter) and GPUs before compute capability 9.0
always launch plainly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("S3R_HF_PDL", "1") != "0"

_capable: dict[torch.device, bool] = {}


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: the kernel's `PDL` flag, and Triton's `launch_pdl` where
    it is set."""
    if not ENABLED or device.type != "cuda":
        return {"PDL": False}
    if device not in _capable:
        _capable[device] = torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if _capable[device] else {"PDL": False}


@triton.jit
def inputs_ready(PDL: tl.constexpr):
    """Wait until the kernel launched before this one has completed, then let the next kernel launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
