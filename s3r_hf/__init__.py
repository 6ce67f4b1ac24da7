"""s3r-hf: Self-Sparse Speculative Rollouts for HuggingFace transformers and TRL.

The policy drafts tokens with sparse attention over its own KV cache, one dense forward verifies them, and
exact speculative sampling keeps every response distributed exactly as dense sampling would.
"""

from s3r_hf.cache import KVCapacityError, S3RCache
from s3r_hf.candidate_generator import SparseSelfDraftCandidateGenerator, assisted_generate
from s3r_hf.config import S3RConfig
from s3r_hf.generate import S3RGenerateOutput, enable, generate
from s3r_hf.runtime_state import release
from s3r_hf.stats import S3RStats
from s3r_hf.validation import UnsupportedModelError

__version__ = "0.1.0"

__all__ = [
    "KVCapacityError",
    "S3RCache",
    "S3RConfig",
    "S3RGenerateOutput",
    "S3RStats",
    "SparseSelfDraftCandidateGenerator",
    "UnsupportedModelError",
    "assisted_generate",
    "enable",
    "generate",
    "release",
]
