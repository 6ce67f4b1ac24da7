"""The on-device draft phase drafts exactly what the host-driven per-pass path drafts.

Greedy drafts are deterministic, so both paths must propose the same tokens at every position of every round:
same committed tokens and the same drafted/accepted counts per draft position. A no-op processor that reads
the history (repetition penalty 1.0) sends the engine down the per-pass path; without it, the draft phase runs.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.draft_phase import DraftPhase
from s3r_hf.engine.model_runner import ModelRunner
from tests.conftest import left_padded_batch, tiny_model


def _counting(monkeypatch, owner, name: str) -> list:
    calls = []
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


def test_draft_phase_matches_per_pass_drafting(monkeypatch):
    phase_calls = _counting(monkeypatch, DraftPhase, "__call__")
    pass_calls = _counting(monkeypatch, ModelRunner, "draft_pass")
    model = s3r_hf.enable(tiny_model("qwen3", seed=5))
    input_ids, attention_mask = left_padded_batch([13, 40, 7, 28], seed=6)
    # max_new_tokens not a multiple of the block: the last rounds draft fewer tokens for some requests.
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=23, return_dict_in_generate=True,
                  s3r_config=S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4))
    phase = model.generate(input_ids, **kwargs)
    assert phase_calls and not pass_calls
    phase_calls.clear()
    per_pass = model.generate(
        input_ids, logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(penalty=1.0)]), **kwargs
    )
    assert pass_calls and not phase_calls
    assert torch.equal(phase.sequences, per_pass.sequences)
    assert phase.s3r_stats.position_drafted == per_pass.s3r_stats.position_drafted
    assert phase.s3r_stats.position_accepted == per_pass.s3r_stats.position_accepted
    assert 0 < phase.s3r_stats.accepted < phase.s3r_stats.drafted  # drafts were both kept and rejected
