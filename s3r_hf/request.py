"""`Request`: one response being generated, with everything needed to pause and resume it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from s3r_hf.cache.kv_offload import OffloadedRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet
    RUNNING = "running"  # KV resident, in the batch
    PAUSED = "paused"  # KV offloaded to host memory
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt row of the `generate` call and its response so far.

    `tokens[:length]` is the row exactly as `generate` would hand it to logits processors and stopping
    criteria: the (left-padded) prompt row followed by the generated tokens. The cache holds K/V for the first
    `committed` real tokens (prompt without padding, then generated ones); `pending` is the last generated
    token, whose K/V the next round computes. Token buffers live on the CPU, so bookkeeping never launches
    device work; they move to the device only where a processor reads them.
    """

    row: int
    prompt_ids: torch.Tensor  # real prompt tokens, no padding
    tokens: torch.Tensor  # buffer: padded prompt row, then generated tokens
    length: int  # valid entries of `tokens`
    max_new_tokens: int  # this row's limit (`max_length` less the padded prompt)
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    prefilled: int = 0  # prompt tokens whose K/V are in the cache
    committed: int = 0  # K/V valid length
    pending: int | None = None
    view_len: int = 0  # size of the request's index views (the same for every layer and KV head)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    raw_logits: list[torch.Tensor] = field(default_factory=list)
    offloaded: OffloadedRequest | None = None
    # `len(prompt_ids)`, kept as a plain attribute: the scheduler reads it for every running request every step.
    prompt_len: int = field(init=False, default=0)
    _prompt_key: bytes | None = field(init=False, default=None, repr=False)

    @property
    def prompt_key(self) -> bytes:
        """The prompt's tokens as bytes (identical prompts, identical keys), made once."""
        if self._prompt_key is None:
            self._prompt_key = self.prompt_ids.numpy().tobytes()
        return self._prompt_key

    @property
    def history(self) -> torch.Tensor:
        return self.tokens[: self.length]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def peak_kv_tokens(self, draft_len: int) -> int:
        """Most K/V positions the request can ever hold: prompt, every new token, one round's drafts."""
        return self.prompt_len + self.max_new_tokens + draft_len + 1

    @property
    def kv_tokens(self) -> int:
        """Tokens of K/V this request keeps (prompt while prefilling, committed context after)."""
        return max(self.prefilled, self.committed)

    def __post_init__(self) -> None:
        self.prompt_len = int(self.prompt_ids.shape[0])
        # A NumPy view of the CPU token buffer: writing one entry through it is an order of magnitude cheaper than a
        # torch tensor item assignment, and the commit loop writes every generated token of every request.
        self._token_array = self.tokens.numpy()

    def append(self, token: int) -> None:
        self._token_array[self.length] = token
        self.length += 1
        self.generated.append(token)

    def extend(self, tokens: list[int]) -> None:
        """Append a block of tokens with one slice write; the engine commits a round's accepted block this way."""
        end = self.length + len(tokens)
        if end > len(self._token_array):  # a slice write would broadcast one token into an empty slice silently
            raise IndexError(f"token buffer of {len(self._token_array)} entries cannot hold {end}")
        if len(tokens) == 1:  # a dense step's token: an item write costs less than a slice write
            self._token_array[self.length] = tokens[0]
        else:
            self._token_array[self.length : end] = tokens
        self.length = end
        self.generated.extend(tokens)

    def truncate(self, count: int) -> None:
        """Keep only the first `count` generated tokens (and their log-probs, scores and logits): a stopping
        criterion ended the response at token `count` after the engine had already committed more."""
        dropped = len(self.generated) - count
        if dropped <= 0:
            return
        self.length -= dropped
        del self.generated[count:], self.logprobs[count:], self.scores[count:], self.raw_logits[count:]
        self.pending = self.generated[-1] if self.generated else None
