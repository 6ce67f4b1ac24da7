"""The S3R engine: prefill, sparse drafting, dense verification and exact sampling over many requests.

`engine.py` is the loop (schedule, run a step, release what finished); `scheduler.py` decides which requests
run; `round.py` is one speculative round (draft, verify, accept, update the views, commit), with the acceptance
rule from `acceptance.py`, the early launches from `early_launch.py` and the host commit from `commit.py`;
`model_runner.py` builds each forward's `StepPlan` and runs it (eagerly or as a CUDA graph); `mixed_step.py` packs
prompt chunks (`prompt_chunks.py`) into a round's verify forward (`S3RConfig.mixed_steps`), and `first_tokens.py`
gives finished prompts their first token and index views.
"""

from s3r_hf.engine.engine import S3REngine
from s3r_hf.engine.sampling_setup import SamplingSetup

__all__ = ["S3REngine", "SamplingSetup"]
