"""`Scheduler`: which requests run the next step. Waiting, running and paused queues; admission under the AIMD
concurrency limit and the free KV pages; pausing (offloading) requests under KV pressure and restoring them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from transformers.utils import logging

from s3r_hf.cache.page_allocator import KVCapacityError
from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.engine.concurrency import AIMDConcurrency
from s3r_hf.engine.kv_forecast import KVForecast
from s3r_hf.request import Request, RequestStatus
from s3r_hf.stats import S3RStats

logger = logging.get_logger(__name__)


@dataclass
class ScheduledStep:
    """The next step: `"prefill"` (the next prompt chunks of `requests`), `"decode"` (a round of every running
    request; `requests` is the scheduler's running list) or, with `S3RConfig.mixed_steps`, `"mixed"` (a round of the
    decoding `requests` whose verify forward also runs the next prompt chunks of `prefilling`)."""

    kind: str
    requests: list[Request]
    prefilling: list[Request] = field(default_factory=list)
    donors: dict[bytes, Request] = field(default_factory=dict)  # running requests holding their whole prompt


class Scheduler:
    """Owns the request queues. Restored requests go before new ones. A step prefills while any running request has
    prompt left, and decodes when none has; with `S3RConfig.mixed_steps` requests that have finished their prompts
    decode in the same step as the others prefill (a mixed step)."""

    def __init__(
        self, cache: S3RCache, config: S3RConfig, stats: S3RStats, forecast: KVForecast | None = None
    ) -> None:
        self.cache = cache
        self.config = config
        self.stats = stats
        self.concurrency = AIMDConcurrency(config)
        self.steps = 0  # engine steps so far, prefill steps included
        stats.record_concurrency_limit(0, self.concurrency.limit)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: deque[Request] = deque()
        # The response-length model behind admissions; the runtime's, kept from earlier calls, when given.
        self.forecast = forecast if forecast is not None else KVForecast(cache.page_size)

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            self.check_fits_alone(request)
        self.waiting.extend(requests)
        longest = max((r.max_new_tokens for r in requests), default=1)
        self.forecast.start_call(longest, self.config.admission_sigmas)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.paused)

    def schedule(self) -> ScheduledStep:
        """Restore and admit what fits, then say what the next step runs."""
        self._restore_and_admit()
        prefilling = [r for r in self.running if r.prefilled < r.prompt_len]
        if not prefilling:
            return ScheduledStep("decode", self.running)
        decoding = [r for r in self.running if r.prefilled == r.prompt_len]
        # Prompts the new requests may copy (`S3RConfig.share_prompts`, `PromptChunks.take`).
        donors = {r.prompt_key: r for r in decoding} if self.config.share_prompts else {}
        if self.config.mixed_steps and decoding:
            return ScheduledStep("mixed", decoding, prefilling, donors)
        return ScheduledStep("prefill", prefilling, donors=donors)

    def finish_step(self) -> None:
        """Release the slots of requests that finished, and let the concurrency limit react to the step."""
        for request in [r for r in self.running if r.status is RequestStatus.FINISHED]:
            if request.remaining > 0:  # ended on EOS
                self.forecast.finished(len(request.generated))
            else:  # cut at its limit (a stopping criterion sets the limit too): its length is only known to reach it
                self.forecast.censored(len(request.generated))
            self.running.remove(request)
            self.cache.release(request.slot)
            request.slot = None
        self.steps += 1
        previous = self.concurrency.limit
        limit = self.concurrency.update(self.cache.utilization, len(self.paused))
        self.stats.record_concurrency_limit(self.steps, limit, previous)

    # ---------------------------------------------------------------- KV capacity
    def pages_needed(self, request: Request) -> int:
        """Pages for the request's context plus one full round."""
        return self.cache.pages_for(request.kv_tokens + self.config.draft_len + 1)

    def pages_needed_for_prompt(self, request: Request) -> int:
        return self.cache.pages_for(request.prompt_len + self.config.draft_len + 1)

    def check_fits_alone(self, request: Request) -> None:
        longest = request.peak_kv_tokens(self.config.draft_len)
        if self.cache.pages_for(longest) > self.cache.num_pages:
            raise KVCapacityError(
                f"KV capacity too small for one request: a prompt of {request.prompt_len} tokens with "
                f"max_new_tokens={request.max_new_tokens} needs {self.cache.pages_for(longest)} pages of "
                f"{self.cache.page_size} tokens, the cache has {self.cache.num_pages}"
            )

    def _restore_and_admit(self) -> None:
        """Restore paused requests first, then admit new ones, under the concurrency limit and KV capacity.

        Pages a running request will still take for its prompt (prefill reserves chunk by chunk) count as taken.
        While other requests run, a request comes in only if the running requests and it fit the pool at every
        coming step by `KVForecast` (their expected KV plus `S3RConfig.admission_sigmas` deviations, from the
        response lengths seen so far): a request brought into the last free pages would be paused again rounds
        later, as the running requests grow together, and its pages moved twice more. The forecast is skipped where
        it cannot matter: if the running requests and the new one all fit at their longest
        (`Request.peak_kv_tokens`), nothing will ever be paused, and the request comes in whenever its pages are
        free (a pool sized for the whole batch runs the whole batch at once).
        """
        running, paused, waiting = self.running, self.paused, self.waiting
        if not (paused or waiting) or len(running) >= self.concurrency.limit:
            return  # most steps of a rollout: nothing may come in, so the running requests' pages go uncounted
        promised = sum(
            max(0, self.pages_needed_for_prompt(r) - self.cache.pages_held(r.slot))
            for r in running if r.prefilled < r.prompt_len
        )
        admission = _Admission(self, running)
        while paused and len(running) < self.concurrency.limit:
            request = paused[0]
            if not admission.fits(request, self.pages_needed(request), promised):
                break
            admission.add(request)
            paused.popleft()
            self.stats.pages_restored += request.offloaded.num_pages
            self.cache.restore(request.slot, request.offloaded)
            request.offloaded = None
            request.status = RequestStatus.RUNNING
            running.append(request)
            if request.prefilled < request.prompt_len:  # paused mid-prefill (a mixed step): the rest is promised
                promised += max(0, self.pages_needed_for_prompt(request) - self.cache.pages_held(request.slot))
        if paused:
            return
        while waiting and len(running) < self.concurrency.limit:
            request = waiting[0]
            needed = self.pages_needed_for_prompt(request)
            if not admission.fits(request, needed, promised):
                break
            promised += needed
            admission.add(request)
            waiting.popleft()
            request.slot = self.cache.add_request()
            request.status = RequestStatus.RUNNING
            running.append(request)

    def peak_pages(self, request: Request) -> int:
        """Pages the request holds at its longest."""
        return self.cache.pages_for(request.peak_kv_tokens(self.config.draft_len))

    def make_room_for_round(self, requests: list[Request], draft_count: Callable[[Request], int]) -> None:
        """Reserve the block of every request of the round (`draft_count(request)` drafts plus one token); pause
        (offload) the smallest running requests until it fits. `requests` is the running list, or in a mixed step
        the decoding requests (then a request still prefilling may be paused too, never the round's last one)."""
        running = self.running
        while True:
            ends = [r.committed + draft_count(r) + 1 for r in requests]  # K/V length at the round's end
            if self.cache.reserve_if_fits([r.slot for r in requests], ends):
                break
            # Pausing a request that holds no pages (admitted, not prefilled yet) would free nothing.
            candidates = [
                r for r in running
                if self.cache.pages_held(r.slot) > 0 and not (len(requests) == 1 and r is requests[0])
            ]
            if not candidates:
                raise KVCapacityError("KV capacity too small for one request's next round")
            victim = min(candidates, key=lambda r: r.kv_tokens)
            running.remove(victim)
            if requests is not running:
                requests[:] = [r for r in requests if r is not victim]
            self.stats.offload_episodes += 1
            victim.offloaded = self.cache.offload(victim.slot)
            self.stats.pages_offloaded += victim.offloaded.num_pages  # what moved: its valid length's pages
            victim.status = RequestStatus.PAUSED
            self.paused.append(victim)
            host_pages = sum(r.offloaded.num_pages for r in self.paused)
            self.stats.peak_host_kv_pages = max(self.stats.peak_host_kv_pages, host_pages)
            logger.info("paused request %d (%d KV tokens) under KV pressure", victim.row, victim.kv_tokens)
        self.stats.peak_kv_pages = max(self.stats.peak_kv_pages, self.cache.used_pages)


