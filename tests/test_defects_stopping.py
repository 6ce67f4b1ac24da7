"""Stopping criteria are called as dense `generate` calls them: once per step, with the whole batch, and their
per-row answers stop those rows only (issue 20, item 2)."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.request import RequestStatus
from s3r_hf.stopping import BatchStopping
from tests.conftest import left_padded_batch, tiny_model
from tests.test_defects_generate_kwargs import RecordingStreamer

CONFIG = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, seed=0)


class StopOnOwnToken(StoppingCriteria):
    """Row `b` stops once its last token is `stop_ids[b]` (a per-row answer, as dense `generate` allows)."""

    def __init__(self, stop_ids: list[int]) -> None:
        self.stop_ids = torch.tensor(stop_ids)

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.stop_ids.to(input_ids.device)


class StopAfterCalls(StoppingCriteria):
    """Stops every row on its `limit`-th call; records the shape of every `input_ids` it saw."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.shapes.append(tuple(input_ids.shape))
        return torch.full((input_ids.shape[0],), len(self.shapes) >= self.limit, device=input_ids.device)


def _free_run(model, input_ids, attention_mask, max_new_tokens):
    out = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=max_new_tokens)
    return out[:, input_ids.shape[1]:]


@pytest.mark.parametrize("output_scores", [False, True])
def test_per_row_criterion_stops_the_rows_dense_stops(output_scores):
    """Row 0's stop id is a token row 2 generates at step 6: a criterion seen one row at a time would stop row 2
    there (its answer for row 0 is True). Row 1 stops on its own token at step 9; row 2 never stops."""
    model = s3r_hf.enable(tiny_model("qwen3", seed=50))
    input_ids, attention_mask = left_padded_batch([7, 19, 12], seed=51)
    free = _free_run(model, input_ids, attention_mask, 30)
    stop_ids = [int(free[2, 5]), int(free[1, 8]), -1]
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30,
                  stopping_criteria=StoppingCriteriaList([StopOnOwnToken(stop_ids)]))
    if output_scores:
        kwargs.update(return_dict_in_generate=True, output_scores=True)
    dense = model.generate(input_ids, **kwargs)
    out = model.generate(input_ids, s3r_config=CONFIG, **kwargs)
    if output_scores:
        dense, out = dense.sequences, out.sequences
    assert (dense[2, input_ids.shape[1]:] != 0).all(), "row 2 was meant to run to max_new_tokens"
    assert torch.equal(out, dense)
    assert out.shape[1] - input_ids.shape[1] == 30


def test_call_counting_criterion_stops_at_the_step_dense_stops():
    model = s3r_hf.enable(tiny_model("llama", seed=52))
    input_ids, attention_mask = left_padded_batch([9, 4, 15, 11], seed=53)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40)
    dense_criterion, s3r_criterion = StopAfterCalls(13), StopAfterCalls(13)
    dense = model.generate(input_ids, stopping_criteria=StoppingCriteriaList([dense_criterion]), **kwargs)
    out = model.generate(input_ids, s3r_config=CONFIG, stopping_criteria=StoppingCriteriaList([s3r_criterion]),
                         **kwargs)
    assert torch.equal(out, dense)
    assert s3r_criterion.shapes == dense_criterion.shapes  # one call per step, the whole batch each time
    assert out.s3r_stats.drafted > 0


def test_criteria_stop_rows_exactly_under_kv_pressure(monkeypatch):
    """Rows are stopped after they ran ahead, and while paused (offloaded) under KV pressure."""
    stopped = []  # (row, step, status, tokens committed) of each stop
    stop = BatchStopping._stop

    def recorded_stop(self, request, step):
        stopped.append((request.row, step, request.status, len(request.generated)))
        stop(self, request, step)

    monkeypatch.setattr(BatchStopping, "_stop", recorded_stop)
    model = s3r_hf.enable(tiny_model("llama", seed=54))
    input_ids, attention_mask = left_padded_batch([20, 22, 24, 26], seed=55)
    free = _free_run(model, input_ids, attention_mask, 40)
    stop_ids = [int(free[0, 30]), int(free[1, 20]), int(free[2, 10]), -1]
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
                  stopping_criteria=StoppingCriteriaList([StopOnOwnToken(stop_ids)]))
    dense = model.generate(input_ids, **kwargs)
    # Restores and admissions take whatever fits now (`admission_sigmas=None`), so that rows are paused often.
    config = S3RConfig(**{**CONFIG.to_dict(), "num_pages": 30, "utilization_low": 1.0, "utilization_high": 1.0,
                          "admission_sigmas": None})
    out = model.generate(input_ids, s3r_config=config, **kwargs)
    assert torch.equal(out, dense)
    assert out.s3r_stats.offload_episodes > 0, "the pool was meant to run short"
    assert any(status is RequestStatus.PAUSED for _, _, status, _ in stopped), "a paused row was meant to be stopped"
    assert any(committed > step for _, step, _, committed in stopped), "a row was meant to run ahead of its stop"


