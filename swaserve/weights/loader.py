"""Build a model from a Hugging Face folder: config via transformers, weights from safetensors
(or random weights in real shapes with `load_format="dummy"`).

Parameter names are Hugging Face's (the models keep them), so the mapping is the identity except
for the tensors listed in `_SKIPPED` and what a model maps itself: a model with a
`map_checkpoint(tensors)` method receives the stream of (name, tensor) and yields
(parameter name, index or None, tensor) targets, an index selecting the part of the parameter
the tensor fills (one expert's rows of a fused expert weight, say). A missing tensor (a parameter
not wholly covered) or an unexpected one fails loudly.

With tensor parallelism (`tp`), the model is made rank tp.rank's shard on the meta device
(`swaserve.distributed.layers.shard_model`) and each checkpoint tensor, still addressed in the
full parameter's coordinates, is cut to the rank's part as it is copied (`Shard.copy_into`):
no rank holds more than its shard, one checkpoint tensor aside. Dummy weights draw the full
tensor of every sharded parameter with the seed a single process uses, then keep the rank's part,
so every TP size runs the same model. Expert parallelism (`ep`) cuts the experts' dim 0 the
same way (`swaserve.distributed.expert_shards`). An FP8 checkpoint's weights become codes and
row scales whole, before the cut (`swaserve.weights.fp8_checkpoint`: the same rows at any TP size).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from swaserve.models.blocks import Rotary
from swaserve.models.registry import model_class

if TYPE_CHECKING:
    from swaserve.distributed.parallel_state import TPGroup
    from swaserve.distributed.sharding import Shard
    from swaserve.weights.fp8_checkpoint import Fp8Format

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Checkpoint tensors that carry nothing the model needs.
_SKIPPED = [re.compile(r".*rotary_emb\.inv_freq$")]


def shipped_config_names() -> list[str]:
    return sorted(p.name for p in SHIPPED_CONFIGS.iterdir() if (p / "config.json").exists())


def load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    # Multimodal wrappers (Gemma3ForConditionalGeneration) keep the LM config inside.
    cfg = getattr(cfg, "text_config", None) or cfg
    if getattr(cfg, "per_layer_config", None) is not None:
        # transformers 5's heterogeneous configs (Gemma 4) refuse global reads of per-layer
        # fields: the engine reads the global (first-kind) values where any layer's will do,
        # and each layer's own where they differ (models/gemma4.py, GroupLayout.kv_shapes)
        cfg.allow_global_per_layer_attribute_access = True
    return cfg


def build_model(
    hf_config: Any,
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    dummy: bool,
    seed: int,
    tp: TPGroup | None = None,
    ep: tuple[int, int] | None = None,
) -> nn.Module:
    """The model of `hf_config` with its weights; with `tp` (size > 1) rank tp.rank's shard;
    with `ep` (expert-parallel rank, size) that rank's experts, whole (expert parallelism; with
    `tp` too, attention and the dense parts are tp.rank's shard)."""
    cls = model_class(hf_config)
    with torch.device("meta"):
        model = cls(hf_config)
    shards: dict[str, Shard] = {}
    if tp is not None and tp.size > 1:
        from swaserve.distributed.layers import shard_model

        shards = shard_model(model, tp, experts=ep is None)
    if ep is not None:
        from swaserve.distributed.expert_shards import shard_experts

        shards.update(shard_experts(model, *ep))
    # Cast on meta first: the device never holds a float32 copy of the weights.
    model = model.to(dtype)
    fp8, fp8_targets = None, set()
    if not dummy:  # an FP8 checkpoint: its projections take e4m3 codes (weights/fp8_checkpoint)
        from swaserve.weights import fp8_checkpoint as f8

        fp8 = f8.checkpoint_fp8_format(folder)
        if fp8 is not None:  # on the cut model; its scales' shards join the weights'
            fp8_targets = f8.prepare_fp8_projections(model, _safetensor_files(folder), shards)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    for name, shard in shards.items():
        if shard.kept() < params[name].numel():  # vocabulary padding: zero rows
            params[name].data.zero_()
    if dummy:
        _init_dummy(model, seed, shards)
    else:
        load_safetensors(model, folder, shards, fp8, fp8_targets)
    for m in model.modules():
        if isinstance(m, Rotary):
            m.restore_buffers(device)
    if fp8_targets:  # the file's codes and row scales as Fp8Linear modules, not requantised
        from swaserve.ops.fp8_linear import quantize_model_fp8

        quantize_model_fp8(model, dtype, prequantised_only=True)
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


