"""A clearer error for `model.generate(..., s3r_config=...)` on a model that `s3r_hf.enable` has not seen.

transformers refuses generate arguments no decoding method takes with "The following `model_kwargs` are not used
by the model: ['s3r_config']", which does not say what is missing. `install_generate_hint` wraps transformers'
check so that, when the refused arguments include S3R's, the error names `s3r_hf.enable` and
`custom_generate=s3r_hf.generate`. Every other outcome of the check (and every call without S3R arguments) is
transformers' own. `import s3r_hf` installs it once a public name is used (`s3r_hf.S3RConfig`, `s3r_hf.enable`, ...).
"""

from __future__ import annotations

import functools
from typing import Any

_MARK = "_s3r_hint_installed"


def enable_hint(arguments: list[str]) -> str:
    """The message for S3R `arguments` that reached a `generate` S3R does not run."""
    return (
        f"generate received {arguments}, but this model's generate does not run S3R: call `s3r_hf.enable(model)` "
        "once before generating, or pass `custom_generate=s3r_hf.generate` to this generate call"
    )


def install_generate_hint() -> bool:
    """Wrap `GenerationMixin._validate_model_kwargs` (once) to name `s3r_hf.enable` when it refuses S3R arguments.

    Returns whether the hint is in place (False where this transformers has no such check).
    """
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return False
    original = GenerationMixin.__dict__.get("_validate_model_kwargs")
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def validate_model_kwargs(self: Any, model_kwargs: dict[str, Any]) -> Any:
        try:
            return original(self, model_kwargs)
        except ValueError as error:
            ours = sorted(key for key, value in model_kwargs.items() if key.startswith("s3r_") and value is not None)
            if ours:
                raise ValueError(enable_hint(ours)) from error
            raise

    setattr(validate_model_kwargs, _MARK, True)
    GenerationMixin._validate_model_kwargs = validate_model_kwargs
    return True
