"""Merged projection weights for the fused path: q/k/v as one `[(H + 2 Hkv) D, hidden]` GEMM and
gate/up as one `[2 I, hidden]` GEMM, instead of three and two.

The merged tensor owns the memory. Each `nn.Linear`'s weight (and bias) is re-pointed to a
Parameter that is a row slice of it, so the state dict keeps its keys and values, writes into the
parameters (`copy_`, `normal_`) reach the merged GEMM, the eager path runs on the same memory and
the old storages are freed. The merged tensors are plain module attributes, not buffers: they stay
out of the state dict and `Module.to` leaves them alone (moving them would copy them apart from
the parameters anyway). A model moved or cast after merging has lost the aliasing and its fused
path fails on the stale tensors' device or dtype; `merge_projections` (`enable_fused_ops`)
detects it and merges again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _repoint(linears: Sequence[nn.Linear], name: str, merged: torch.Tensor) -> None:
    row = 0
    for linear in linears:
        old = getattr(linear, name)
        rows = old.shape[0]
        setattr(linear, name, nn.Parameter(merged[row : row + rows], old.requires_grad))
        row += rows


@torch.no_grad()
def merge_linears(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of `linears` along the output dim and make each
    layer's parameters row views of the result; returns (weight, bias or None)."""
    has_bias = linears[0].bias is not None
    assert all((m.bias is not None) == has_bias for m in linears)
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
    _repoint(linears, "weight", weight)
    if bias is not None:
        _repoint(linears, "bias", bias)
    return weight, bias


def is_merged(
    linears: Sequence[nn.Linear], weight: torch.Tensor | None, bias: torch.Tensor | None
) -> bool:
    """Whether the parameters of `linears` are, in order, the row views of (weight, bias)."""
    pairs = [("weight", weight)]
    if linears[0].bias is not None:
        pairs.append(("bias", bias))
    for name, merged in pairs:
        if merged is None or sum(getattr(m, name).shape[0] for m in linears) != merged.shape[0]:
            return False
        row = 0
        for linear in linears:
            p = getattr(linear, name)
            if p.device != merged.device or p.data_ptr() != merged[row].data_ptr():
                return False
            row += p.shape[0]
    return True


def merge_projections(model: nn.Module) -> int:
    """Merge q/k/v of every `Attention` and gate/up of every `GatedMLP` in `model` (kept as
    `qkv_weight`/`qkv_bias` and `gate_up_weight`/`gate_up_bias`) unless already merged; returns
    how many modules were merged now."""
    from swaserve.models.blocks import Attention, GatedMLP

    merged = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.qkv_proj is None:  # not fp8 / CPU-packed
            qkv = [module.q_proj, module.k_proj, module.v_proj]
            if not is_merged(qkv, module.qkv_weight, module.qkv_bias):
                module.qkv_weight, module.qkv_bias = merge_linears(qkv)
                merged += 1
        elif (isinstance(module, GatedMLP) and module.gate_up_proj is None
              and module.gated_proj is None):
            gate_up = [module.gate_proj, module.up_proj]
            if not is_merged(gate_up, module.gate_up_weight, module.gate_up_bias):
                module.gate_up_weight, module.gate_up_bias = merge_linears(gate_up)
                merged += 1
    return merged
