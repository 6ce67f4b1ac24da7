"""`S3RConfig`: the knobs of Self-Sparse Speculative Rollouts, with the paper's defaults."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from s3r_hf.draft_policy import MAX_ADAPTIVE_REFRESH_INTERVAL

MAX_DRAFT_LEN = 64
"""The largest `S3RConfig.draft_len`: verify blocks of up to 65 queries, which the attention kernels tile as
decode-shaped segments (`kernels/triton_backend.PREFILL_QUERIES`)."""
DRAFT_WEIGHT_FORMATS: dict[str, tuple[torch.dtype, int | None]] = {
    "int8": (torch.int8, None),
    "int8-g64": (torch.int8, 64),
    "int8-g128": (torch.int8, 128),
}
"""`S3RConfig.draft_weights`' 8-bit formats (`draft_weights.py`): the copies' dtype, and the weights along a row that
share a scale (None: the whole row). Float8 (e4m3) copies, which the kernel also takes, round each weight to three
mantissa bits: on SmolLM2's real text they lowered τ over three times as much as int8 copies of the same size
(docs/benchmarks.md), so they are not offered."""
DRAFT_WEIGHTS = ("model", *DRAFT_WEIGHT_FORMATS)
"""`S3RConfig.draft_weights`' values: the model's own weights, or 8-bit copies in one of `DRAFT_WEIGHT_FORMATS`."""


@dataclass
class S3RConfig:
    """Configuration of S3R generation.

    Defaults follow the paper (S3R §C.2 and Appendix B): six drafted tokens per round, a sparse KV budget of
    5% of the context with at least 192 positions, and the KV-aware AIMD scheduler's constants.

    Args:
        draft_len (`int`, defaults to 6):
            Tokens the sparse drafter proposes per round (`k`); the correction or bonus token is extra. With
            `adaptive=True` the largest `k` a round may draft.
        adaptive (`bool`, defaults to `True`):
            Choose each round's draft length `k ∈ {0, …, draft_len}` from the round costs measured during the call
            and the acceptance seen so far, to commit the most tokens per second; `k = 0` is a plain dense step, so
            where drafting cannot pay (small models, short contexts, the last few requests of a rollout) S3R decodes
            as the dense engine does. `False` drafts `draft_len` tokens every round, as the paper does. The samples
            are exact either way.
        adaptive_draft_lengths (`tuple[int, ...]`, *optional*):
            The draft lengths the adaptive rule chooses among; they must include 0 and `draft_len`. `None` (the
            default): a dense step or a full `draft_len` round. Lengths in between, e.g. `(0, 3, 6)`, pay where a draft
            pass costs nearly what the verify does (float32 models at a few rows, where the later drafts of a long
            round are accepted too rarely to pay their pass); each length runs CUDA graphs of its own (a draft
            phase and a verify block), captured the first time the rule picks it at a batch size. Needs `adaptive=True`.
        budget_ratio (`float`, defaults to 0.05):
            Fraction `s` of a request's committed context that each (layer, KV head) index view keeps.
        min_budget (`int`, defaults to 192):
            Lower bound `K_min` on the index-view size; a context shorter than this is drafted densely.
        refresh_interval (`int`, *optional*):
            Rounds between index-view refreshes. A refresh selects each view's top-K anew from the verify's attention
            scores (the paper does so every round); in the rounds between, the verify computes no scores and the
            views only gain the newly committed tokens. Longer intervals save the score material and the top-K
            selection at some cost in acceptance; the samples are exact for any value. `None` (the default): with
            `adaptive=True` the interval, up to `MAX_ADAPTIVE_REFRESH_INTERVAL` rounds, is chosen from the round
            costs and the acceptance by view age measured during the call; with `adaptive=False` every round
            refreshes, as in the paper.
        page_size (`int`, defaults to 16):
            Tokens per KV page.
        num_pages (`int`, *optional*):
            KV pages per layer. `None` sizes the pool for the call: all requests at full length, on CUDA at most
            `kv_memory_fraction` of the device memory free when the call starts (requests beyond that wait).
        kv_memory_fraction (`float`, defaults to 0.8):
            Share of the free device memory a pool sized by default (`num_pages=None`) may take; the rest is left
            for activations, CUDA graphs and compiled layers.
        prefill_chunk_size (`int`, defaults to 2048):
            Most prompt tokens packed into one forward during prefill (and into one mixed step).
        mixed_steps (`bool`, defaults to `False`):
            Pack the prompt chunks of newly admitted or restored requests into the verify forward of the running
            requests' round (a mixed step, up to `prefill_chunk_size` prompt tokens), so new requests do not stall
            decoding. Mixed steps run eagerly (CUDA graphs cover pure decode steps) and queue no early launch.
            Off: any prompt left to prefill makes the step a prefill step that every decoding request waits for.
        share_prompts (`bool`, defaults to `True`):
            Compute each prompt once among requests with identical prompts (the `num_generations` responses of a
            GRPO prompt, or `num_return_sequences`). A request whose prompt another running request is prefilling
            waits and copies its K/V pages, index views and last-token logits (its first token is its own sample);
            one whose prompt a running request already holds copies all but the last token and prefills that one.
            Exact: the same prompt gives the same K/V and first-token distribution.
        concurrency_min / concurrency_max (`int`, defaults to 160 / 256):
            AIMD bounds `(C_min, C_max)` on concurrently running requests.
        concurrency_step (`int`, defaults to 5):
            Additive increase `delta` of the concurrency limit.
        concurrency_backoff (`float`, defaults to 0.7):
            Multiplicative decrease `beta` of the concurrency limit.
        utilization_low / utilization_high (`float`, defaults to 0.8 / 0.95):
            KV-utilisation thresholds `(u_low, u_high)` of the AIMD rule.
        restore_backlog_threshold (`int`, defaults to 3):
            Restore backlog `O_th` above which the limit backs off.
        admission_sigmas (`float` or `None`, defaults to 2.0):
            While requests run, a paused request is restored, or a new one admitted, only if the running requests
            and it are forecast to fit the pool at every coming step with this many standard deviations to spare
            (`engine/kv_forecast.py`: the expected KV of those still running, from the response lengths seen so
            far, kept from call to call). Higher pauses fewer requests and runs fewer at once; 0 admits on the
            expected KV alone. `None` admits whatever the free pages hold now: the most requests at once, and the
            most pauses.
        cuda_graphs (`bool`, defaults to `False`):
            On CUDA, capture the round's draft phase, dense decode steps and verify blocks as CUDA graphs per
            batch bucket and replay them. Each graph holds its own scratch memory for the call (estimated for a
            Qwen3-1.7B shape at B=64, S=8K: about 0.9 GB per verify bucket, mostly the per-layer verify scores).
        compile_layers (`bool`, defaults to `False`):
            `torch.compile` each decoder layer for engine forwards (the S3R attention and K/V writes stay outside
            the compiled graphs), so the elementwise work around the GEMMs runs as a few fused kernels, and
            Q/K/V and gate/up each run as one GEMM over concatenated weight copies, refilled from the model's
            weights on every call (SmolLM2-135M: 139 MB, Qwen3-1.7B: 1.9 GB in bf16). The first call pays the
            compilation; with `cuda_graphs` the fused kernels are what the graphs replay.
        fused_layers (`bool`, defaults to `False`):
            Run each decoder layer of decode-shaped engine forwards (draft passes, dense steps, verify blocks) as
            four Triton kernels around the attention: norm + Q/K/V GEMM + rotary + the K/V write, O GEMM + residual,
            norm + gate/up GEMM + SiLU·mul, down GEMM + residual (`s3r_hf.fused_layers`). Llama-family layers
            (Llama, Qwen2, Qwen3, Mistral, SmolLM) with plain linears and a head dimension that is a power of two
            of at least 32; other models are refused. The kernels read the model's own weights: nothing is copied.
            Prefill chunks run the layers' own forward (compiled with `compile_layers`). On an H200 in bfloat16 it
            is faster than the compiled layers only up to 32 rows and no faster in whole rollout calls; in float32,
            where cuBLAS runs a few rows' GEMMs on SIMT cores and these kernels use tensor cores (three TF32
            products per product, float32's accuracy), whole rollout calls of 32 rows ran 1.14-1.19x faster, in
            engine AR and S3R alike (`docs/benchmarks.md`). Off by default until a fresh machine's GRPO steps are
            measured with it.
        draft_matmul_precision (`str`, defaults to `"high"`):
            For float32 models on CUDA, the precision of the draft passes' matmuls, as in
            `torch.set_float32_matmul_precision`: `"high"` runs them on TF32 tensor cores, `"highest"` in full
            float32. A draft is only a proposal: the verify forward stays in full float32 and the acceptance uses
            the scores the drafts were sampled from, so the samples are exact either way; TF32 can only change how
            often drafts are accepted. On an H200 a float32 SmolLM2 round at 16-32 rows cost 12% less with TF32
            drafts at the same acceptance (`docs/benchmarks.md`). The Triton kernels follow the same setting: with
            `fused_layers` a TF32 draft pass runs one TF32 product per product instead of three, and so do the
            sparse draft attention and the LM head. With `compile_layers` the layers compile once more for the TF32
            setting (torch.compile guards on it). torch keeps the setting per process: while an eager draft pass runs
            (or a draft graph is captured), another thread's float32 matmuls run in TF32 too; replays of captured
            graphs do not set it. Other dtypes ignore it.
        draft_weights (`str`, defaults to `"model"`):
            The weights the draft passes' decoder-layer linears read: `"model"`, the model's own; `"int8"`, int8
            copies with a scale per output feature; `"int8-g64"` and `"int8-g128"`, int8 copies with a scale per 64
            or 128 weights along a row (closer to the model's weights; each linear's input width must be a multiple
            of the group). The copies are half the bytes a draft pass's GEMMs read in bfloat16, quantized
            from the model's weights at the start of every call (an optimizer step between calls is picked up) and
            kept with the model's state between calls (half the size of those weights in bfloat16). Like
            `draft_matmul_precision` it changes only the proposals: the verify forward runs the model's own
            weights and the acceptance uses the scores the drafts were sampled from, so samples stay exact, and only
            how often drafts are accepted can change (`docs/benchmarks.md`). On CUDA the 8-bit products run in a
            Triton kernel; elsewhere in its torch reference. Not with `fused_layers`, whose kernels read the
            model's linears directly.
        keep_state (`bool`, defaults to `True`):
            Keep the KV pool, the CUDA graphs and the fused weights for the model's next call, which reuses them
            when its requests fit (an RL loop's steps do): later calls capture no graphs and allocate no pool.
            The memory stays held until `s3r_hf.release(model)` (or the end of a `with s3r_hf.kept_state(model)`
            block). `False` frees it when the call returns.
        return_logprobs (`bool`, defaults to `False`):
            Return the dense log-probability (under the processed target distribution) of every generated token.
        seed (`int`, *optional*):
            Seed of the `torch.Generator` behind drafting, acceptance and residual sampling. Each call on a model and
            each data-parallel rank derives a stream of its own from it (the first call on rank 0 uses the seed as
            is), so a fixed seed does not repeat one stream every RL step or on every rank; the n-th call with a seed
            on a rank is reproducible, counting from the model's first call or its last `s3r_hf.release(model)`.
            Sampled tokens follow the stream for a given sequence of draft lengths: with `adaptive=True` the lengths
            come from measured round times, so a seeded call's samples (always exactly distributed) can differ from
            run to run; set `adaptive=False` for outputs that repeat exactly. Greedy outputs never depend on it.
            `None` draws from torch's global generator state, as `generate` does.
    """

    draft_len: int = 6
    adaptive: bool = True
    adaptive_draft_lengths: tuple[int, ...] | None = None
    budget_ratio: float = 0.05
    min_budget: int = 192
    refresh_interval: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_fraction: float = 0.8
    prefill_chunk_size: int = 2048
    mixed_steps: bool = False
    share_prompts: bool = True
    concurrency_min: int = 160
    concurrency_max: int = 256
    concurrency_step: int = 5
    concurrency_backoff: float = 0.7
    utilization_low: float = 0.8
    utilization_high: float = 0.95
    restore_backlog_threshold: int = 3
    admission_sigmas: float | None = 2.0
    cuda_graphs: bool = False
    compile_layers: bool = False
    fused_layers: bool = False
    draft_matmul_precision: str = "high"
    draft_weights: str = "model"
    keep_state: bool = True
    return_logprobs: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the first field outside its allowed range."""
        _check_int(self, "draft_len", low=1, high=MAX_DRAFT_LEN)
        if self.adaptive_draft_lengths is not None:
            self._check_adaptive_draft_lengths()
        _check_float(self, "budget_ratio", low=0.0, high=1.0, low_open=True)
        _check_int(self, "min_budget", low=1)
        if self.refresh_interval is not None:
            _check_int(self, "refresh_interval", low=1)
        _check_int(self, "page_size", low=1, high=1024)
        if self.num_pages is not None:
            _check_int(self, "num_pages", low=1)
        _check_float(self, "kv_memory_fraction", low=0.0, high=1.0, low_open=True)
        _check_int(self, "prefill_chunk_size", low=1)
        _check_int(self, "concurrency_min", low=1)
        _check_int(self, "concurrency_max", low=self.concurrency_min)
        _check_int(self, "concurrency_step", low=0)
        _check_float(self, "concurrency_backoff", low=0.0, high=1.0, low_open=True, high_open=True)
        _check_float(self, "utilization_low", low=0.0, high=1.0)
        _check_float(self, "utilization_high", low=self.utilization_low, high=1.0)
        _check_int(self, "restore_backlog_threshold", low=0)
        if self.admission_sigmas is not None:
            _check_float(self, "admission_sigmas", low=0.0, high=10.0)
        flags = ("adaptive", "mixed_steps", "share_prompts", "cuda_graphs", "compile_layers", "fused_layers",
                 "keep_state", "return_logprobs")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"S3RConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.draft_matmul_precision not in ("highest", "high"):
            raise ValueError(
                f'S3RConfig.draft_matmul_precision must be "highest" or "high", got {self.draft_matmul_precision!r}'
            )
        if self.draft_weights not in DRAFT_WEIGHTS:
            choices = ", ".join(f'"{name}"' for name in DRAFT_WEIGHTS)
            raise ValueError(f"S3RConfig.draft_weights must be one of {choices}, got {self.draft_weights!r}")
        if self.draft_weights != "model" and self.fused_layers:
            raise ValueError(
                f"S3RConfig.draft_weights={self.draft_weights!r} does not combine with fused_layers=True, whose "
                "kernels read the model's linears directly; set one of them"
            )
        if self.seed is not None:
            _check_int(self, "seed", low=0, high=2**64 - 1)  # what torch.Generator.manual_seed accepts

    def _check_adaptive_draft_lengths(self) -> None:
        lengths = self.adaptive_draft_lengths
        if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
            raise ValueError(f"S3RConfig.adaptive_draft_lengths must be a sequence of integers, got {lengths!r}")
        lengths = list(lengths)
        if any(isinstance(k, bool) or not isinstance(k, numbers.Integral) for k in lengths):
            raise ValueError(f"S3RConfig.adaptive_draft_lengths must be a sequence of integers, got {lengths!r}")
        lengths = sorted({int(k) for k in lengths})
        if not lengths or lengths[0] != 0 or lengths[-1] != self.draft_len:
            raise ValueError(
                f"S3RConfig.adaptive_draft_lengths must include 0 and draft_len ({self.draft_len}) and lie between "
                f"them, got {self.adaptive_draft_lengths!r}"
            )
        if not self.adaptive:
            raise ValueError("S3RConfig.adaptive_draft_lengths needs adaptive=True (the fixed rule drafts draft_len)")
        self.adaptive_draft_lengths = tuple(lengths)

    @property
    def max_refresh_interval(self) -> int:
        """The longest interval between index-view refreshes a call may run (what the views' capacity allows for)."""
        if self.refresh_interval is not None:
            return self.refresh_interval
        return MAX_ADAPTIVE_REFRESH_INTERVAL if self.adaptive else 1

    def budget(self, context_len: int) -> int:
        """Index-view size `K = min(|C|, max(min_budget, ceil(budget_ratio * |C|)))` for a context of `|C|`."""
        return min(context_len, max(self.min_budget, math.ceil(self.budget_ratio * context_len)))

    def whole_view(self, context_len: int) -> bool:
        """Whether an index view at `context_len` holds the whole context (the budget is the context, as up to
        `min_budget` tokens): such a view is every position, and no scores are needed to build it."""
        return self.budget(context_len) >= context_len

    def budgets(self, context_lens: torch.Tensor) -> torch.Tensor:
        """`budget` of every context length in a tensor, computed where the tensor lives (so the index views of
        the next round can be sized before the host knows the new lengths)."""
        # float64 like Python's float, so the ceiling agrees with `budget` bit for bit.
        scaled = torch.ceil(context_lens.double() * self.budget_ratio).long()
        return torch.minimum(context_lens.long(), scaled.clamp(min=self.min_budget))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> S3RConfig:
        """Build from a plain dict (as found in a `GRPOConfig` or a JSON file); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"Unknown S3RConfig field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**values)

    @classmethod
    def coerce(cls, value: S3RConfig | dict[str, Any] | None) -> S3RConfig:
        """Accept an `S3RConfig`, a dict of its fields, or `None` (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            value.validate()
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise ValueError(f"s3r_config must be an S3RConfig or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_int(config: S3RConfig, name: str, low: int, high: int | None = None) -> None:
    value = getattr(config, name)
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    # Any integer type (NumPy's too: `numbers.Integral`), stored as a Python int; bools are not counts.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"S3RConfig.{name} must be {allowed}, got {value!r}")
    value = int(value)
    setattr(config, name, value)
    if value < low or (high is not None and value > high):
        raise ValueError(f"S3RConfig.{name} must be {allowed}, got {value}")


def _check_float(
    config: S3RConfig, name: str, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    value = getattr(config, name)
    allowed = f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    # Any real number type (NumPy's too: `numbers.Real`), stored as a Python float; bools are not numbers.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"S3RConfig.{name} must be {allowed}, got {value!r}")
    value = float(value)
    setattr(config, name, value)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        raise ValueError(f"S3RConfig.{name} must be {allowed}, got {value}")
