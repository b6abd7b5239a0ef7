"""Which experts a data-parallel rank holds under expert parallelism, and the model made that
rank's part on the meta device before its weights exist (as `layers.shard_model` does for TP).

With E experts per MoE layer over D ranks, rank r holds experts [r E/D, (r+1) E/D), whole: its
rows of dim 0 of `w13`, `b13`, `w2` and `b2` (moe.py's layout). Everything else (attention, the
dense MLPs, embeddings, head, the routers) is whole on every rank. E must divide by D: an uneven
split would give the last rank more GEMM rows than the others on every step, and the tiny
configs users run with D > 1 all have E a power of two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swaserve.distributed.sharding import Shard
from swaserve.models.moe import SparseMoE

_EXPERT_PARAMS = ("w13", "b13", "w2", "b2")


def expert_range(num_experts: int, size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of the experts rank `rank` of `size` holds; ValueError naming the flag when
    `size` does not divide `num_experts`."""
    if num_experts % size:
        raise ValueError(
            f"--data-parallel-size {size} with --enable-expert-parallel must divide the "
            f"model's experts per layer ({num_experts})"
        )
    n = num_experts // size
    return rank * n, (rank + 1) * n


def shard_experts(model: nn.Module, rank: int, size: int) -> dict[str, Shard]:
    """Make a model built on the meta device hold rank `rank`'s experts only (each SparseMoE's
    `expert_range` set); returns {parameter name: Shard} for the loader."""
    shards: dict[str, Shard] = {}
    with torch.device("meta"):
        for name, m in model.named_modules():
            if not isinstance(m, SparseMoE):
                continue
            lo, hi = expert_range(m.w13.shape[0], size, rank)
            for leaf in _EXPERT_PARAMS:
                p = getattr(m, leaf)
                if p is None:
                    continue
                shards[f"{name}.{leaf}"] = Shard(tuple(p.shape), 0, ((lo, hi),))
                shape = (hi - lo, *p.shape[1:])
                setattr(
                    m, leaf, nn.Parameter(torch.empty(shape, dtype=p.dtype), requires_grad=False)
                )
            m.expert_range = (lo, hi)
    return shards


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    """The model's MoE layers in the order its forward runs them (module order)."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def check_expert_parallel(hf_config: Any, size: int) -> None:
    """Whether the model's experts split over `size` ranks (on the meta device: no memory, no
    processes): a ValueError naming the flags for a dense model or an uneven split."""
    from swaserve.models.registry import model_class

    with torch.device("meta"):
        model = model_class(hf_config)(hf_config)
    layers = moe_layers(model)
    if not layers:
        arch = (getattr(hf_config, "architectures", None) or [type(model).__name__])[0]
        raise ValueError(
            f"--enable-expert-parallel needs a mixture-of-experts model; {arch} has no experts "
            "(for plain replicas of a dense model give --data-parallel-size alone)"
        )
    for m in layers:
        expert_range(m.w13.shape[0], size, 0)
