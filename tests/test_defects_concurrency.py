"""S3R calls from several threads on one model: the model is never left changed, other threads' dense forwards stay
dense, and concurrent S3R calls are serialized (issue 20, item 1)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.model_session import owns
from tests.conftest import left_padded_batch, tiny_model

CONFIG = S3RConfig(adaptive=False, draft_len=3, budget_ratio=0.1, min_budget=2, page_size=4, seed=0)
TIMEOUT = 120  # seconds; only reached when something is broken


class PauseInside(StoppingCriteria):
    """On its first call (inside the S3R call, between rounds) signals `inside` and waits for `proceed`; never stops
    a row."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.proceed = threading.Event()

    def __call__(self, input_ids, scores, **kwargs):
        if not self.inside.is_set():
            self.inside.set()
            self.proceed.wait(TIMEOUT)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class Call(threading.Thread):
    """`model.generate(**kwargs)` in a thread, keeping its result or its exception."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__(daemon=True)
        self.model, self.kwargs = model, kwargs
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            self.result = self.model.generate(**self.kwargs)
        except Exception as error:  # reported by the test
            self.error = error


def _setup(seed: int, **model_overrides):
    model = s3r_hf.enable(tiny_model("llama", seed=seed, **model_overrides))
    input_ids, attention_mask = left_padded_batch([5, 12, 9], seed=seed + 1)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=12)
    with torch.no_grad():
        reference = model(input_ids, attention_mask=attention_mask).logits
    return model, kwargs, reference, model.generate(**kwargs)


def _assert_unchanged(model, kwargs, reference, implementation="sdpa"):
    assert model.config._attn_implementation == implementation
    with torch.no_grad():
        logits = model(kwargs["input_ids"], attention_mask=kwargs["attention_mask"]).logits
    assert torch.equal(logits, reference), "a padded forward no longer matches the model's own"


def test_paired_s3r_calls_in_threads_give_dense_output_and_leave_the_model_unchanged():
    model, kwargs, reference, dense = _setup(seed=40)
    for _ in range(10):
        calls = [Call(model, s3r_config=CONFIG, **kwargs) for _ in range(2)]
        for call in calls:
            call.start()
        for call in calls:
            call.join(TIMEOUT)
            assert call.error is None, call.error
            assert torch.equal(call.result, dense)
        _assert_unchanged(model, kwargs, reference)


def test_a_second_s3r_call_waits_for_the_first():
    model, kwargs, reference, dense = _setup(seed=42)
    first, second = PauseInside(), PauseInside()
    second.proceed.set()  # once it runs, the second call does not pause
    call_a = Call(model, s3r_config=CONFIG, stopping_criteria=StoppingCriteriaList([first]), **kwargs)
    call_b = Call(model, s3r_config=CONFIG, stopping_criteria=StoppingCriteriaList([second]), **kwargs)
    call_a.start()
    assert first.inside.wait(TIMEOUT)
    call_b.start()
    entered_alongside = second.inside.wait(1.0)
    first.proceed.set()
    for call in (call_a, call_b):
        call.join(TIMEOUT)
        assert call.error is None, call.error
        assert torch.equal(call.result, dense)
    assert not entered_alongside, "two S3R calls ran on one model at once"
    _assert_unchanged(model, kwargs, reference)


@pytest.mark.parametrize("compile_layers", [False, True])
def test_dense_forwards_in_another_thread_during_an_s3r_call_are_dense(compile_layers):
    """While an S3R call is between rounds, the main thread's padded forward and dense `generate` on the same model
    are the model's own, bit for bit (with compiled layers too: they dispatch to the eager code off the S3R thread)."""
    model, kwargs, reference, dense = _setup(seed=44 if compile_layers else 46)
    pause = PauseInside()
    config = S3RConfig(**{**CONFIG.to_dict(), "compile_layers": compile_layers})
    if compile_layers:
        torch._dynamo.reset()
    call = Call(model, s3r_config=config, stopping_criteria=StoppingCriteriaList([pause]), **kwargs)
    call.start()
    try:
        assert pause.inside.wait(TIMEOUT)
        assert not owns(model)
        _assert_unchanged(model, kwargs, reference)
        assert torch.equal(model.generate(**kwargs), dense)
    finally:
        pause.proceed.set()
        call.join(TIMEOUT)
    assert call.error is None, call.error
    assert torch.equal(call.result, dense)
    _assert_unchanged(model, kwargs, reference)


