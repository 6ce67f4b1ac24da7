"""What a plain (transformers-driven) verify forward leaves for the next index-view refresh.

In transformers' assisted decoding the target's forward is transformers' own, over an `S3RCache` in plain mode, and
the S3R attention function there is SDPA. The assisted-decoding generator (`candidate_generator.py`) hangs a
`VerifyScoreRecorder` on the cache; the attention function then also keeps, per layer, the top-K history positions
of the verified block's queries, which the generator turns into the next index views. Engine steps never use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class VerifyScoreRecorder:
    """Top-K history positions of the last plain verify forward, per layer.

    Args:
        block_queries: trailing queries of a plain forward that form the verified block (`draft_len + 1`).
        num_candidates: top-K positions to keep per layer, set before each verify forward.
    """

    block_queries: int
    num_candidates: int = 0
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, Hkv, K]
    history_len: int = 0  # keys before the verified block in the last recorded forward

    def take(self) -> dict[int, torch.Tensor]:
        """The recorded candidates, emptied for the next forward."""
        candidates, self.candidates = self.candidates, {}
        return candidates
