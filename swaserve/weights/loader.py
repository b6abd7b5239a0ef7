"""Build a model from a Hugging Face folder: config via transformers, weights from safetensors
(or random weights in real shapes with `load_format="dummy"`).

Parameter names are Hugging Face's (the models keep them), so the mapping is the identity except
for the tensors listed in `_SKIPPED`; a missing or unexpected tensor fails loudly.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from swaserve.models.blocks import Rotary
from swaserve.models.registry import model_class

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Checkpoint tensors that carry nothing the model needs.
_SKIPPED = [re.compile(r".*rotary_emb\.inv_freq$")]


def shipped_config_names() -> list[str]:
    return sorted(p.name for p in SHIPPED_CONFIGS.iterdir() if (p / "config.json").exists())


def load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    # Multimodal wrappers (Gemma3ForConditionalGeneration) keep the LM config inside.
    return getattr(cfg, "text_config", None) or cfg


def build_model(
    hf_config: Any, folder: Path, dtype: torch.dtype, device: torch.device, dummy: bool, seed: int
) -> nn.Module:
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config)
    # Cast on meta first: the device never holds a float32 copy of the weights.
    model = model.to(dtype).to_empty(device=device)
    if dummy:
        _init_dummy(model, seed)
    else:
        load_safetensors(model, folder)
    for m in model.modules():
        if isinstance(m, Rotary):
            m.restore_buffers(device)
    return model.eval().requires_grad_(False)


def _safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors in {folder}; for random weights use --load-format dummy"
        )
    return files


def load_safetensors(model: nn.Module, folder: Path) -> None:
    params = dict(model.named_parameters())
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in _safetensor_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if any(p.match(name) for p in _SKIPPED) or (tied and name == "lm_head.weight"):
                    continue
                key = name[len("language_model.") :] if name.startswith("language_model.") else name
                if key not in params:
                    unexpected.append(name)
                    continue
                t = f.get_tensor(name)
                if t.shape != params[key].shape:
                    raise ValueError(
                        f"tensor {name}: checkpoint shape {tuple(t.shape)} != model "
                        f"{tuple(params[key].shape)}"
                    )
                params[key].data.copy_(t)
                loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {folder} does not match {type(model).__name__}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights in real shapes, seeded, drawn on the model's device (fast on GPU)."""
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
        if p.ndim == 1:
            # Norm weights: 1 for w-scaled norms, 0 for Gemma's (1 + w); biases and sinks 0.
            unit_offset = name.endswith("norm.weight") and _is_unit_offset(model, name)
            fill = 1.0 if name.endswith("norm.weight") and not unit_offset else 0.0
            p.fill_(fill)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _is_unit_offset(model: nn.Module, param_name: str) -> bool:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    return bool(getattr(module, "unit_offset", False))
