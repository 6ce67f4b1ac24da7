"""`streamer`, `stop_strings` with `tokenizer`, and `synced_gpus` reach S3R although transformers 5.x does not pass
them to a callable `custom_generate` (issue 20, item 3)."""

from __future__ import annotations

import threading

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import s3r_hf
from s3r_hf import S3RConfig
from s3r_hf.cache.page_allocator import KVCapacityError
from tests.conftest import left_padded_batch, tiny_model, tiny_tokenizer, word_model

CONFIG = S3RConfig(adaptive=False, draft_len=4, budget_ratio=0.1, min_budget=2, page_size=4, seed=0)


class RecordingStreamer(BaseStreamer):
    """Keeps every `put` (as a list) and how often `end` was called."""

    def __init__(self) -> None:
        self.puts: list[list] = []
        self.ends = 0

    @property
    def ended(self) -> bool:
        return self.ends > 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("route", ["enable", "custom_generate"])
@pytest.mark.parametrize("lengths", [[13], [6, 17, 11]])
def test_streamer_gets_the_prompt_each_step_and_end_as_in_dense(route, lengths):
    """The prompt (from transformers), then each step's tokens `[B]` (finished rows padded), then `end()`."""
    model = tiny_model("qwen3", seed=60)
    input_ids, attention_mask = left_padded_batch(lengths, seed=61)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=25)
    dense_streamer, s3r_streamer = RecordingStreamer(), RecordingStreamer()
    dense = model.generate(input_ids, streamer=dense_streamer, **kwargs)
    if route == "enable":
        out = s3r_hf.enable(model).generate(input_ids, streamer=s3r_streamer, s3r_config=CONFIG, **kwargs)
    else:
        out = model.generate(input_ids, streamer=s3r_streamer, custom_generate=s3r_hf.generate, s3r_config=CONFIG,
                             **kwargs)
    assert torch.equal(out, dense)
    assert s3r_streamer.puts == dense_streamer.puts
    assert s3r_streamer.ended and dense_streamer.ended


def test_text_iterator_streamer_consumer_gets_the_text_and_returns():
    """A `TextIteratorStreamer` consumer in another thread reads the generated text to the end (it used to block
    forever: the streamer got the prompt only, never `end()`)."""
    tokenizer = tiny_tokenizer()
    model = s3r_hf.enable(word_model(seed=62))
    input_ids = tokenizer("<user> how many books ? <assistant>", return_tensors="pt").input_ids
    texts = {}
    for name, extra in (("dense", {}), ("s3r", {"s3r_config": CONFIG})):
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
        call = threading.Thread(target=model.generate, daemon=True, kwargs=dict(
            input_ids=input_ids, do_sample=False, max_new_tokens=30, streamer=streamer, **extra))
        call.start()
        texts[name] = "".join(streamer)  # raises queue.Empty after the timeout if the stream never ends
        call.join(60)
    assert texts["s3r"] == texts["dense"]
    assert texts["dense"].strip()


@pytest.mark.parametrize("refusal", ["context window", "KV pool", "dropout in training mode", "engine mode"])
def test_a_refused_call_ends_its_streamer(refusal):
    """transformers feeds the prompt to the streamer before S3R runs: a call S3R refuses (a model in training mode with
    dropout, among the first checks; new tokens past the context window, before the requests are built; a KV pool
    too small for them, once they are; an engine mode it does not know, when the engine is built) still ends the
    streamer, once, so that a consumer in another thread returns instead of waiting forever."""
    model = s3r_hf.enable(word_model(seed=62, attention_dropout=0.1))  # a context window of 128 positions
    model.train(refusal == "dropout in training mode")
    input_ids, _ = left_padded_batch([12], seed=3)
    max_new, config, error, extra = 20, CONFIG, ValueError, {}
    if refusal == "context window":
        max_new = 130
    elif refusal == "KV pool":
        config, error = S3RConfig(page_size=4, num_pages=2), KVCapacityError
    elif refusal == "engine mode":
        extra = {"s3r_mode": "no such mode"}
    streamer = RecordingStreamer()
    with pytest.raises(error):
        model.generate(
            input_ids, do_sample=False, max_new_tokens=max_new, streamer=streamer, s3r_config=config, **extra
        )
    assert streamer.ends == 1


