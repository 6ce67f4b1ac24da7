"""Admission under KV pressure: the response-length model (`KVForecast`: censored lengths, cautious rates, calls
weighed by age), the scheduler's use of it for new and paused requests, its upkeep across calls, and what it does
to paging on a simulated long rollout."""

from __future__ import annotations

import importlib.util
import math
import random
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.cache.s3r_cache import S3RCache
from s3r_hf.engine.kv_forecast import KVForecast
from s3r_hf.engine.scheduler import Scheduler
from s3r_hf.request import Request, RequestStatus
from s3r_hf.runtime_state import runtime_for
from s3r_hf.stats import S3RStats
from tests.conftest import left_padded_batch, tiny_model

SIMULATOR = Path(__file__).resolve().parents[1] / "tools" / "simulate_paging.py"


# ---------------------------------------------------------------- the length model
def _survival(forecast: KVForecast, tokens: int, running: np.ndarray) -> float:
    return math.exp(forecast.log_survival(running)[tokens // forecast.bin_tokens])


def test_with_no_length_seen_every_request_is_expected_to_run_to_its_limit():
    forecast = KVForecast(page_size=8)
    forecast.start_call(64, 2.0)
    log_survival = forecast.log_survival(np.array([0, 5]))
    assert np.all(log_survival == 0.0)
    mean, variance = forecast.occupancy(np.array([10, 20]), np.array([0, 5]), np.array([64, 16]), log_survival)
    # Each interval of 8 tokens counts a request's KV at its end or at the request's limit, whichever is first.
    steps = np.arange(8) * 8
    assert np.array_equal(mean, (10 + np.minimum(steps + 8, 64)) + (20 + np.minimum(steps + 8, 16)) * (steps < 16))
    assert np.all(variance == 0.0)
    assert forecast.peak(mean, variance) == 10 + 64


def test_lengths_are_learned_from_finished_and_running_responses():
    """2,000 responses of geometric lengths (mean 200) observed 150 tokens in: the 1,100-odd that ended are events,
    the rest are censored at 150. The survival function matches the true one, past the horizon too (a memoryless
    extrapolation); the finished lengths alone would read every response as shorter than 150."""
    rng = random.Random(0)
    lengths = [int(rng.expovariate(1 / 200)) for _ in range(2000)]
    forecast = KVForecast(page_size=16)
    forecast.start_call(1024, 2.0)
    for length in lengths:
        if length < 150:
            forecast.finished(length)
    running = np.array([150 for length in lengths if length >= 150])
    for tokens in (96, 144, 400):
        assert _survival(forecast, tokens, running) == pytest.approx(math.exp(-tokens / 200), rel=0.12)
    assert _survival(forecast, 400, np.array([])) < 0.01  # without the censored ones


def test_a_few_finishes_are_read_cautiously():
    """Two responses that ended early do not make every response short: the hazard is scaled to a lower bound of
    its rate, which tightens as finishes accumulate."""
    few, many = KVForecast(page_size=16), KVForecast(page_size=16)
    for forecast, count in ((few, 2), (many, 200)):
        forecast.start_call(512, 2.0)
        for _ in range(count):
            forecast.finished(40)
    # The same rate of finishes per token of exposure in both (2 in 100 responses, 200 in 10,000).
    point_estimate = math.exp(-2 / (98 * 64 + 2 * 40) * 64)
    assert _survival(few, 64, np.full(98, 64)) > point_estimate ** 0.5
    assert _survival(many, 64, np.full(9800, 64)) == pytest.approx(point_estimate, rel=0.01)


def test_each_call_weighs_earlier_calls_less_and_widens_the_bins_it_needs():
    forecast = KVForecast(page_size=16)
    forecast.start_call(64, 2.0)
    forecast.finished(20)
    forecast.censored(64)
    assert forecast.num_bins == 4 and forecast.events.sum() == 1 and forecast.finished_exposure.sum() == 84
    forecast.start_call(200, 1.0)
    assert forecast.num_bins == 13 and forecast.sigmas == 1.0
    assert forecast.events.sum() == 0.5 and forecast.finished_exposure.sum() == 42


# ---------------------------------------------------------------- the scheduler's admissions
def _waiting(count: int, prompt_len: int = 12, max_new_tokens: int = 64) -> list[Request]:
    return [Request(row=row, prompt_ids=torch.arange(3, 3 + prompt_len), tokens=torch.zeros(1, dtype=torch.long),
                    length=prompt_len, max_new_tokens=max_new_tokens) for row in range(count)]


def _scheduler(num_pages: int = 60, forecast: KVForecast | None = None, **config) -> Scheduler:
    """Pages of 4 tokens; a request of a 12-token prompt and 64 new tokens needs 4 pages now, 20 at its longest."""
    config = S3RConfig(page_size=4, num_pages=num_pages, draft_len=3, concurrency_min=16, concurrency_max=16,
                       **config)
    cache = S3RCache(tiny_model("llama").config, num_pages=num_pages, page_size=4, max_requests=16)
    return Scheduler(cache, config, S3RStats(), forecast)


def _short_responses_seen(count: int = 400, length: int = 8) -> KVForecast:
    forecast = KVForecast(4)
    forecast.start_call(64, 2.0)
    for _ in range(count):
        forecast.finished(length)
    return forecast


def test_a_cold_start_admits_as_if_every_response_ran_to_its_limit():
    scheduler = _scheduler()
    scheduler.add(_waiting(10))
    assert scheduler.schedule().kind == "prefill"
    assert len(scheduler.running) == 3  # 3 x 20 pages at their longest fill the 60; a fourth could be paused later


def test_short_responses_seen_before_let_more_requests_in_but_never_more_than_fit_now():
    scheduler = _scheduler(forecast=_short_responses_seen())
    scheduler.add(_waiting(16))
    scheduler.schedule()
    # Three would come in at their longest; four pages each are free for 15. The forecast counts a page of rounding
    # and a round's block per request (12 + 3 + 4 tokens, and the 4 of its first interval) and two deviations of
    # whether each is still running after 8 tokens.
    assert len(scheduler.running) == 7


def test_without_a_forecast_admissions_take_whatever_fits_now():
    scheduler = _scheduler(admission_sigmas=None)
    scheduler.add(_waiting(16))
    scheduler.schedule()
    assert len(scheduler.running) == 15


@pytest.mark.parametrize("sigmas, admitted", [(0.0, 9), (2.0, 4), (4.0, 3)])
def test_the_margin_sets_how_many_come_in_at_a_middling_length(sigmas, admitted):
    """Responses of about 40 tokens seen before (of 64 allowed): the more deviations, the fewer requests at once."""
    forecast = KVForecast(4)
    forecast.start_call(64, sigmas)
    rng = random.Random(1)
    for _ in range(400):
        forecast.finished(min(63, int(rng.expovariate(1 / 40))))
    scheduler = _scheduler(forecast=forecast, admission_sigmas=sigmas)
    scheduler.add(_waiting(16))
    scheduler.schedule()
    assert len(scheduler.running) == admitted


def _running_request(cache: S3RCache, row: int, tokens: int, generated: int) -> Request:
    """A request with `tokens` of K/V in the cache, `generated` of them its response so far."""
    request = _waiting(1, prompt_len=tokens - generated)[0]
    request.row, request.status = row, RequestStatus.RUNNING
    request.prefilled = request.prompt_len
    request.committed = tokens
    request.generated = [0] * generated
    request.slot = cache.add_request()
    cache.reserve(request.slot, tokens)
    cache.set_length(request.slot, tokens)
    return request


@pytest.mark.parametrize("forecast, restored", [(None, False), ("short", True)])
def test_a_paused_request_comes_back_when_the_forecast_says_it_will_not_be_paused_again(forecast, restored):
    """One request runs with 100 tokens of K/V, one is paused with 60: 25 + 16 pages now fit the 60, but at their
    longest (37 + 30 pages) they do not. Cold, it stays paused; once responses are known to be short, it comes
    back."""
    scheduler = _scheduler(forecast=_short_responses_seen() if forecast else None)
    scheduler.forecast.start_call(64, 2.0)
    cache = scheduler.cache
    scheduler.running.append(_running_request(cache, 0, 100, generated=20))
    paused = _running_request(cache, 1, 60, generated=10)
    paused.offloaded, paused.status = cache.offload(paused.slot), RequestStatus.PAUSED
    scheduler.paused.append(paused)
    scheduler.schedule()
    assert (paused in scheduler.running) == restored and (not scheduler.paused) == restored


def test_with_nothing_running_a_paused_request_comes_back_if_it_fits_at_all():
    scheduler = _scheduler(num_pages=40)
    scheduler.forecast.start_call(64, 2.0)
    paused = _running_request(scheduler.cache, 1, 120, generated=60)  # 31 pages with its next round
    paused.offloaded, paused.status = scheduler.cache.offload(paused.slot), RequestStatus.PAUSED
    scheduler.paused.append(paused)
    scheduler.schedule()
    assert scheduler.running == [paused] and paused.status is RequestStatus.RUNNING


def test_a_request_restored_mid_prefill_keeps_the_pages_its_prompt_still_needs():
    """With mixed steps a request may be paused part-way through its prompt. Restored, the rest of its prompt is
    promised as a running request's is: a waiting request that would take those pages stays out, rather than the
    next prefill step running out of pages (38 pages of one token: 20 held, 5 to come, 15 wanted)."""
    from s3r_hf.engine.prompt_chunks import PromptChunks

    model = tiny_model("llama")
    config = S3RConfig(draft_len=1, page_size=1, num_pages=38, concurrency_min=2, concurrency_max=2,
                       admission_sigmas=None, mixed_steps=True, prefill_chunk_size=20, adaptive=False,
                       share_prompts=False)
    cache = S3RCache(model.config, num_pages=38, page_size=1, max_requests=3)
    scheduler = Scheduler(cache, config, S3RStats())

    def request(row: int, prompt: int) -> Request:
        tokens = torch.zeros(prompt + 7, dtype=torch.long)
        return Request(row=row, prompt_ids=torch.arange(3, 3 + prompt), tokens=tokens, length=prompt, max_new_tokens=5)

    paused, waiting = request(0, 25), request(1, 15)
    paused.slot = cache.add_request()
    cache.reserve(paused.slot, 20)
    cache.set_length(paused.slot, 20)
    paused.prefilled = 20
    paused.offloaded, paused.status = cache.offload(paused.slot), RequestStatus.PAUSED
    scheduler.paused.append(paused)
    scheduler.waiting.append(waiting)
    step = scheduler.schedule()
    assert step.requests == [paused] and list(scheduler.waiting) == [waiting]
    PromptChunks.take(step.requests, cache, config, lambda r, end: cache.reserve(r.slot, end) or True)


def test_the_model_keeps_the_lengths_it_saw_for_its_next_call():
    """A response that ended on EOS is an event, one cut at `max_new_tokens` a censored length; the runtime keeps the
    forecast, and the next call starts from it (weighed by half)."""
    model = s3r_hf.enable(tiny_model("llama", seed=3))
    input_ids, attention_mask = left_padded_batch([6, 9, 7], seed=4)
    config = S3RConfig(draft_len=2, page_size=4)
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=12,
                         eos_token_id=[5, 6, 7, 8], pad_token_id=0, s3r_config=config, return_dict_in_generate=True)
    forecast = runtime_for(model).length_forecast(4)
    lengths = [int((row[input_ids.shape[1]:] != 0).sum()) for row in out.sequences]  # pad 0 only after EOS
    ended = sum(1 for row in out.sequences if any(t in (5, 6, 7, 8) for t in row[input_ids.shape[1]:].tolist()))
    assert forecast.events.sum() == ended
    assert forecast.finished_exposure.sum() == sum(lengths)
    model.generate(input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=4, pad_token_id=0,
                   s3r_config=config)
    assert runtime_for(model).length_forecast(4) is forecast and forecast.events.sum() == ended / 2


# ---------------------------------------------------------------- paging on a simulated long rollout
def test_the_forecast_moves_fewer_pages_than_admitting_whatever_fits():
    """`tools/simulate_paging.py` on a small long-rollout workload (geometric lengths, a pool of half the peak):
    admissions by the forecast pause far fewer requests than admissions of whatever fits, and keep most of their
    rows per round."""
    spec = importlib.util.spec_from_file_location("simulate_paging", SIMULATOR)
    simulator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(simulator)
    args = Namespace(requests=96, prompt_len=16, mean_length=96, max_new_tokens=256, acceptance=0.9, probe_every=None)
    lengths = simulator.response_lengths(args, random.Random(0))
    base = S3RConfig(concurrency_min=32, concurrency_max=48)
    ample = simulator.simulate(base, lengths, 10**5, args, seed=0)
    num_pages = ample["peak_pages"] // 2
    greedy = simulator.simulate(S3RConfig(**{**base.to_dict(), "admission_sigmas": None}), lengths, num_pages, args, 0)
    forecast = simulator.simulate(base, lengths, num_pages, args, 0)
    assert greedy["episodes"] > 0 and greedy["pages_per_1k"] > 3 * forecast["pages_per_1k"]
    assert forecast["rows_per_round"] > 0.7 * greedy["rows_per_round"]


def test_greedy_output_equals_dense_with_admissions_by_the_forecast():
    """Ten requests for a pool of about three at full length, admitted by the forecast (the default): cold in the
    first call, from the lengths the first call showed in the second. Outputs equal dense decoding in both."""
    model = s3r_hf.enable(tiny_model("llama", seed=31))
    input_ids, attention_mask = left_padded_batch([5, 17, 9, 23, 12, 30, 7, 19, 14, 26], seed=32)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=36, pad_token_id=0)
    free = model.generate(input_ids, eos_token_id=None, **kwargs)[:, input_ids.shape[1]:]
    kwargs["eos_token_id"] = [int(free[0, 10]), int(free[3, 20]), int(free[6, 5])]  # some responses end early
    dense = model.generate(input_ids, **kwargs)
    config = S3RConfig(draft_len=3, budget_ratio=0.2, min_budget=2, page_size=4, num_pages=40, concurrency_min=2,
                       concurrency_max=8)
    for _ in range(2):
        out = model.generate(input_ids, s3r_config=config, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, dense)
        assert out.s3r_stats.peak_kv_pages <= 40
    assert runtime_for(model).length_forecast(4).events.sum() > 0
