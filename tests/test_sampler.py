"""`speculative_accept` on its own: the committed token follows p exactly, ragged blocks, greedy mode."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from s3r_hf.sampler import (
    draw_noise,
    sample_from_scores,
    sample_proportional,
    sample_with_noise,
    speculative_accept,
)

VOCAB = 6


def test_first_committed_token_follows_the_target_distribution():
    # One draft per row: the committed token is the draft if accepted, else the residual sample. Over many rows
    # its distribution must be p, whatever q is, even when q puts mass where p has none.
    generator = torch.Generator().manual_seed(0)
    rows = 200_000
    p = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
    q = torch.tensor([0.3, 0.1, 0.2, 0.1, 0.2, 0.1])
    draft_scores = q.log().expand(rows, 1, VOCAB)
    target_scores = p.log().expand(rows, 2, VOCAB)
    drafts = torch.multinomial(q, rows, replacement=True, generator=generator)[:, None]
    result = speculative_accept(drafts, draft_scores, target_scores, torch.ones(rows, dtype=torch.long), False,
                                generator)
    committed = torch.where(result.num_accepted == 1, drafts[:, 0], result.next_tokens)
    counts = torch.bincount(committed, minlength=VOCAB).double()
    assert counts[2] == 0  # impossible under p
    support = p > 0
    test = chisquare(counts[support].numpy(), (p[support] * rows).double().numpy())
    assert test.pvalue > 1e-3, test
    # And the rejections really happened (q differs from p).
    assert 0.2 < result.num_accepted.float().mean() < 0.9


def test_ragged_blocks_greedy_and_bonus():
    # Row 0: two drafts, both equal the target argmax -> both accepted, bonus = argmax of position 3.
    # Row 1: two drafts, the second is wrong -> one accepted, correction = argmax of position 2.
    # Row 2: no drafts this round (max_new_tokens) -> next token = argmax of position 1.
    target = torch.full((3, 3, VOCAB), -5.0)
    target[:, 0, 1] = target[:, 1, 2] = target[:, 2, 3] = 5.0
    drafts = torch.tensor([[1, 2], [1, 4], [0, 0]])
    draft_scores = torch.zeros(3, 2, VOCAB)
    result = speculative_accept(drafts, draft_scores, target, torch.tensor([2, 2, 0]), True)
    assert result.num_accepted.tolist() == [2, 1, 0]
    assert result.next_tokens.tolist() == [3, 2, 1]


def test_sampled_mode_with_identical_distributions_accepts_everything():
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(64, 4, VOCAB, generator=generator)
    drafts = torch.stack([sample_from_scores(scores[:, i], False, generator) for i in range(3)], dim=1)
    result = speculative_accept(drafts, scores[:, :3], scores, torch.full((64,), 3), False, generator)
    assert result.num_accepted.tolist() == [3] * 64


def test_exponential_race_samples_the_softmax():
    # The draft phase samples with pre-drawn Exp(1) noise (a captured graph has no generator of its own); the
    # draws must follow softmax(scores), and a token with probability 0 must never win.
    generator = torch.Generator().manual_seed(1)
    rows = 200_000
    p = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
    noise = draw_noise(torch.empty(rows, VOCAB), generator)
    tokens = sample_with_noise(p.log().expand(rows, VOCAB), noise)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert counts[2] == 0
    support = p > 0
    test = chisquare(counts[support].numpy(), (p[support] * rows).double().numpy())
    assert test.pvalue > 1e-3, test
    # Power: the same counts are far from a different distribution.
    other = torch.tensor([0.1, 0.35, 0.25, 0.2, 0.1])
    assert chisquare(counts[support].numpy(), (other * rows).double().numpy()).pvalue < 1e-6


def test_sampled_rounds_without_drafts_draw_from_the_target():
    """No drafts at all (every request on its last token): the next token is a plain draw from p."""
    generator = torch.Generator().manual_seed(3)
    rows = 100_000
    p = torch.tensor([0.1, 0.0, 0.3, 0.2, 0.35, 0.05])
    result = speculative_accept(
        torch.zeros(rows, 0, dtype=torch.long), torch.zeros(rows, 0, VOCAB), p.log().expand(rows, 1, VOCAB),
        torch.zeros(rows, dtype=torch.long), False, generator,
    )
    assert result.num_accepted.eq(0).all()
    counts = torch.bincount(result.next_tokens, minlength=VOCAB).double()
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support].double() / p[support].double().sum() * rows
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a CUDA device")
def test_sampled_acceptance_queues_without_waiting_for_the_device():
    """Acceptance runs between the verify and the next round's early draft phase; a host-device sync in it (a
    boolean-mask index, say) would keep the host from queuing that phase until the verify has finished."""
    generator = torch.Generator(device="cuda").manual_seed(4)
    rows, k = 64, 4
    draft_scores = torch.randn(rows, k, VOCAB, device="cuda", generator=generator)
    target_scores = torch.randn(rows, k + 1, VOCAB, device="cuda", generator=generator)
    drafts = torch.randint(0, VOCAB, (rows, k), device="cuda", generator=generator)
    num_drafts = torch.randint(0, k + 1, (rows,), device="cuda", generator=generator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        speculative_accept(drafts, draft_scores, target_scores, num_drafts, False, generator)
        speculative_accept(drafts, draft_scores, target_scores, num_drafts, True, generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_proportional_draws_follow_the_weights():
    generator = torch.Generator().manual_seed(5)
    weights = torch.tensor([0.0, 2.0, 0.5, 1.5, 0.0, 4.0])
    draws = sample_proportional(weights.expand(200_000, VOCAB), generator)
    counts = torch.bincount(draws, minlength=VOCAB).double()
    support = weights > 0
    assert counts[~support].sum() == 0
    expected = weights[support].double() / weights.sum() * draws.numel()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3