@pytest.mark.parametrize("refusal", ["two rows", "padded prompt", "dropout in training mode"])
def test_a_refused_assisted_call_ends_its_streamer(refusal):
    """The same for `assisted_generate`, whose own refusals (batch size, padding) come after the first checks."""
    model = word_model(seed=62, attention_dropout=0.1)
    model.train(refusal == "dropout in training mode")
    input_ids, attention_mask = left_padded_batch([12, 9] if refusal == "padded prompt" else [12, 12], seed=3)
    if refusal != "two rows":
        input_ids, attention_mask = input_ids[-1:], attention_mask[-1:]
    if refusal == "padded prompt":
        assert not attention_mask.all()
    streamer = RecordingStreamer()
    with pytest.raises(ValueError):
        model.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8, streamer=streamer,
            custom_generate=s3r_hf.assisted_generate, s3r_config=CONFIG,
        )
    assert streamer.ends == 1


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (what `StopStringCriteria` needs to map tokens to text), built offline;
    `<unk>` (0) pads, `<eos>` is 1."""
    vocab = {"<unk>": 0, "<eos>": 1, **{chr(code): code - 30 for code in range(32, 127)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>")


def test_stop_strings_with_tokenizer_stop_where_dense_stops():
    tokenizer = char_tokenizer()
    model = s3r_hf.enable(tiny_model("llama", seed=63, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=1))
    batch = tokenizer(["how many eggs?", "the books cost 5 dollars."], return_tensors="pt", padding=True,
                      padding_side="left")
    kwargs = dict(attention_mask=batch.attention_mask, do_sample=False, max_new_tokens=30)
    free = model.generate(batch.input_ids, **kwargs)[:, batch.input_ids.shape[1]:]
    stop_string = tokenizer.decode(free[1, 7:9])  # two characters row 1 writes after 9 tokens
    kwargs.update(stop_strings=[stop_string], tokenizer=tokenizer)
    dense = model.generate(batch.input_ids, **kwargs)
    out = model.generate(batch.input_ids, s3r_config=CONFIG, **kwargs)
    assert torch.equal(out, dense)
    assert dense.shape[1] < batch.input_ids.shape[1] + 30, "the stop string was meant to end generation early"


@pytest.mark.parametrize("where", ["explicit None over the model's", "in a positional generation_config"])
def test_stop_strings_are_resolved_as_transformers_resolves_them(where, caplog):
    """An explicit `stop_strings=None` outranks the model's generation config (dense then does not stop on them), and
    a `generation_config` passed by position is read for its stop strings as one passed by name."""
    tokenizer = char_tokenizer()
    model = s3r_hf.enable(tiny_model("llama", seed=63, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=1))
    batch = tokenizer(["how many eggs?", "the books cost 5 dollars."], return_tensors="pt", padding=True,
                      padding_side="left")
    kwargs = dict(attention_mask=batch.attention_mask, tokenizer=tokenizer)
    free = model.generate(batch.input_ids, do_sample=False, max_new_tokens=30, **kwargs)[:, batch.input_ids.shape[1]:]
    stop_string = tokenizer.decode(free[1, 7:9])
    config = GenerationConfig(do_sample=False, max_new_tokens=30, stop_strings=[stop_string], eos_token_id=1,
                              pad_token_id=0)
    if where == "explicit None over the model's":
        model.generation_config.stop_strings = [stop_string]
        args, kwargs = (batch.input_ids,), dict(kwargs, do_sample=False, max_new_tokens=30, stop_strings=None)
    else:
        args = (batch.input_ids, config)
    dense = model.generate(*args, **kwargs)
    caplog.clear()
    out = model.generate(*args, s3r_config=CONFIG, **kwargs)
    assert torch.equal(out, dense)
    if where == "in a positional generation_config":  # nothing passed beside the config, so no warning of it
        assert not [r for r in caplog.records if "deprecated" in r.getMessage()]
    stopped_early = dense.shape[1] < batch.input_ids.shape[1] + 30
    assert stopped_early == (where != "explicit None over the model's")


@pytest.mark.parametrize("where", ["argument", "model's generation config"])
def test_token_healing_is_refused_by_name_with_its_remedy(where):
    """transformers drops the tokenizer before S3R runs and then asked for a tokenizer the caller had passed."""
    tokenizer = char_tokenizer()
    model = s3r_hf.enable(tiny_model("llama", seed=63, vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=1))
    batch = tokenizer(["how many eggs?"], return_tensors="pt")
    kwargs = dict(attention_mask=batch.attention_mask, tokenizer=tokenizer, max_new_tokens=4)
    if where == "argument":
        kwargs["token_healing"] = True
    else:
        model.generation_config.token_healing = True
    with pytest.raises(ValueError, match=r"token_healing=True is not supported.*model\.heal_tokens"):
        model.generate(batch.input_ids, s3r_config=CONFIG, **kwargs)


def test_generate_arguments_by_position_reach_s3r_as_by_name():
    """`enable`'s `generate` takes transformers' positional arguments; one given twice is refused as Python would."""
    model = s3r_hf.enable(tiny_model("llama", seed=64))
    input_ids, attention_mask = left_padded_batch([5, 8], seed=66)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=0)
    by_name = model.generate(input_ids, attention_mask=attention_mask, generation_config=config, s3r_config=CONFIG)
    by_position = model.generate(input_ids, config, attention_mask=attention_mask, s3r_config=CONFIG)
    assert torch.equal(by_position, by_name)
    with pytest.raises(TypeError, match="multiple values for argument 'generation_config'"):
        model.generate(input_ids, config, generation_config=config, s3r_config=CONFIG)


def test_stop_strings_through_custom_generate_are_refused_by_transformers():
    """Documented: without `enable`, transformers drops the tokenizer before S3R runs and refuses stop strings."""
    tokenizer = tiny_tokenizer()
    model = word_model(seed=64)
    input_ids = tokenizer("<user> how many books ? <assistant>", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(input_ids, max_new_tokens=5, stop_strings=["books"], tokenizer=tokenizer,
                       custom_generate=s3r_hf.generate, s3r_config=CONFIG)


@pytest.mark.parametrize("route", ["enable", "custom_generate"])
def test_synced_gpus_is_refused(route):
    model = tiny_model("llama", seed=65)
    input_ids, attention_mask = left_padded_batch([5, 8], seed=66)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=5, synced_gpus=True, s3r_config=CONFIG)
    if route == "custom_generate":
        kwargs["custom_generate"] = s3r_hf.generate
    else:
        model = s3r_hf.enable(model)
    with pytest.raises(ValueError, match="synced_gpus"):
        model.generate(input_ids, **kwargs)