class _Admission:
    """One step's admission test over the running requests and those let in so far (`Scheduler._restore_and_admit`).
    Per request the forecast counts its KV now (a whole prompt for one still prefilling) plus a page of rounding and
    one round's block. The running requests' forecast is made once per step, on the first request the shortcuts
    leave to it, and each request let in adds its own."""

    def __init__(self, scheduler: Scheduler, running: list[Request]) -> None:
        self.scheduler = scheduler
        self.cache = scheduler.cache
        self.forecast = scheduler.forecast
        self.slack = self.cache.page_size - 1 + scheduler.config.draft_len + 1
        self.running = running
        self.peaks = sum(scheduler.peak_pages(r) for r in running)
        self.alone = not running
        self._log_survival: np.ndarray | None = None
        self._mean = self._variance = None

    def _occupancy(self, requests: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        return self.forecast.occupancy(
            np.array([max(r.kv_tokens, r.prompt_len) + self.slack for r in requests]),
            np.array([len(r.generated) for r in requests]),
            np.array([r.remaining for r in requests]),
            self._log_survival,
        )

    def add(self, request: Request) -> None:
        """`request` comes in (the caller appends it to the running list next)."""
        self.peaks += self.scheduler.peak_pages(request)
        self.alone = False
        if self._mean is not None:
            mean, variance = self._occupancy([request])
            self._mean, self._variance = self._mean + mean, self._variance + variance

    def fits(self, request: Request, needed: int, promised: int) -> bool:
        """Whether `request`, needing `needed` more pages now, may come in; `promised` pages are spoken for."""
        cache = self.cache
        if cache.used_pages + promised + needed > cache.num_pages:
            return False
        if self.alone or self.peaks + self.scheduler.peak_pages(request) <= cache.num_pages:
            return True  # alone, or no pause can ever follow: it only has to fit
        if self.forecast.sigmas is None:
            return True  # `S3RConfig.admission_sigmas=None`: whatever fits now
        if self._mean is None:  # the running requests' lengths so far are censored data of the length model
            self._log_survival = self.forecast.log_survival(np.array([len(r.generated) for r in self.running]))
            self._mean, self._variance = self._occupancy(self.running)
        mean, variance = self._occupancy([request])
        return self.forecast.peak(self._mean + mean, self._variance + variance) <= cache.num_pages * cache.page_size
