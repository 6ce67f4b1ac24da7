"""Time the layer chain of decode forwards (GPU only): `--layers` decoder layers of fused kernels and the attention
between them, as a draft pass runs them (sparse attention over an index view) and as a dense step does (paged
attention over the whole context), replayed from one CUDA graph: what a forward costs before its embedding, LM head
and sampling.

    python tools/decode_chain.py [--shape smollm2-135m] [--rows 16,32] [--seq 3072] [--layers 30]
                                 [--dtype float32] [--tf32] [--budget 192] [--sparse-splits 1,4] [--persistent-mlp]
                                 [--json PATH]

Each layer is `norm_qkv_rope` (with its K/V write) -> attention -> `mlp_block` (`linear_residual` (O) ->
`norm_gate_up_silu` -> `linear_residual` (down); one persistent launch with `--persistent-mlp`), with its own random
weights and KV pool (`--seq` tokens of context per row, pages in a random order), so no layer reads another's bytes
from L2. `--sparse-splits` times the sparse attention over several
key-split counts (the kernel's own choice is `None`). Two runs of a chain must give the same output bit for bit. The
weight-read floor is the layers' weight bytes at the measured copy bandwidth; a dense step's also counts its K/V.
"""

from __future__ import annotations

import argparse
import json

import torch
from layer_kernels import SHAPES, _weights  # tools/ is the script's directory

from s3r_hf.bench_kernels import copy_bandwidth, graph_ms
from s3r_hf.kernels import layer_triton, triton_backend

PAGE_SIZE = 16
DRAFT_LEN = 6  # the tail a draft pass sees: positions drafted earlier in the round


class Chain:
    """The weights, pools and step metadata of `layers` decoder layers at `rows` rows and `seq` tokens of context."""

    def __init__(self, shape: dict, layers: int, rows: int, seq: int, budget: int, dtype: torch.dtype) -> None:
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.shape, self.rows = shape, rows
        self.weights = [_weights(shape, dtype, generator) for _ in range(layers)]
        kv_heads, dim = shape["kv_heads"], shape["head_dim"]
        pages_per_row = -(-(seq + DRAFT_LEN + 1) // PAGE_SIZE)
        self.pools = [
            tuple(torch.randn(rows * pages_per_row, PAGE_SIZE, kv_heads, dim, generator=generator, device="cuda")
                  .to(dtype) for _ in range(2))
            for _ in range(layers)
        ]
        order = torch.randperm(rows * pages_per_row, generator=generator, device="cuda")
        self.block_tables = order.view(rows, pages_per_row).int()
        int32 = dict(dtype=torch.int32, device="cuda")
        self.budget = budget
        tail = seq - DRAFT_LEN
        self.tail_starts = torch.full((rows,), tail, **int32)
        self.positions = torch.full((rows,), seq, **int32)  # the query's own position: its K/V is written here
        self.view_lens = torch.full((rows,), budget, **int32)
        self.views = [
            torch.stack([torch.randperm(tail, generator=generator, device="cuda")[:budget].sort().values
                         for _ in range(rows * kv_heads)]).view(rows, kv_heads, budget).int()
            for _ in range(layers)
        ]
        self.cu = torch.arange(rows + 1, **int32)
        self.max_context = seq + 1
        positions = self.positions.long()
        pages = self.block_tables.long().gather(1, (positions // PAGE_SIZE)[:, None])[:, 0]
        self.write_rows = pages * PAGE_SIZE + positions % PAGE_SIZE
        angles = torch.rand(rows, dim // 2, generator=generator, device="cuda") * 100
        self.cos, self.sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
        self.x = torch.randn(rows, shape["hidden"], generator=generator, device="cuda").to(dtype)

    def forward(self, attention: str, sparse_splits: int | None) -> torch.Tensor:
        shape, x = self.shape, self.x
        heads, dim = shape["heads"], shape["head_dim"]
        scale = dim**-0.5
        for w, (keys, values), view in zip(self.weights, self.pools, self.views):
            qkv = layer_triton.norm_qkv_rope(
                x, w["input_norm"], 1e-6, w["q"], w["k"], w["v"], None, None, None, self.cos, self.sin, dim,
                w["q_norm"], w["k_norm"], 1e-6, 1e-6, keys, values, self.write_rows,
            )
            query = qkv[:, :heads]
            if attention == "sparse":
                attended, _ = triton_backend.paged_sparse_attention(
                    query, keys, values, self.block_tables, view, self.view_lens, self.tail_starts, self.positions,
                    scale, max_keys=self.budget + DRAFT_LEN + 1, num_splits=sparse_splits,
                )
            else:
                attended, _, _ = triton_backend.paged_dense_attention(
                    query, keys, values, self.block_tables, self.cu, self.positions, scale, max_query_len=1,
                    max_context=self.max_context,
                )
            x = layer_triton.mlp_block(attended.reshape(self.rows, heads * dim), w["o"], None, x, w["post_norm"],
                                       1e-6, w["gate"], w["up"], w["down"])
        return x

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.weights for t in w.values() if t is not None)

    def kv_bytes(self) -> int:
        keys = self.pools[0][0]
        per_token = 2 * keys.shape[2] * keys.shape[3] * keys.element_size()
        return len(self.pools) * self.rows * self.max_context * per_token


def time_chain(chain: Chain, attention: str, splits: int | None) -> dict:
    first = chain.forward(attention, splits).clone()
    ms = graph_ms(lambda: chain.forward(attention, splits), repeats=50)
    return {"ms": ms, "repeatable": bool(torch.equal(first, chain.forward(attention, splits)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="16,32")
    parser.add_argument("--seq", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--budget", type=int, default=192, help="index-view keys of the sparse attention")
    parser.add_argument("--sparse-splits", default="None",
                        help="key splits of the sparse attention to time (None: the kernel's choice)")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--tf32", action="store_true", help="TF32 products, as in float32 draft passes")
    parser.add_argument("--persistent-mlp", action="store_true",
                        help="each layer's O projection, MLP and residuals as one launch (layer_triton.PERSISTENT_MLP)")
    parser.add_argument("--json")
    args = parser.parse_args()
    layer_triton.PERSISTENT_MLP = args.persistent_mlp
    if not torch.cuda.is_available():
        raise SystemExit("tools/decode_chain.py times CUDA kernels: it needs a GPU")
    bandwidth = copy_bandwidth()
    dtype = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.shape} x {args.layers} layers, {args.dtype}"
          f"{' (TF32 products)' if args.tf32 else ''}, context {args.seq}"
          f"{', mlp_block as one persistent launch' if args.persistent_mlp else ''}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        chain = Chain(SHAPES[args.shape], args.layers, rows, args.seq, args.budget, dtype)
        runs = [("dense", None)] + [("sparse", None if s == "None" else int(s)) for s in args.sparse_splits.split(",")]
        for attention, splits in runs:
            row = {"rows": rows, "attention": attention, "splits": splits,
                   "weights_floor_ms": chain.weight_bytes() / bandwidth * 1e3}
            if attention == "dense":
                row["floor_ms"] = (chain.weight_bytes() + chain.kv_bytes()) / bandwidth * 1e3
            row.update(time_chain(chain, attention, splits))
            results.append(row)
            print(f"rows {rows:3d} {attention:6} splits {str(splits):4}: {row['ms']:.3f} ms, "
                  f"{row['ms'] / args.layers * 1e3:.1f} us per layer (weights' floor "
                  f"{row['weights_floor_ms'] / args.layers * 1e3:.1f}), repeatable {row['repeatable']}", flush=True)
        del chain
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
