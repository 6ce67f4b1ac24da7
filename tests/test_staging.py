"""Host-to-device staging of step metadata (`s3r_hf/staging.py`)."""

from __future__ import annotations

import pytest
import torch

from s3r_hf.staging import to_device_packed

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_packed_lists_arrive_whole_and_on_16_byte_boundaries(dtype):
    lists = [[3, 1, 4], [], [1, 5, 9, 2, 6], [5], list(range(17))]
    tensors = to_device_packed(lists, DEVICE, dtype)
    assert [t.tolist() for t in tensors] == lists
    for tensor in tensors:
        assert tensor.dtype == dtype and tensor.device.type == DEVICE.type and tensor.is_contiguous()
        # Kernels are specialized on their pointers' 16-byte alignment: a slice of the packed copy must keep it.
        assert tensor.data_ptr() % 16 == 0
