"""`SamplingSetup`: how tokens are chosen and when a response stops, as `generate` prepares it for the engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import StoppingCriteriaList

from s3r_hf.logits import RaggedLogitsProcessor
from s3r_hf.stopping import BatchStopping


@dataclass
class SamplingSetup:
    """How tokens are chosen and when a response stops, as prepared by `generate`."""

    logits_processor: RaggedLogitsProcessor
    greedy: bool
    eos_token_ids: set[int]
    stopping_criteria: StoppingCriteriaList | BatchStopping  # criteria other than max length and EOS, fed whole steps
    generator: torch.Generator | None  # verification: acceptance coins, corrections and first tokens
    output_scores: bool = False
    output_logits: bool = False
    draft_generator: torch.Generator | None = None  # the drafts' noise (`sampler.call_generators`); else `generator`

    @property
    def draft_noise_generator(self) -> torch.Generator | None:
        return self.draft_generator if self.draft_generator is not None else self.generator
