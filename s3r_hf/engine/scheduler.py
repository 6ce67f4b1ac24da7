"""`Scheduler`: which requests run the next step. Waiting, running and paused queues; admission under the AIMD
concurrency limit and the free KV pages; pausing (offloading) requests under KV pressure and restoring them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from transformers.utils import logging

from s3r_hf.cache.page_allocator import KVCapacityError
from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.config import S3RConfig
from s3r_hf.engine.concurrency import AIMDConcurrency
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

    def __init__(self, cache: S3RCache, config: S3RConfig, stats: S3RStats) -> None:
        self.cache = cache
        self.config = config
        self.stats = stats
        self.concurrency = AIMDConcurrency(config)
        self.steps = 0  # engine steps so far, prefill steps included
        stats.record_concurrency_limit(0, self.concurrency.limit)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.paused: deque[Request] = deque()

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            self.check_fits_alone(request)
        self.waiting.extend(requests)

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
        While other requests run, a request comes in only if the pool stays at or below `utilization_low` with its
        pages taken: the running requests grow every round, and a request brought into the last free pages would
        push the pool over within a few rounds, pausing one of them (often the request just restored) and moving
        its pages twice more. That headroom is not kept where it cannot be needed: if the running requests and the
        new one all fit at their longest (`Request.peak_kv_tokens`), nothing will ever be paused, and the request
        comes in whenever its pages are free (a pool sized for the whole batch runs the whole batch at once).
        """
        running, paused, waiting = self.running, self.paused, self.waiting
        if not (paused or waiting) or len(running) >= self.concurrency.limit:
            return  # most steps of a rollout: nothing may come in, so the running requests' pages go uncounted
        promised = sum(
            max(0, self.pages_needed_for_prompt(r) - self.cache.pages_held(r.slot))
            for r in running if r.prefilled < r.prompt_len
        )
        peaks = sum(self.peak_pages(r) for r in running)
        while paused and len(running) < self.concurrency.limit:
            request = paused[0]
            if not self._fits(request, self.pages_needed(request), promised, peaks):
                break
            peaks += self.peak_pages(request)
            paused.popleft()
            self.stats.pages_restored += request.offloaded.num_pages
            self.cache.restore(request.slot, request.offloaded)
            request.offloaded = None
            request.status = RequestStatus.RUNNING
            running.append(request)
        if paused:
            return
        while waiting and len(running) < self.concurrency.limit:
            request = waiting[0]
            needed = self.pages_needed_for_prompt(request)
            if not self._fits(request, needed, promised, peaks):
                break
            promised += needed
            peaks += self.peak_pages(request)
            waiting.popleft()
            request.slot = self.cache.add_request()
            request.status = RequestStatus.RUNNING
            running.append(request)

    def peak_pages(self, request: Request) -> int:
        """Pages the request holds at its longest."""
        return self.cache.pages_for(request.peak_kv_tokens(self.config.draft_len))

    def _fits(self, request: Request, needed: int, promised: int, peaks: int) -> bool:
        """Whether `request`, needing `needed` more pages now, may come in: `promised` pages are spoken for already,
        and the running requests hold `peaks` pages at their longest."""
        taken = self.cache.used_pages + promised + needed
        if taken > self.cache.num_pages:
            return False
        if not self.running or peaks + self.peak_pages(request) <= self.cache.num_pages:
            return True  # alone, or no pause can ever follow: it only has to fit
        return taken <= self.config.utilization_low * self.cache.num_pages

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
