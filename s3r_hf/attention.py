"""The S3R attention function, registered with transformers' `AttentionInterface` as `"s3r"`.

The HF model's own attention modules run unchanged: they project, apply RoPE, call `cache.update(...)` on the
`S3RCache`, then call the attention function registered under `config._attn_implementation`. During an engine
step the forward carries an `s3r_step` keyword (a `StepPlan`) that reaches this function through the model's
`**kwargs`; without it (plain mode) the function is transformers' SDPA attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from s3r_hf.cache.s3r_cache import S3RCache, take_plain_handoff
from s3r_hf.cache.score_recorder import VerifyScoreRecorder
from s3r_hf.kernels import get_backend
from s3r_hf.model_session import attention_override, hold
from s3r_hf.step_plan import DenseSegments, StepPlan

# Engine steps: no attention mask is built (transformers skips mask creation for implementations without a
# registered mask function); the step plan says who attends to what.
PACKED_ATTENTION_NAME = "s3r_packed"
# Plain mode (transformers' own loops over an `S3RCache`): SDPA with transformers' usual SDPA masks.
PLAIN_ATTENTION_NAME = "s3r"


# Kept out of `torch.compile` graphs (`S3RConfig.compile_layers`): it launches Triton kernels on a `StepPlan`.
@torch.compiler.disable
def s3r_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer: packed dense/sparse segments during engine steps, SDPA otherwise."""
    step: StepPlan | None = kwargs.pop("s3r_step", None)
    if step is None:
        return _plain_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError("S3R engine steps pack all tokens into batch row 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    backend = get_backend(query.device)
    cache: S3RCache = kwargs["s3r_cache"]
    layer_idx = module.layer_idx
    pools = cache.layers[layer_idx]
    packed = query[0].transpose(0, 1)  # [N, Hq, D]
    if _only_kind(step):  # a lockstep step has a single kind of segment: no gather/scatter of rows
        out = None
    else:
        out = torch.empty_like(packed)
    if step.dense is not None and step.dense.prefill_spans is not None:  # a prefill step, split by kind of query
        scored = step.dense.scored
        scores_out = None if scored is None else _layer_scores_out(step, scored, len(cache.layers), layer_idx, pools)
        out = _prefill_attention(query, key, value, pools, step.dense, scale, backend, scores_out)
    elif step.dense is not None:
        dense = step.dense
        dense_out, _, _ = backend.paged_dense_attention(
            _rows(packed, dense.query_index), pools.keys, pools.values, dense.block_tables, dense.cu_seqlens,
            dense.positions, scale, dense.score_starts, max_query_len=dense.max_query_len,
            max_context=dense.max_context, max_scored_queries=dense.max_scored_queries, num_splits=dense.num_splits,
            live_segments=dense.live_segments, min_live_segments=dense.min_live_segments,
            scores_out=_layer_scores_out(step, dense, len(cache.layers), layer_idx, pools),
        )  # the scores stay in `step.scores`: top-K for all layers at once after the forward
        out = dense_out if out is None else out.index_copy_(0, dense.query_index, dense_out)
    if step.sparse is not None:
        sparse = step.sparse
        if sparse.views is None:
            raise RuntimeError("SparseQueries.views must be gathered before the forward (ModelForward)")
        sparse_out, _ = backend.paged_sparse_attention(
            _rows(packed, sparse.query_index), pools.keys, pools.values, sparse.block_tables, sparse.views[layer_idx],
            sparse.view_lens,
            sparse.tail_starts, sparse.positions, scale, max_keys=sparse.max_keys, num_splits=sparse.num_splits,
        )
        out = sparse_out if out is None else out.index_copy_(0, sparse.query_index, sparse_out)
    step.layers_seen.add(layer_idx)
    return out.unsqueeze(0), None


def _layer_scores_out(
    step: StepPlan, dense: DenseSegments, num_layers: int, layer_idx: int, pools
) -> torch.Tensor | None:
    """Layer `layer_idx`'s part of `StepPlan.scores`, allocated by the first layer of a forward that scores the
    segments `dense`; None when they score nothing."""
    if dense.score_starts is None or dense.max_context < 1:
        return None
    if step.scores is None:
        shape = (num_layers, dense.cu_seqlens.shape[0] - 1, pools.keys.shape[2], dense.max_context)
        step.scores = torch.empty(shape, dtype=torch.float32, device=pools.keys.device)
    return step.scores[layer_idx]


def _prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pools, dense: DenseSegments, scale: float, backend,
    scores_out: torch.Tensor | None,
) -> torch.Tensor:
    """A prefill step's attention `[N, Hq, D]`: each long chunk through torch's fused SDPA kernels, the shorter ones
    through the paged kernel in one unscored launch, and the scores of the scored queries from the paged kernel over
    those queries alone, written into `scores_out` (the same scores it gives over the whole step: each scored query
    sees the same keys). A chunk that starts at position 0 attends to its own K/V; a later chunk of a prompt to the
    K/V cached before it as well, gathered from its pages."""
    packed = query[0].transpose(0, 1)  # [N, Hq, D]
    out = torch.empty_like(packed)
    page_size = pools.keys.shape[1]
    for segment, row, start, end in dense.prefill_spans:
        rows = slice(row, row + end - start)
        if start == 0:
            keys, values, mask = key[:, :, rows], value[:, :, rows], None
        else:
            pages = dense.block_tables[segment, : -(-end // page_size)].long()
            keys = pools.keys[pages].flatten(0, 1)[:end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, end, D]
            values = pools.values[pages].flatten(0, 1)[:end].transpose(0, 1).unsqueeze(0)
            mask = causal_lower_right(end - start, end)  # query i sits at position start + i
        out[rows] = F.scaled_dot_product_attention(
            query[:, :, rows], keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
        )[0].transpose(0, 1)
    if dense.paged is not None:
        out.index_copy_(0, dense.paged.query_index, _paged(packed, pools, dense.paged, scale, backend)[0])
    if dense.scored is not None:
        _paged(packed, pools, dense.scored, scale, backend, scores_out)
    return out


def _paged(packed: torch.Tensor, pools, segments: DenseSegments, scale: float, backend, scores_out=None):
    """The paged kernel over the queries of `segments` (a subset of a prefill step's, `query_index`)."""
    return backend.paged_dense_attention(
        packed[segments.query_index], pools.keys, pools.values, segments.block_tables, segments.cu_seqlens,
        segments.positions, scale, segments.score_starts, max_query_len=segments.max_query_len,
        max_context=segments.max_context, max_scored_queries=segments.max_scored_queries, scores_out=scores_out,
    )


def _only_kind(step: StepPlan) -> bool:
    """True when every packed row belongs to the step's one kind of segment (dense or sparse)."""
    parts = [part for part in (step.dense, step.sparse) if part is not None]
    return len(parts) == 1 and parts[0].query_index is None


def _rows(packed: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return packed if index is None else packed[index]


def _plain_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """transformers' SDPA; when an `S3RCache` records verify scores, also keep the top-K history positions."""
    cache = take_plain_handoff(module.layer_idx)
    kwargs.pop("s3r_cache", None)
    output = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                    **kwargs)
    recorder = cache.score_recorder if cache is not None else None
    if recorder is not None and recorder.num_candidates > 0:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        recorder.candidates[module.layer_idx] = _plain_verify_candidates(query, key, scale, recorder)
    return output


def _plain_verify_candidates(
    query: torch.Tensor, key: torch.Tensor, scale: float, recorder: VerifyScoreRecorder
) -> torch.Tensor:
    """Top-K history positions by mean softmax weight of the block's last queries (batch 1) over the full keys.

    The last `recorder.block_queries` queries are the verified block; everything before them is history.
    """
    backend = get_backend(query.device)
    num_queries = min(query.shape[2], recorder.block_queries)
    context = key.shape[2]
    group = query.shape[1] // key.shape[1]
    keys = key[0].repeat_interleave(group, dim=0).float()  # [Hq, L, D]
    logits = torch.einsum("hnd,hkd->hnk", query[0, :, -num_queries:].float(), keys) * scale
    query_pos = torch.arange(context - num_queries, context, device=query.device)
    future = torch.arange(context, device=query.device)[None, :] > query_pos[:, None]
    probs = torch.softmax(logits.masked_fill(future[None], float("-inf")), dim=-1)
    scores = probs.reshape(key.shape[1], group * num_queries, context).mean(dim=1)[None]
    recorder.history_len = context - num_queries
    history = torch.tensor([context - num_queries], device=query.device)
    return backend.select_topk_candidates(scores, history, recorder.num_candidates)


def register() -> None:
    """Register the S3R attention (and the plain mode's mask) with transformers (idempotent)."""
    AttentionInterface.register(PACKED_ATTENTION_NAME, s3r_attention_forward)
    AttentionInterface.register(PLAIN_ATTENTION_NAME, s3r_attention_forward)
    AttentionMaskInterface.register(PLAIN_ATTENTION_NAME, sdpa_mask)


@contextlib.contextmanager
def s3r_attention(model: PreTrainedModel, packed: bool = True) -> Iterator[None]:
    """Route the model's attention through S3R for the duration of the block, in the calling thread only.

    `packed=True` for engine steps (a `StepPlan` per forward), `False` for transformers' own loops. The block holds
    the model (`model_session.hold`): another thread's S3R call on it waits, and other threads' forwards keep the
    model's own attention implementation, since the switch is a per-thread override and the config is not written.
    """
    register()
    name = PACKED_ATTENTION_NAME if packed else PLAIN_ATTENTION_NAME
    configs = {id(c): c for c in (model.config, _text_config(model.config))}.values()
    with hold(model), attention_override(configs, name):
        yield


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config
