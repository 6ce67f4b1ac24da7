"""s3r-hf: Self-Sparse Speculative Rollouts for HuggingFace transformers and TRL.

The policy drafts tokens with sparse attention over its own KV cache, one dense forward verifies them, and
exact speculative sampling keeps every response distributed exactly as dense sampling would.

The public names are imported when first used (`s3r_hf.enable`, `from s3r_hf import S3RConfig`), so `import s3r_hf`
itself loads neither torch nor transformers. To export a name, add its entry to `_EXPORTS` (and, for type checkers,
its import under `TYPE_CHECKING`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # public name: the module that defines it
    "ContextWindowError": "s3r_hf.errors",
    "KVCapacityError": "s3r_hf.cache",
    "S3RCache": "s3r_hf.cache",
    "S3RConfig": "s3r_hf.config",
    "S3RGenerateOutput": "s3r_hf.generate",
    "S3RStats": "s3r_hf.stats",
    "SparseSelfDraftCandidateGenerator": "s3r_hf.candidate_generator",
    "UnsupportedModelError": "s3r_hf.validation",
    "assisted_generate": "s3r_hf.candidate_generator",
    "enable": "s3r_hf.generate",
    "gathered_parameters": "s3r_hf.sharding",
    "generate": "s3r_hf.generate",
    "kept_state": "s3r_hf.runtime_state",
    "release": "s3r_hf.runtime_state",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs only; at run time `__getattr__` imports each name on first use
    from s3r_hf.cache import KVCapacityError, S3RCache  # noqa: F401
    from s3r_hf.candidate_generator import SparseSelfDraftCandidateGenerator, assisted_generate  # noqa: F401
    from s3r_hf.config import S3RConfig  # noqa: F401
    from s3r_hf.errors import ContextWindowError  # noqa: F401
    from s3r_hf.generate import S3RGenerateOutput, enable, generate  # noqa: F401
    from s3r_hf.runtime_state import kept_state, release  # noqa: F401
    from s3r_hf.sharding import gathered_parameters  # noqa: F401
    from s3r_hf.stats import S3RStats  # noqa: F401
    from s3r_hf.validation import UnsupportedModelError  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    from s3r_hf.hints import install_generate_hint

    install_generate_hint()  # `generate(s3r_config=...)` on a model not enabled: an error that names enable
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Keeps an exported name bound to its object when a submodule of the same name is imported.

    Importing a submodule binds it on its package (`s3r_hf.generate` = the module); the eager `from s3r_hf.generate
    import generate` of the package used to rebind the name to the function. The same rebinding happens here, so
    `s3r_hf.generate` is the `custom_generate` function whichever module imported `s3r_hf.generate` first.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and _EXPORTS.get(name) == value.__name__ == f"{__name__}.{name}"
            and hasattr(value, name)
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
