"""Two GRPO steps with S3R rollouts under `accelerate launch --num_processes 2 --cpu` (run by the tests)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_trl_integration import make_trainer  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        trainer = make_trainer(Path(directory))
        trainer.train()
        rank = trainer.accelerator.process_index
        world = trainer.accelerator.num_processes
        logged = [entry for entry in trainer.state.log_history if "s3r/acceptance_rate" in entry]
        model_type = type(trainer.model_wrapped).__name__
        report = (f"S3R-DDP rank={rank} world={world} steps={trainer.state.global_step} s3r_logs={len(logged)} "
                  f"wrapped={model_type}\n")
        # One write of the whole line, newline included: the two ranks share the pipe, and `print` under unbuffered
        # output writes the text and the newline apart, so one rank's line once ran into the other's.
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), report.encode())
        # Tear the gloo process group down before the interpreter exits: left to exit, its threads were once
        # destroyed while running, and both ranks aborted (SIGABRT) after finishing their steps.
        trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