def _checkpoint_tensors(folder: Path, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor the model may need, read one at a time."""
    for path in _safetensor_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if any(p.match(name) for p in _SKIPPED) or (tied and name == "lm_head.weight"):
                    continue
                key = name[len("language_model.") :] if name.startswith("language_model.") else name
                yield key, f.get_tensor(name)


def load_safetensors(
    model: nn.Module,
    folder: Path,
    shards: dict[str, Shard] | None = None,
    fp8: Fp8Format | None = None,
    fp8_targets: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Copy the checkpoint in `folder` into the model; `shards`: the parameters that hold one
    rank's part of the checkpoint tensor (tensor parallelism); `fp8`: the checkpoint is FP8,
    its e4m3 weights joined to their scales before the model's `map_checkpoint` sees them
    (`convert_fp8_tensors`: codes and row scales for the modules in `fp8_targets`, prepared by
    `prepare_fp8_projections`; float32 weights for the others)."""
    shards = shards or {}
    params = dict(model.named_parameters())
    tensors = _checkpoint_tensors(folder, getattr(model, "tie_word_embeddings", False))
    if fp8 is not None:
        from swaserve.weights.fp8_checkpoint import convert_fp8_tensors

        tensors = convert_fp8_tensors(tensors, fp8, set(fp8_targets))
    mapper = getattr(model, "map_checkpoint", None)
    targets = mapper(tensors) if mapper else ((k, None, t) for k, t in tensors)
    covered: dict[str, int] = {}  # elements written per parameter
    unexpected: list[str] = []
    for key, index, t in targets:
        if key not in params:
            unexpected.append(key)
            continue
        if (t.dtype == torch.float8_e4m3fn) != (params[key].dtype == torch.float8_e4m3fn):
            # e4m3 codes are only copied as they are, into e4m3 parameters (a cast either
            # way would drop their scale or round the weights silently)
            raise ValueError(
                f"tensor {key}: checkpoint dtype {t.dtype} into a {params[key].dtype} parameter "
                "(e4m3 codes without their scale, or changed by the model's checkpoint mapping)"
            )
        if key in shards:
            try:
                n = shards[key].copy_into(params[key].data, index, t)
            except ValueError as e:
                where = "" if index is None else f" at {index}"
                raise ValueError(f"tensor {key}{where}: checkpoint {e}") from None
            covered[key] = covered.get(key, 0) + n
            continue
        dst = params[key].data if index is None else params[key].data[index]
        if t.shape != dst.shape:
            where = "" if index is None else f" at {index}"
            raise ValueError(
                f"tensor {key}{where}: checkpoint shape {tuple(t.shape)} != model "
                f"{tuple(dst.shape)}"
            )
        dst.copy_(t)
        covered[key] = covered.get(key, 0) + t.numel()
    need = {k: shards[k].kept() if k in shards else p.numel() for k, p in params.items()}
    missing = sorted(k for k in params if covered.get(k, 0) < need[k])
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {folder} does not match {type(model).__name__}: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )


@torch.no_grad()
def _init_dummy(model: nn.Module, seed: int, shards: dict[str, Shard] | None = None) -> None:
    """Random weights in real shapes, seeded, drawn on the model's device (fast on GPU). A
    sharded parameter draws its full tensor, as one process would, and keeps its part."""
    shards = shards or {}
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(seed + zlib.crc32(name.encode()))
        if p.ndim == 1 or _is_zero_init(model, name):
            # Norm weights: 1 for w-scaled norms, 0 for Gemma's (1 + w); biases and sinks 0
            # (and what a module lists in `zero_init`: the MoE experts' [E, n] biases); the
            # multiplicative scales a module lists in `one_init` 1 (Gemma 4's layer_scalar).
            unit_offset = name.endswith("norm.weight") and _is_unit_offset(model, name)
            one = (name.endswith("norm.weight") and not unit_offset) or _is_one_init(model, name)
            p.fill_(1.0 if one else 0.0)
        elif name in shards:
            shard = shards[name]
            full = torch.empty(shard.full_shape, dtype=p.dtype, device=p.device)
            full.normal_(0.0, 0.02, generator=gen)
            p.copy_(shard.take(full, p.shape[shard.dim]))
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _is_zero_init(model: nn.Module, param_name: str) -> bool:
    owner, _, leaf = param_name.rpartition(".")
    return leaf in getattr(model.get_submodule(owner), "zero_init", ())


def _is_one_init(model: nn.Module, param_name: str) -> bool:
    owner, _, leaf = param_name.rpartition(".")
    return leaf in getattr(model.get_submodule(owner), "one_init", ())


def _is_unit_offset(model: nn.Module, param_name: str) -> bool:
    module = model.get_submodule(param_name.rsplit(".", 1)[0])
    return bool(getattr(module, "unit_offset", False))
