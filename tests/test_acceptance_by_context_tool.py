"""tools/acceptance_by_context.py's recording policy on CPU: its counts are the engine's, and where an index view
holds the whole context (below `min_budget`) every draft is the dense model's own sample and is accepted, while a
view of part of the context is not."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from s3r_hf import S3RConfig, enable
from tests.conftest import left_padded_batch, tiny_model

TOOL = Path(__file__).resolve().parents[1] / "tools" / "acceptance_by_context.py"


def recording_policy():
    spec = importlib.util.spec_from_file_location("acceptance_by_context", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AcceptanceByContext(3)


def sampled_call(min_budget: int):
    model = enable(tiny_model())
    input_ids, attention_mask = left_padded_batch([12, 9, 14, 10], vocab=model.config.vocab_size, seed=3)
    policy = recording_policy()
    torch.manual_seed(0)
    output = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=True, temperature=1.0,
        top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, s3r_draft_policy=policy,
        s3r_config=S3RConfig(draft_len=3, adaptive=False, min_budget=min_budget, budget_ratio=0.05, page_size=4),
    )
    return policy, output.s3r_stats


def test_counts_are_the_engines_and_whole_context_views_accept_every_draft():
    policy, stats = sampled_call(min_budget=256)  # every view holds the whole context
    rounds, drafted, accepted = (sum(entry[i] for entry in policy.by_context.values()) for i in range(3))
    assert (drafted, accepted) == (stats.drafted, stats.accepted) and drafted > 0
    assert rounds == stats.num_drafts
    assert accepted == drafted


def test_views_of_part_of_the_context_reject_some_drafts():
    policy, stats = sampled_call(min_budget=2)
    assert 0 < stats.accepted < stats.drafted
    assert sum(entry[1] for entry in policy.by_context.values()) == stats.drafted
