"""FSDP2-sharded models: S3R runs on the parameters `gathered_parameters` gathers for the call (two CPU processes);
FSDP1 and DeepSpeed ZeRO-3 are refused with what to use instead."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from s3r_hf.sharding import check_shardable, gathered_parameters, is_gathered
from tests.conftest import tiny_model


def test_fsdp2_two_cpu_processes():
    script = Path(__file__).with_name("fsdp_generate.py")
    with socket.socket() as probe:  # a free port, so that no other process's rendezvous collides with this one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               str(script)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The two ranks print concurrently: their lines may run together.
    assert sorted(re.findall(r"S3R-FSDP2 rank=(\d) ok", result.stdout)) == ["0", "1"], result.stdout[-3000:]


def test_an_unsharded_model_passes_through():
    model = tiny_model()
    with gathered_parameters(model):
        assert not is_gathered(model)  # nothing to gather: S3R runs as on any model
    check_shardable(model)


def test_zero3_parameters_are_refused():
    model = tiny_model()
    next(model.parameters()).ds_id = 0  # how DeepSpeed ZeRO-3 marks the parameters it partitions
    with pytest.raises(NotImplementedError, match="ZeRO-3"):
        check_shardable(model)


def test_fsdp1_is_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = tiny_model()
    fake = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(fake)
    model.model.add_module("wrapper", fake)
    with pytest.raises(NotImplementedError, match="FSDP1"):
        check_shardable(model)
