"""The model's recommended sampling defaults, from its `generation_config.json`, as vLLM takes
them (`--generation-config auto`, its default): a request that leaves `temperature`, `top_p`,
`top_k`, `min_p` or `repetition_penalty` out gets the model's value rather than the API's
default (Qwen3's card asks for temperature 0.6, top_p 0.95, top_k 20: greedy thinking loops),
and `max_new_tokens` caps a request that gives no `max_tokens` (else the rest of the context).

- `--generation-config auto`: the model folder's file; `vllm` (vLLM's name; `none` too): none,
  the API's defaults; a folder: that folder's `generation_config.json`.
- `--override-generation-config '{"temperature": 0.5}'` (JSON, HF's or SamplingParams' names)
  sets or replaces single values on top.

Where they apply: the server fills the fields a request leaves out (null or absent); offline,
`Engine.generate`/`chat` without sampling_params use `Engine.default_sampling_params()`. The
max_new_tokens cap is the engine core's (`resolve_max_tokens`), for both. A value out of
range is an error at start naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip
OFF = ("vllm", "none")


def generation_defaults(
    folder: Path | None, source: str = "auto", override: str | dict | None = None
) -> dict[str, Any]:
    """SamplingParams field -> the model's default (only those it sets); ValueError naming the
    source when a value is out of range or the file is unreadable."""
    where = "--generation-config"
    found: dict[str, Any] = {}
    if source not in OFF:
        base = folder if source == "auto" else Path(source)
        path = None if base is None else base / "generation_config.json"
        if source != "auto" and not path.is_file():
            raise ValueError(f"{where} {source}: no generation_config.json there")
        if path is not None and path.is_file():
            where = str(path)
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: cannot be read: {e}") from None
            found = {KEYS[k]: v for k, v in data.items() if k in KEYS and v is not None}
    if override:
        if isinstance(override, str):
            try:
                override = json.loads(override)
            except ValueError as e:
                raise ValueError(f"--override-generation-config is not JSON: {e}") from None
        if not isinstance(override, dict):
            raise ValueError(f"--override-generation-config must be a JSON object, got "
                             f"{override!r}")  # fmt: skip
        names = set(KEYS) | set(KEYS.values())
        unknown = sorted(set(override) - names)
        if unknown:
            raise ValueError(f"--override-generation-config: unknown key(s) {unknown}; it takes "
                             f"{sorted(names)}")  # fmt: skip
        found.update({KEYS.get(k, k): v for k, v in override.items()})
    _check(found, where)
    return found


def _check(values: dict[str, Any], where: str) -> None:
    from swaserve.sampling.params import SamplingParams

    try:
        SamplingParams(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def sampling_fields(defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults a request's left-out fields take (max_tokens is a cap, not one of them)."""
    return {k: v for k, v in defaults.items() if k != "max_tokens"}


def describe(defaults: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(defaults.items()))
