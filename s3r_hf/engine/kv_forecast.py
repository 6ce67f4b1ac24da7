"""`KVForecast`: how many KV tokens the running requests will hold from now on, from the response lengths seen so far.

A request admitted into the last free pages is soon paused again (its pages moved out and back) when the running
requests grow past the pool together. Admission therefore asks whether the pool holds, at every future step, the
running requests that are expected to be still running then, plus a margin of `sigmas` standard deviations:

    occupancy(t) = sum_i (context_i + t) * P(L_i > g_i + t | L_i > g_i)

for a request `i` with `context_i` tokens of KV that has generated `g_i` tokens of a response of unknown length
`L_i`, `t` tokens from now (every request advances at about the same rate), up to its `max_new_tokens`.

The survival function of `L` is estimated online with the piecewise-constant-hazard (life-table) estimator over bins
of `bin_tokens`: finished responses are events, running ones are censored at their current length, so requests
still running count for what they show (the first responses to finish are the short ones). A bin's hazard is shrunk
towards the pooled hazard in proportion to how little exposure it has, and bins no response has reached take the
pooled hazard: a memoryless extrapolation. The hazards are scaled down to a lower confidence bound of the overall
rate, so that a few early finishes do not read as short responses all round. Before any response has finished the
hazard is zero and every request is expected to run to its limit: the first requests of a cold start come in as if
each needed its longest KV, later ones as the lengths show.

An RL loop samples responses of much the same lengths at every step, so the runtime keeps one forecast per model
from call to call (`ModelRuntime.length_forecast`); each new call halves the weight of what earlier calls showed
(`start_call`), so the lengths the policy produces now outweigh those of older steps.
"""

from __future__ import annotations

import math

import numpy as np


class KVForecast:
    """The response-length model and the occupancy forecast.

    Args:
        page_size: tokens per KV page (bins are whole pages).

    Each call sets the forecast's margin, `sigmas` standard deviations of the occupancy (`start_call`).
    """

    # Weight of earlier calls' lengths at the start of each call.
    CALL_DECAY = 0.5
    # Bins over the first call's longest response: the forecast counts each request's KV at the end of a bin, so a
    # bin is what it may overstate a request by; more bins cost each step's admission test more.
    BINS = 64
    # Deviations of the hazards' lower bound: one, as the occupancy's margin (`sigmas`) covers the rest; two here
    # too kept a cold start's first requests near the pool's peak-length count for most of the call.
    RATE_SIGMAS = 1.0

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.sigmas: float | None = None  # set by each call
        self.bin_tokens = 0  # set by the first call
        self.num_bins = 0
        self.events = np.zeros(0)  # finished responses ending in each bin
        self.finished_exposure = np.zeros(0)  # tokens the finished responses spent in each bin
        self._starts = np.zeros(0, dtype=np.int64)

    def start_call(self, max_tokens: int, sigmas: float | None) -> None:
        """A new call whose responses run to at most `max_tokens`, admitted with a margin of `sigmas`
        (`S3RConfig.admission_sigmas`; None: no forecast, the lengths are still learned): bins cover them, earlier
        calls weigh less. The first call sets the bin width: whole pages, about `BINS` of them over its
        `max_tokens`."""
        self.sigmas = sigmas
        if not self.bin_tokens:
            self.bin_tokens = self.page_size * max(1, round(max_tokens / (self.BINS * self.page_size)))
        self.events *= self.CALL_DECAY
        self.finished_exposure *= self.CALL_DECAY
        bins = max(1, -(-max_tokens // self.bin_tokens))
        if bins > self.num_bins:
            grow = bins - self.num_bins
            self.events = np.concatenate([self.events, np.zeros(grow)])
            self.finished_exposure = np.concatenate([self.finished_exposure, np.zeros(grow)])
            self.num_bins = bins
            self._starts = np.arange(bins, dtype=np.int64) * self.bin_tokens

    @property
    def prior_exposure(self) -> float:
        """Tokens of exposure a bin needs before its own hazard outweighs the pooled one."""
        return 8.0 * self.bin_tokens

    def finished(self, length: int) -> None:
        """A response of `length` tokens ended on EOS (one cut at its limit is censored instead)."""
        self.events[min(length // self.bin_tokens, self.num_bins - 1)] += 1
        self.finished_exposure += self._exposure(np.array([length]))

    def censored(self, length: int) -> None:
        """A response stopped at its limit: it shows only that `L >= length`."""
        self.finished_exposure += self._exposure(np.array([length]))

    def _exposure(self, lengths: np.ndarray) -> np.ndarray:
        """Tokens of `lengths` that fall in each bin, summed over the responses."""
        return np.clip(lengths[:, None] - self._starts[None, :], 0, self.bin_tokens).sum(axis=0)

    def log_survival(self, running_lengths: np.ndarray) -> np.ndarray:
        """`log P(L > b * bin_tokens)` for b = 0 .. num_bins, with the running responses censored."""
        exposure = self.finished_exposure + (self._exposure(running_lengths) if len(running_lengths) else 0.0)
        events, total = self.events.sum(), exposure.sum()
        pooled = events / total if total > 0 else 0.0
        hazard = (self.events + self.prior_exposure * pooled) / (exposure + self.prior_exposure)
        hazard = hazard * self._rate_bound(events)
        return np.concatenate([[0.0], -np.cumsum(hazard * self.bin_tokens)])

    def _rate_bound(self, events: float) -> float:
        """How far down to take hazards estimated from `events` finishes: the ratio of the Poisson rate's lower
        confidence bound, `RATE_SIGMAS` deviations down (Wilson-Hilferty), to its estimate. A few early finishes must
        not read as short responses all round, and a call's lengths differ from the last call's by sampling alone."""
        if events <= 0:
            return 0.0
        return max(0.0, 1.0 - 1.0 / (9.0 * events) - self.RATE_SIGMAS / (3.0 * math.sqrt(events))) ** 3

    def occupancy(
        self, contexts: np.ndarray, generated: np.ndarray, remaining: np.ndarray, log_survival: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the KV tokens that requests with these KV lengths now, tokens generated and tokens
        still allowed will hold over the interval of `t` = 0, 1, 2, ... bins from now (each request is still running
        with probability `S(g + t) / S(g)`, independently), summed over the requests."""
        steps = self._starts
        alive = steps[None, :] < remaining[:, None]
        now = np.minimum(generated // self.bin_tokens, self.num_bins)
        later = np.minimum((generated[:, None] + steps[None, :]) // self.bin_tokens, self.num_bins)
        still_running = np.exp(log_survival[later] - log_survival[now][:, None]) * alive
        # A request's KV at the end of each interval `[t, t + bin)` (or at its limit, if that comes first), so that
        # no growth within an interval is missed.
        kv = contexts[:, None] + np.minimum(steps[None, :] + self.bin_tokens, remaining[:, None])
        return (kv * still_running).sum(axis=0), (kv**2 * still_running * (1.0 - still_running)).sum(axis=0)

    def peak(self, mean: np.ndarray, variance: np.ndarray) -> float:
        """The largest forecast occupancy over the coming steps: the mean plus `sigmas` deviations."""
        return float((mean + self.sigmas * np.sqrt(variance)).max())