PRESSURE = S3RConfig(**{**CONFIG.to_dict(), "num_pages": 30, "utilization_low": 1.0, "utilization_high": 1.0,
                         "admission_sigmas": None})


@pytest.mark.parametrize("config", [CONFIG, S3RConfig(), PRESSURE], ids=["fixed", "adaptive", "kv pressure"])
def test_without_eos_rows_a_criterion_stopped_sample_on_until_all_stopped_as_in_dense(config):
    """Dense pads finished rows only with an EOS criterion: without one, a stopped row keeps its real tokens, and
    the call ends at the step the last row stops."""
    model = s3r_hf.enable(tiny_model("llama", seed=54, eos_token_id=None))
    model.generation_config.eos_token_id = None
    input_ids, attention_mask = left_padded_batch([20, 22, 24, 26], seed=55)
    free = _free_run(model, input_ids, attention_mask, 40)
    stop_ids = [int(free[0, 5]), int(free[1, 11]), int(free[2, 17]), int(free[3, 24])]
    streamers = [RecordingStreamer(), RecordingStreamer()]
    outputs = [
        model.generate(input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=40,
                       stopping_criteria=StoppingCriteriaList([StopOnOwnToken(stop_ids)]), streamer=streamer,
                       **options)
        for streamer, options in zip(streamers, [{}, {"s3r_config": config}])
    ]
    dense, out = outputs
    new_tokens = dense.shape[1] - input_ids.shape[1]
    assert new_tokens < 40, "every row was meant to stop before max_new_tokens"
    assert torch.equal(dense[:, input_ids.shape[1]:], free[:, :new_tokens]), "dense was meant to keep real tokens"
    assert torch.equal(out, dense)
    assert streamers[1].puts == streamers[0].puts
    if config is PRESSURE:
        assert out.s3r_stats.offload_episodes > 0, "the pool was meant to run short"


@pytest.mark.parametrize("own", ["eos", "max_length", "both", "max_length within the prompt"])
def test_a_callers_eos_or_max_length_criterion_replaces_the_configs_as_in_dense(own):
    """transformers builds an `EosTokenCriteria` and a `MaxLengthCriteria` from the generation config, and one of the
    same type passed in `stopping_criteria` replaces its own: S3R stops rows where those say, not the config."""
    from transformers import EosTokenCriteria, MaxLengthCriteria

    model = s3r_hf.enable(tiny_model("qwen3", seed=52))
    input_ids, attention_mask = left_padded_batch([8, 20, 31, 14], seed=53)
    free = _free_run(model, input_ids, attention_mask, 30)
    criteria = []
    if own in ("eos", "both"):
        criteria.append(EosTokenCriteria(eos_token_id=int(free[0, 6])))  # row 0's seventh token
    if own in ("max_length", "both"):
        criteria.append(MaxLengthCriteria(max_length=input_ids.shape[1] + 12))
    if own == "max_length within the prompt":  # dense generates one token before it asks any criterion
        criteria.append(MaxLengthCriteria(max_length=input_ids.shape[1] - 3))
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=30,
                  stopping_criteria=StoppingCriteriaList(criteria))
    dense = model.generate(input_ids, **kwargs)
    assert dense.shape[1] < input_ids.shape[1] + 30 or own == "eos"
    assert torch.equal(model.generate(input_ids, s3r_config=CONFIG, **kwargs), dense)

