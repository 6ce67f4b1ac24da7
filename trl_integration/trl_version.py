"""The TRL releases `S3RGRPOTrainer` is tested with, checked before anything imports TRL's trainer.

`S3RGRPOTrainer` overrides `GRPOTrainer._generate_single_turn`, a private method whose signature and duties change
between TRL releases, so a release outside the tested range fails here with a message rather than later with a
confusing error (or, worse, silently wrong rollouts). `S3R_HF_ALLOW_UNTESTED_TRL=1` skips the check, to try a new
release.
"""

from __future__ import annotations

import os

from s3r_hf.errors import MissingDependencyError, require

TESTED_TRL = (">=1.16", "<1.17")
"""The supported range, as in pyproject.toml's `trl` extra (the test suite ran trl 1.16.0)."""
ALLOW_UNTESTED_ENV = "S3R_HF_ALLOW_UNTESTED_TRL"


class UntestedTRLError(MissingDependencyError):
    """The installed TRL is outside `TESTED_TRL`."""


def _parse(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def trl_version_supported(version: str) -> bool:
    """Whether `version` lies in `TESTED_TRL` (pre-releases and local versions are compared by their release)."""
    release = _parse(version)
    low, high = (_parse(bound.lstrip("<>=")) for bound in TESTED_TRL)
    return low <= release < high


def check_trl(version: str | None = None) -> str:
    """Import TRL and check its version; return the version.

    Raises:
        MissingDependencyError: TRL is not installed (the message names `pip install 's3r-hf[trl]'`).
        UntestedTRLError: TRL is outside `TESTED_TRL` and `S3R_HF_ALLOW_UNTESTED_TRL` is not set.
    """
    if version is None:
        version = require("trl", "trl", "trl_integration (S3RGRPOConfig, S3RGRPOTrainer)").__version__
    if trl_version_supported(version) or os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0"):
        return version
    wanted = ",".join(TESTED_TRL)
    raise UntestedTRLError(
        f"trl {version} is installed, but S3RGRPOTrainer is tested with trl{wanted} only (it overrides TRL's private "
        f"GRPOTrainer._generate_single_turn, which changes between releases): pip install 'trl{wanted}', or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try this release anyway"
    )
