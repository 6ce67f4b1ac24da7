"""S3R on an FSDP2-sharded model in two CPU processes (run by tests/test_sharding.py through torchrun).

Each rank checks that greedy S3R inside `gathered_parameters` equals dense decoding of the same unsharded model,
that the parameters are sharded again afterwards, and that S3R outside the block is refused; rank 0 checks that
the two ranks' sampled completions (one fixed seed) differ.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import s3r_hf  # noqa: E402
from tests.conftest import left_padded_batch, tiny_model  # noqa: E402

CONFIG = s3r_hf.S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, seed=5)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, reference = tiny_model("qwen3", seed=70), tiny_model("qwen3", seed=70)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    s3r_hf.enable(model)
    input_ids, attention_mask = left_padded_batch([6, 13], seed=71)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=16)
    dense = reference.generate(input_ids, do_sample=False, **kwargs)
    with torch.no_grad(), s3r_hf.gathered_parameters(model):
        assert not any(isinstance(p, DTensor) for p in model.parameters()), "parameters not gathered"
        greedy = model.generate(input_ids, do_sample=False, s3r_config=CONFIG, **kwargs)
        sampled = model.generate(input_ids, do_sample=True, top_k=0, s3r_config=CONFIG, **kwargs)
    assert torch.equal(greedy, dense), "greedy S3R on the gathered FSDP2 model differs from dense decoding"
    assert all(isinstance(p, DTensor) for p in model.parameters()), "parameters not sharded again"
    try:
        model.generate(input_ids, do_sample=False, s3r_config=CONFIG, **kwargs)
    except ValueError as error:
        assert "gathered_parameters" in str(error), error
    else:
        raise AssertionError("S3R on a sharded model outside gathered_parameters was not refused")
    completions = [None, None]
    dist.all_gather_object(completions, sampled.tolist())
    if rank == 0:
        assert completions[0] != completions[1], "both ranks sampled the same completions from one seed"
    print(f"S3R-FSDP2 rank={rank} ok", flush=True)
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()
    # Every check passed. Leave without running static destructors: a gloo thread still joinable at interpreter exit
    # aborts the process now and then ("terminate called without an active exception"), after the work is done.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
