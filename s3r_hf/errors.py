"""Errors that describe what the user asked for, not a defect: the CLI prints them in one line and exits with 2.

This module imports nothing heavy, so the CLI can name these classes before torch or transformers are loaded.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class S3RUserError(Exception):
    """Base of the errors caused by an input, a setting or the environment rather than by a defect."""


class UsageError(S3RUserError, ValueError):
    """A flag, prompt or data source that cannot be used."""


class ContextWindowError(UsageError):
    """Prompts and `max_new_tokens` that do not fit the model's context window (`max_position_embeddings`)."""


class ModelSourceError(S3RUserError, OSError):
    """A model path or Hub id that does not name a loadable model (missing, not a checkpoint, not on the Hub)."""


class DeviceUnavailableError(UsageError):
    """A device this torch build or machine does not have (e.g. `cuda` on a CPU-only torch)."""


class MissingDependencyError(S3RUserError, ImportError):
    """An optional dependency is not installed; the message names the extra (or package) that brings it."""


def require(module: str, extra: str | None, purpose: str, package: str | None = None) -> ModuleType:
    """Import `module`, or raise `MissingDependencyError` naming what to install for `purpose`.

    Args:
        module: The module to import, e.g. `"matplotlib.pyplot"`.
        extra: The s3r-hf extra that installs it (`"bench"`, `"trl"`, ...), or `None` for a core dependency.
        purpose: What needs it, for the message ("--plot", "the GRPO trainer", ...).
        package: The distribution's name when it differs from the top-level module's.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        if error.name is not None and error.name.split(".")[0] != top:
            raise  # the package is there but one of its own dependencies is broken: show the real error
        name = package or top
        hint = f"pip install 's3r-hf[{extra}]'" if extra else f"pip install {name}"
        raise MissingDependencyError(f"{purpose} needs the {name} package, which is not installed: {hint}") from error
