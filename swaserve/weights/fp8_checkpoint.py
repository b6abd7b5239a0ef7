"""Checkpoints already in FP8 (what vLLM users download), read into the same `Fp8Linear`
modules as `--quantization fp8` (swaserve/ops/fp8_linear.py): e4m3 codes [out, in] and one
float32 scale per output row. Two formats, named by config.json's `quantization_config`:

- `"quant_method": "fp8"`: transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-*-FP8):
  `<m>.weight` e4m3 and `<m>.weight_scale_inv` float32 (or ue8m0) per block of
  `weight_block_size` (usually [128, 128]; the grid is [ceil(out/b0), ceil(in/b1)]), or one
  scalar when `weight_block_size` is null (per tensor).
- `"quant_method": "compressed-tensors"` with 8-bit float weights (`format` float-quantized or
  naive-quantized: RedHatAI/neuralmagic `*-FP8-dynamic`, `*-FP8`, `*-FP8-BLOCK`):
  `<m>.weight` e4m3 and `<m>.weight_scale` per tensor [1], per channel [out, 1] or per block.

Both mean W[n, k] = codes[n, k] * scale(n, k), so one converter serves them. Into the per-row
form (`to_rows`):

    per channel   s_row[n] = scale[n]             codes unchanged            exact
    per tensor    s_row[n] = scale                codes unchanged            exact
    per block     W = codes * scale(block) in float32, then `quantize_rows` (max |row| -> 448):
                  a second e4m3 rounding of the weights (a row's blocks have different scales,
                  so its codes cannot keep their values under one row scale)

Activations: quantised per token at run time, as `--quantization fp8` does. A static input
scale in the checkpoint (`input_scale`, `activation_scale`: `activation_scheme` "static") is
not used (vLLM would use it): the per-token scale is at least as exact.

Which projections are FP8 is read from the files' dtypes (the headers, before loading), not
from `modules_to_not_convert` / `ignore`: a module those lists kept in bf16 is bf16 in the file.
A dense attention block (q, k, v, o) or gated MLP (gate, up, down) whose projections are all
e4m3 in the file (and of shapes the FP8 GEMM takes) becomes Fp8Linear modules holding the
file's codes; any other e4m3 tensor (MoE experts, a partly quantised block, a fused projection
a model splits, as Phi-3's qkv_proj) is dequantised to float32 and loads in the model's dtype;
blocks stored in bf16 stay in the model's dtype (not quantised online: the checkpoint's choice).

Tensor parallelism: the planner (swaserve/distributed/layers.py) has cut the meta model before
`prepare_fp8_projections` gives its projections e4m3 weights and row scales, and `scale_shards`
adds the scales' shards beside the weights'. Every checkpoint tensor is converted to rows
(`convert_fp8_tensors`, on the whole tensor) before the loader cuts it (`Shard.copy_into`), so
each rank holds a part of the single-process model's codes and scales, whatever the rank count:

    column-parallel (q, k, v, gate, up: output rows split, KV heads replicated when fewer
                    than ranks)   codes: the rank's rows          scales: the same rows
    row-parallel    (o, down: input features split)
                                  codes: the rank's columns of    scales: the whole vector
                                  every row                       (a row's scale covers all
                                                                  its columns)

A block-scaled row is requantised once, whole, and then cut. A row-parallel Fp8Linear
quantises its rank's input slice per token and all-reduces the partial products (bias on rank
0), as `--quantization fp8` does: the weights are the single process's, the inputs' scales
per slice. A block whose projections are e4m3 in the file but whose per-rank shapes the FP8
GEMM cannot take (features not multiples of 16 after the cut) loads dequantised, with a
warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swaserve.distributed.sharding import Shard
from swaserve.ops.fp8_linear import FP8, quantize_rows

log = logging.getLogger(__name__)

SUPPORTED = (
    "'fp8' (transformers' fine-grained FP8), 'compressed-tensors' with FP8 weights, "
    "and gpt-oss's 'mxfp4'"
)
_SCALES = ("weight_scale_inv", "weight_scale")  # both multiply the codes (names differ only)
_ACTIVATION_SCALES = ("input_scale", "activation_scale")  # static: not used (module doc)
# gpt-oss's MXFP4 experts: dequantised by the model's own map_checkpoint (weights/mxfp4.py)
_READ_BY_THE_MODEL = ("mxfp4",)


@dataclass(frozen=True)
class Fp8Format:
    """What config.json says of an FP8 checkpoint: its `quant_method` and the weight block
    [rows, cols] of block-wise scales (None: per tensor or per channel)."""

    method: str
    block: tuple[int, int] | None


def _quantization_config(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    if not path.exists():
        return None
    cfg = json.loads(path.read_text())
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    return qc or None


def checkpoint_fp8_format(folder: Path) -> Fp8Format | None:
    """The FP8 format of the checkpoint in `folder`, None when config.json names no
    quantisation; ValueError naming the method when it is one swaserve does not read."""
    qc = _quantization_config(folder)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method in _READ_BY_THE_MODEL:
        return None
    if method == "fp8":
        block = qc.get("weight_block_size")
        return Fp8Format("fp8", None if block is None else (int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return _compressed_tensors_format(folder, qc)
    raise ValueError(
        f"the checkpoint in {folder} is quantised with quant_method {method!r} "
        f"(config.json quantization_config); swaserve reads {SUPPORTED}"
    )


def _compressed_tensors_format(folder: Path, qc: dict[str, Any]) -> Fp8Format:
    def refuse(why: str) -> ValueError:
        return ValueError(
            f"the checkpoint in {folder} is quantised with quant_method 'compressed-tensors' "
            f"but {why}; swaserve reads {SUPPORTED}"
        )

    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise refuse(f"its format is {fmt!r} (FP8 weights are 'float-quantized')")
    if qc.get("sparsity_config"):
        raise refuse("it is sparse (sparsity_config)")
    block = None
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise refuse(f"config group {name!r} has {w.get('num_bits')}-bit "
                         f"{w.get('type')} weights, not 8-bit float")  # fmt: skip
        strategy = w.get("strategy")
        if strategy == "block":
            block = tuple(int(b) for b in w.get("block_structure") or (128, 128))
        elif strategy not in ("tensor", "channel"):
            raise refuse(f"config group {name!r} has weight strategy {strategy!r} "
                         "(tensor, channel and block are read)")  # fmt: skip
    return Fp8Format("compressed-tensors", block)  # type: ignore[arg-type]


def resolve_quantization(flag: str | None, folder: Path, dummy: bool) -> tuple[str | None, bool]:
    """(the engine's `quantization`, whether the weights load pre-quantised) for `--quantization
    flag` and the checkpoint in `folder`, as vLLM infers it: an FP8 checkpoint sets fp8 by
    itself; a flag naming another method than the checkpoint's is a ValueError naming both.
    Dummy weights of an FP8 checkpoint are drawn dense and quantised online."""
    fmt = checkpoint_fp8_format(folder)
    if fmt is None:
        if flag not in (None, "fp8"):
            raise ValueError(
                f"--quantization {flag} needs a checkpoint quantised with it; the one in "
                f"{folder} has no quantization_config in config.json"
            )
        return flag, False
    if flag is not None and flag != fmt.method:
        raise ValueError(
            f"--quantization {flag} conflicts with the checkpoint in {folder}, quantised with "
            f"quant_method {fmt.method!r} (config.json quantization_config): leave "
            f"--quantization out or pass {fmt.method}"
        )
    return "fp8", not dummy


def _file_dtypes(files: list[Path]) -> dict[str, str]:
    """Checkpoint tensor name -> safetensors dtype ("F8_E4M3", "BF16", ...), headers only."""
    from safetensors import safe_open

    out: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name.removeprefix("language_model.")] = f.get_slice(name).get_dtype()
    return out


def prepare_fp8_projections(
    model: nn.Module, files: list[Path], shards: dict[str, Shard] | None = None
) -> set[str]:
    """On the meta model, cast to its dtype (and cut by the TP planner, whose `shards` this
    extends: `scale_shards`): the projections whose whole block (q, k, v, o of an Attention;
    gate, up, down of a dense GatedMLP) is e4m3 in `files` get an e4m3 `weight` and a float32
    `weight_scale` [out, 1] (this rank's rows) for the loader to fill; returns their module
    names (the targets of `to_rows`)."""
    from swaserve.models.blocks import Attention, GatedMLP
    from swaserve.ops.fp8_linear import _quantizable

    dtypes = _file_dtypes(files)
    targets: set[str] = set()
    unaligned = 0
    for name, module in model.named_modules():
        if isinstance(module, Attention) and module.qkv_proj is None:
            projs = ("q_proj", "k_proj", "v_proj", "o_proj")
        elif isinstance(module, GatedMLP) and module.gate_up_proj is None:
            projs = ("gate_proj", "up_proj", "down_proj")
        else:
            continue
        linears = [getattr(module, p) for p in projs]
        names = [f"{name}.{p}" for p in projs]
        if not all(dtypes.get(f"{n}.weight") == "F8_E4M3" for n in names):
            continue
        if not _quantizable(linears):  # this rank's shapes (cut by the planner, if any)
            unaligned += 1
            continue
        for lin, n in zip(linears, names, strict=True):
            out, k = lin.weight.shape
            lin.weight = nn.Parameter(torch.empty(out, k, dtype=FP8, device="meta"),
                                      requires_grad=False)  # fmt: skip
            lin.weight_scale = nn.Parameter(
                torch.empty(out, 1, dtype=torch.float32, device="meta"), requires_grad=False
            )
            targets.add(n)
    if shards:
        shards.update(scale_shards(shards, targets))
    if unaligned:
        log.warning("fp8 checkpoint: %d attention/MLP blocks load dequantised (a projection's "
                    "features, per rank, are not multiples of 16)", unaligned)  # fmt: skip
    return targets


def scale_shards(shards: dict[str, Shard], targets: set[str]) -> dict[str, Shard]:
    """The shards of the target projections' row scales [out, 1], from their weights' (the
    module doc): a column-parallel weight (cut along its rows, dim 0) has its scales cut along
    the same rows; a row-parallel one (cut along its columns, dim 1) keeps the whole vector on
    every rank (no shard: the loader copies it whole). ValueError for any other cut."""
    out: dict[str, Shard] = {}
    for m in sorted(targets):
        w = shards.get(f"{m}.weight")
        if w is None or w.dim == 1:
            continue
        if w.dim != 0 or len(w.full_shape) != 2:
            raise ValueError(
                f"tensor parallelism with an FP8 checkpoint: {m}.weight is cut along dim "
                f"{w.dim} of {w.full_shape}; only its rows or its columns have row scales"
            )
        out[f"{m}.weight_scale"] = Shard((w.full_shape[0], 1), 0, w.ranges)
    return out


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
                ) -> torch.Tensor:  # fmt: skip
    """codes * scale in float32; `scale` one value, one per row [out, 1], or one per block."""
    w, s = codes.float(), scale.float()
    out, k = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if tuple(s.shape) == (out, 1):
        return w * s
    if block is None or s.ndim != 2:
        raise ValueError(f"scale of shape {tuple(s.shape)} for weight {tuple(w.shape)}")
    b0, b1 = block
    if tuple(s.shape) != (-(-out // b0), -(-k // b1)):
        raise ValueError(
            f"block scales {tuple(s.shape)} for weight {tuple(w.shape)} and blocks {block}"
        )
    # each scale over its b0 x b1 block; the last row/column of blocks may be partial
    full = s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :k]
    return w * full


def to_rows(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scales [out, 1]) of a checkpoint's codes and scales: per tensor and
    per channel exactly (the codes kept, the scale broadcast to rows), per block by requantising
    the float32 dequantised rows (the module doc)."""
    out = codes.shape[0]
    if scale.numel() == 1 or tuple(scale.shape) == (out, 1):
        return codes, scale.float().reshape(-1, 1).expand(out, 1).contiguous()
    return quantize_rows(_dequantize(codes, scale, block))


def convert_fp8_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], fmt: Fp8Format, targets: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with each e4m3 weight joined to its scale tensor: for a target
    module `<m>.weight` codes and `<m>.weight_scale` [out, 1] (`to_rows`), for any other a
    float32 `<m>.weight` (dequantised); static activation scales dropped. Codes wait for
    their scale (and the reverse): safetensors lists `weight` before `weight_scale*` in a file,
    so only tensors split over two files wait long."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    scale_names: dict[str, str] = {}  # module -> its scale tensor's name (for the error)
    static_scales = 0

    def joined(m: str) -> Iterator[tuple[str, torch.Tensor]]:
        c, s = codes.pop(m), scales.pop(m)
        if m in targets:
            q, rows = to_rows(c, s, fmt.block)
            yield f"{m}.weight", q
            yield f"{m}.weight_scale", rows
        else:
            yield f"{m}.weight", _dequantize(c, s, fmt.block)

    for name, t in tensors:
        m, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dtype == FP8:
            codes[m] = t
        elif leaf in _SCALES:
            scales[m], scale_names[m] = t, name
        elif leaf in _ACTIVATION_SCALES:
            static_scales += 1
            continue
        else:
            yield name, t
            continue
        if m in codes and m in scales:
            yield from joined(m)
    if static_scales:
        log.info("fp8 checkpoint: its %d static input scales are not used; inputs are "
                 "quantised per token", static_scales)  # fmt: skip
    if codes or scales:
        lone = sorted(f"{m}.weight" for m in codes) + sorted(scale_names[m] for m in scales)
        raise ValueError(f"FP8 weights and scales unpaired in the checkpoint: {lone[:8]}")
