"""Tiny random models and batched prompts shared by the tests (fp32, CPU, seeded)."""

from __future__ import annotations

import os
from pathlib import Path

# Triton kernels run on CPU tensors through Triton's interpreter where there is no GPU (CI). The variable must be
# set before anything imports Triton (torch and transformers may), hence before the imports below.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# Tiny models: one thread is much faster than several contending for the CI machine's two cores.
torch.set_num_threads(1)

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model(kind: str = "qwen3", seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, **overrides}))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    else:
        raise ValueError(kind)
    return model.eval()


def left_padded_batch(lengths: list[int], vocab: int = 256, seed: int = 0, pad: int = 0):
    """`input_ids`, `attention_mask` of random prompts (tokens >= 3) left-padded to the longest."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = torch.randint(3, vocab, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


WORDS = "<unk> <eos> <user> <assistant> a the how many is of and books eggs dollars ? . 1 2 3 4 5 6 7 8 9".split()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built offline, with an EOS token, a chat template and no pad token."""
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = (
        "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    return tokenizer


def word_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny random Llama over the `tiny_tokenizer` vocabulary, with its EOS."""
    torch.manual_seed(seed)
    config = {**TINY, "vocab_size": len(WORDS), "max_position_embeddings": 128, "eos_token_id": WORDS.index("<eos>"),
              "bos_token_id": None, "pad_token_id": None}
    return LlamaForCausalLM(LlamaConfig(**{**config, **overrides})).eval()


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    """A saved `word_model` with its `tiny_tokenizer`: a local model directory as `--model` takes it."""
    directory = tmp_path / "tiny-llama"
    word_model().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(params=["qwen3", "llama"])
def model_kind(request) -> str:
    return request.param


@pytest.fixture
def view_checks(monkeypatch):
    """After every round: each running request's views are sorted, end at its last committed position, and are as
    long as the host thinks. Also counts refreshed and extended rounds."""
    from s3r_hf.engine.round import SpeculativeRound
    from s3r_hf.engine.view_updates import IndexViewUpdates
    from s3r_hf.request import RequestStatus

    counts = {"refresh": 0, "extend": 0}
    original_run, original_rebuild, original_extend = (
        SpeculativeRound.run, IndexViewUpdates.rebuild, IndexViewUpdates.extend
    )

    def checked_run(self, requests, k, prompts=None):
        verified = original_run(self, requests, k, prompts)
        views = self.cache.index_views
        for request in requests:
            if request.status is RequestStatus.FINISHED:
                continue
            length = int(views.lengths[request.slot])
            assert length == request.view_len
            positions = views.positions[:, request.slot, :, :length]
            assert bool((positions[..., 1:] > positions[..., :-1]).all()), "a view is not sorted"
            if not self.views_stale:  # after a dense step the views wait for the next refresh
                assert bool((positions[..., -1] == request.committed - 1).all()), "a view misses the latest token"
        return verified

    def counted(name, original):
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(SpeculativeRound, "run", checked_run)
    monkeypatch.setattr(IndexViewUpdates, "rebuild", counted("refresh", original_rebuild))
    monkeypatch.setattr(IndexViewUpdates, "extend", counted("extend", original_extend))
    return counts
