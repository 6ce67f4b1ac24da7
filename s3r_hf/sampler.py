"""Exact speculative sampling (paper §3.3, Appendix A.3), batched over requests with ragged draft lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AcceptResult:
    """Outcome of one verification round for each request."""

    num_accepted: torch.Tensor  # [R] accepted drafts n (0..num_drafts)
    next_tokens: torch.Tensor  # [R] the correction (at the first rejection) or bonus token


def sample_from_scores(scores: torch.Tensor, greedy: bool, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of processed scores `[R, V]`: argmax when greedy, else a draw from `softmax(scores)`."""
    if greedy:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores.float(), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_with_noise(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One draw per row from `softmax(scores)` `[R, V]`, given i.i.d. Exp(1) `noise` `[R, V]` (the exponential race).

    `argmax_v p_v / E_v` is distributed as `p` (the `v` with the smallest `E_v / p_v`, the first arrival of
    independent exponential clocks of rates `p_v`, is `v` with probability `p_v`). Drawing the noise ahead lets a
    captured CUDA graph sample without a random generator of its own; tokens with `p_v = 0` never win.
    """
    probs = torch.softmax(scores.float(), dim=-1)
    return (probs / noise).argmax(dim=-1)


def call_generators(seed: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """A call's two random streams, from its seed: one for the verification (acceptance coins, corrections and
    first tokens), one for the drafts' noise. A draft phase launched ahead of a round it may not serve (the request
    finished, or took no drafts) then draws noise that nothing reads without moving the verification's draws: the
    same seed gives the same tokens with early launches or without. The two generators are seeded apart (an odd
    multiplier and offset, mixing all 63 bits), so the drafts' randomness stays independent of the coins, as the
    exactness argument needs."""
    verify, drafts = torch.Generator(device=device), torch.Generator(device=device)
    verify.manual_seed(seed)
    drafts.manual_seed((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**63)
    return verify, drafts


def draw_noise(buffer: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill `buffer` with Exp(1) draws in place (kept away from 0, so `p / noise` stays finite)."""
    return buffer.exponential_(generator=generator).clamp_(min=torch.finfo(buffer.dtype).tiny)


def sample_proportional(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of non-negative `weights` `[R, V]` with probability proportional to them, by the
    exponential race, which never waits for the device (`torch.multinomial` checks its input on the host)."""
    noise = draw_noise(torch.empty_like(weights), generator)
    return (weights / noise).argmax(dim=-1)


def speculative_accept(
    draft_tokens: torch.Tensor,
    draft_scores: torch.Tensor,
    target_scores: torch.Tensor,
    num_drafts: torch.Tensor,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> AcceptResult:
    """Decide how many drafts each request keeps and draw its next token, exactly as dense sampling would.

    Sampling: draft `d_i` is accepted with probability `min(1, p_i(d_i) / q_i(d_i))`; at the first rejection
    the next token is drawn from the residual `norm(max(p_i - q_i, 0))`; if all drafts are accepted, a bonus
    token is drawn from `p_{k+1}`. Greedy: a draft is accepted iff it equals `argmax p_i`, and the next token is
    `argmax` of the first rejected (or the bonus) position, which is what dense greedy decoding produces.

    `q` and `p` are `softmax` of the *processed* scores (the same logits processors on both sides), so the
    committed tokens follow the processed dense distribution that `generate(do_sample=True)` samples from.

    Args:
        draft_tokens: `[R, k]` drafted tokens (entries past `num_drafts` are ignored).
        draft_scores: `[R, k, V]` processed scores the drafts were sampled from.
        target_scores: `[R, k + 1, V]` processed dense scores for the same prefixes plus the bonus position.
        num_drafts: `[R]` drafted tokens of each request (`0..k`).
        greedy: greedy decoding instead of sampling.
        generator: the random generator of the call.
    """
    num_requests, k = draft_tokens.shape
    device = target_scores.device
    if k == 0:  # a dense step: no drafts to test, the next token is a plain draw from p (what follows reduces to it)
        first = target_scores[:, 0]
        num_accepted = torch.zeros(num_requests, dtype=torch.long, device=device)
        if greedy:
            return AcceptResult(num_accepted=num_accepted, next_tokens=first.argmax(dim=-1))
        next_tokens = sample_proportional(torch.softmax(first.float(), dim=-1), generator)
        return AcceptResult(num_accepted=num_accepted, next_tokens=next_tokens)
    rows = torch.arange(num_requests, device=device)
    position = torch.arange(k, device=device)
    drafted = position[None, :] < num_drafts[:, None]  # [R, k]
    if greedy:
        target_choice = target_scores.argmax(dim=-1)  # [R, k + 1]
        accepted = (draft_tokens == target_choice[:, :k]) & drafted
    else:
        p = torch.softmax(target_scores.float(), dim=-1)
        q = torch.softmax(draft_scores.float(), dim=-1)
        p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
        uniform = torch.rand(num_requests, k, device=device, generator=generator)
        # u < p/q  ⇔  u·q < p (q > 0 because the draft was sampled from q); no division, no 0/0.
        accepted = (uniform * q_draft < p_draft) & drafted
    # n = length of the all-accepted prefix.
    num_accepted = torch.cumprod(accepted.int(), dim=-1).sum(dim=-1)
    if greedy:
        next_tokens = target_choice[rows, num_accepted]
        return AcceptResult(num_accepted=num_accepted, next_tokens=next_tokens)
    # Everything below is masked arithmetic rather than boolean indexing or `torch.multinomial`, which would make
    # the host wait for the device before it could queue the next round's work.
    p_next = p[rows, num_accepted]  # [R, V]
    rejected = (num_accepted < num_drafts)[:, None]  # [R, 1]
    q_next = torch.zeros_like(p_next)
    if k > 0:  # q of the first rejected draft; rows that accepted all drafts take the bonus token from p alone
        q_next = torch.where(rejected, q[rows, num_accepted.clamp(max=k - 1)], q_next)
    residual = torch.clamp(p_next - q_next, min=0)
    # A rejection only happens where p(d) < q(d), so some p(v) > q(v) and the residual has mass; guard against
    # rounding leaving none by falling back to p, which is then the same distribution up to that rounding.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) <= 0, p_next, residual)
    next_tokens = sample_proportional(residual, generator)
    return AcceptResult(num_accepted=num_accepted, next_tokens=next_tokens)
