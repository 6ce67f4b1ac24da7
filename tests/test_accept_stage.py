"""The host side of a round's accept stage: committing a block of tokens at once, and the round statistics."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import StoppingCriteriaList

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.engine import SamplingSetup
from s3r_hf.engine.commit import Committer
from s3r_hf.request import Request, RequestStatus
from s3r_hf.stats import S3RStats
from tests.conftest import left_padded_batch, tiny_model

SMALL_BUDGET = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, seed=0)


def _request(max_new_tokens: int, generated: int) -> Request:
    prompt = torch.tensor([5, 6, 7])
    request = Request(row=0, prompt_ids=prompt, tokens=torch.zeros(3 + max_new_tokens + 5, dtype=torch.long),
                      length=3, max_new_tokens=max_new_tokens, status=RequestStatus.RUNNING)
    request.tokens[:3] = prompt
    request.extend(list(range(10, 10 + generated)))
    return request


def _committer(eos_token_ids: set[int]) -> Committer:
    """A committer whose sampling setup has no per-token outputs."""
    return Committer(SamplingSetup(logits_processor=None, greedy=True, eos_token_ids=eos_token_ids,
                                   stopping_criteria=StoppingCriteriaList(), generator=None))


def _state(request: Request) -> tuple:
    return (request.history.tolist(), request.generated, request.logprobs, request.pending, request.status)


def test_block_commit_stops_where_per_token_commit_does():
    rng = random.Random(0)
    scores = torch.zeros(8, 4)
    cases = 0
    for _ in range(500):
        eos = set(rng.sample(range(20, 30), rng.randint(0, 2)))
        max_new_tokens = rng.randint(1, 12)
        generated = rng.randint(0, max_new_tokens - 1)
        proposals = [rng.randint(20, 30) for _ in range(rng.randint(1, 6))]  # EOS ids anywhere, or nowhere
        logprobs = [-rng.random() for _ in proposals] if rng.random() < 0.5 else None
        committer = _committer(eos)
        expected, actual = _request(max_new_tokens, generated), _request(max_new_tokens, generated)
        count = 0
        for offset, token in enumerate(proposals):
            count += 1
            logprob = logprobs[offset] if logprobs is not None else None
            if committer.commit(expected, token, scores, offset, scores, offset, logprob):
                break
        assert committer.commit_block(actual, proposals, logprobs) == count
        assert _state(actual) == _state(expected)
        cases += count < len(proposals)
    assert cases > 100, "blocks cut by EOS or max_new_tokens must be among the cases"


def test_request_extend_refuses_to_overflow_its_buffer():
    request = _request(max_new_tokens=2, generated=0)
    request.extend([11, 12, 13, 14, 15, 16, 17])  # fills the buffer exactly
    with pytest.raises(IndexError):
        request.extend([18])


def test_eos_inside_an_accepted_block_matches_dense(monkeypatch):
    """The EOS is a token some row first emits inside a block with tokens after it: the block is cut after it,
    log-probabilities included, exactly as dense `generate` stops."""
    model = s3r_hf.enable(tiny_model("llama", seed=5))
    input_ids, attention_mask = left_padded_batch([8, 20, 31, 14], seed=6)
    blocks = []  # (row, proposals, committed) of every block commit
    commit_block = Committer.commit_block

    def recording_commit_block(committer, request, proposals, logprobs):
        count = commit_block(committer, request, proposals, logprobs)
        blocks.append((request.row, list(proposals), count))
        return count

    monkeypatch.setattr(Committer, "commit_block", recording_commit_block)
    config = S3RConfig(**{**SMALL_BUDGET.to_dict(), "return_logprobs": True})
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40, pad_token_id=0,
                  return_dict_in_generate=True)
    free_run = model.generate(input_ids, eos_token_id=None, s3r_config=config, **kwargs)
    eos = _first_occurrence_inside_a_block(free_run.sequences[:, input_ids.shape[1] :], blocks)

    blocks.clear()
    dense = model.generate(input_ids, eos_token_id=eos, output_scores=True, **kwargs)
    out = model.generate(input_ids, eos_token_id=eos, s3r_config=config, **kwargs)
    assert torch.equal(out.sequences, dense.sequences)
    assert any(count < len(proposals) and proposals[count - 1] == eos for _, proposals, count in blocks)
    generated = dense.sequences[:, input_ids.shape[1] :]
    ended = (generated == eos).int().cumsum(dim=1) - (generated == eos).int() > 0
    expected = torch.stack([torch.log_softmax(s, -1) for s in dense.scores], 1).gather(-1, generated[..., None])
    torch.testing.assert_close(out.logprobs, expected.squeeze(-1).masked_fill(ended, 0.0), atol=1e-4, rtol=1e-4)


def _first_occurrence_inside_a_block(generated: torch.Tensor, blocks: list[tuple[int, list[int], int]]) -> int:
    """A token that first appears in some row at a block position followed by at least two more of the block."""
    offsets = [1] * generated.shape[0]  # the first generated token comes from the prefill, not from a block
    for row, proposals, count in blocks:
        start = offsets[row]
        for position, token in enumerate(proposals[:-2]):
            if token not in generated[row, : start + position].tolist():
                return token
        offsets[row] += count
    raise AssertionError("no block holds a first occurrence with two tokens after it")


def _record_round_per_request(stats: S3RStats, drafted: list[int], accepted: list[int], committed: list[int]):
    """The straightforward count `record_round` must agree with: every request, every drafted position."""
    if drafted:  # the step's rows bucket: the smallest power of two that holds them
        bucket = 1
        while bucket < len(drafted):
            bucket *= 2
        entry = stats.decode_by_rows.setdefault(bucket, {"seconds": 0.0, "steps": 0, "tokens": 0})
        entry["steps"] += 1
        entry["tokens"] += sum(committed)
    for d, a, c in zip(drafted, accepted, committed):
        stats.rounds += 1
        if d:
            stats.num_drafts += 1
        else:
            stats.dense_steps += 1
        stats.draft_length_counts[d] = stats.draft_length_counts.get(d, 0) + 1
        stats.drafted += d
        stats.accepted += a
        stats.committed += c
        stats._grow(d)
        for position in range(d):
            stats.position_drafted[position] += 1
            stats.position_accepted[position] += position < a


def test_record_round_matches_per_request_counting():
    rng = random.Random(1)
    for _ in range(300):
        fast, reference = S3RStats(), S3RStats()
        for _ in range(rng.randint(0, 5)):
            drafted = [rng.randint(0, 7) for _ in range(rng.randint(0, 9))]
            accepted = [rng.randint(0, d) for d in drafted]
            committed = [a + 1 for a in accepted]
            fast.record_round(drafted, accepted, committed)
            _record_round_per_request(reference, drafted, accepted, committed)
        assert fast.to_dict() == reference.to_dict()
        assert (fast.position_drafted, fast.position_accepted) == (
            reference.position_drafted, reference.position_accepted
        )