class CallsInside(StoppingCriteria):
    """Runs `action()` on its first call (inside the S3R call, between rounds) and keeps what it returned or raised;
    never stops a row."""

    def __init__(self, action) -> None:
        self.action, self.result, self.error, self.called = action, None, None, False

    def __call__(self, input_ids, scores, **kwargs):
        if not self.called:
            self.called = True
            try:
                self.result = self.action()
            except Exception as error:  # reported by the test
                self.error = error
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _sees_the_model_as_its_own(model, kwargs, reference):
    """A callback's action: outside the S3R call by `owns`, a padded forward gives the model's own logits, and a
    dense `generate` runs (its output is the action's result)."""

    def inside():
        assert not owns(model)
        _assert_unchanged(model, kwargs, reference)
        return model.generate(**kwargs)

    return inside


@pytest.mark.parametrize("compile_layers", [False, True])
def test_a_stopping_criterion_s_forwards_and_dense_generate_on_the_model_are_dense(compile_layers):
    """A callback of the S3R call, in the same thread, sees the model as its own code runs it: a padded forward and a
    dense `generate` give the model's own results (they used to run under S3R's attention override)."""
    model, kwargs, reference, dense = _setup(seed=48 if compile_layers else 50)
    config = S3RConfig(**{**CONFIG.to_dict(), "compile_layers": compile_layers})
    if compile_layers:
        torch._dynamo.reset()
    criterion = CallsInside(_sees_the_model_as_its_own(model, kwargs, reference))
    out = model.generate(s3r_config=config, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
    assert criterion.called and criterion.error is None, criterion.error
    assert torch.equal(criterion.result, dense)
    assert torch.equal(out, dense)
    _assert_unchanged(model, kwargs, reference)


class ProcessorCallsInside(LogitsProcessor):
    """A logits processor that runs `action` (holding the model in a closure, as a scoring function would) on its
    first call and leaves the scores unchanged."""

    def __init__(self, action) -> None:
        self.inner = CallsInside(action)

    def __call__(self, input_ids, scores):
        self.inner(input_ids, scores)
        return scores


def test_a_logits_processor_s_forwards_and_dense_generate_on_the_model_are_dense():
    """A logits processor runs inside the S3R call, as stopping criteria do, and sees the model as its own code runs
    it: its forwards used to run under S3R's packed attention and gave other logits."""
    model, kwargs, reference, dense = _setup(seed=54)
    processor = ProcessorCallsInside(_sees_the_model_as_its_own(model, kwargs, reference))
    out = model.generate(s3r_config=CONFIG, logits_processor=LogitsProcessorList([processor]), **kwargs)
    assert processor.inner.called and processor.inner.error is None, processor.inner.error
    assert torch.equal(processor.inner.result, dense)
    assert torch.equal(out, dense)
    _assert_unchanged(model, kwargs, reference)


def test_an_s3r_call_nested_in_a_callback_of_one_on_the_same_model_is_refused():
    """An S3R call from a stopping criterion of an S3R call on the same model would reset the kept pool under the
    outer call (a KeyError, once): refused by name. On another model it runs."""
    model, kwargs, _, dense = _setup(seed=52)
    other = s3r_hf.enable(tiny_model("llama", seed=53))
    criterion = CallsInside(lambda: model.generate(s3r_config=CONFIG, **kwargs))
    out = model.generate(s3r_config=CONFIG, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
    assert isinstance(criterion.error, RuntimeError) and "cannot nest" in str(criterion.error)
    assert torch.equal(out, dense)  # the refused inner call left the outer one intact
    criterion = CallsInside(lambda: other.generate(s3r_config=CONFIG, **kwargs))
    out = model.generate(s3r_config=CONFIG, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
    assert criterion.error is None, criterion.error
    assert torch.equal(criterion.result, other.generate(**kwargs))
    assert torch.equal(out, dense)
