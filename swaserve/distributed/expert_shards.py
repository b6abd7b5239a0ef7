"""Which experts a rank holds under expert parallelism, and the model made that rank's part on
the meta device before its weights exist (as `layers.shard_model` does for TP).

The experts are spread over every process of the expert-parallel world: D data-parallel ranks
of T tensor-parallel ranks each, D x T processes (T = 1 without -tp). Process (i, j), data-
parallel rank i's tensor-parallel rank j, is expert-parallel rank r = i T + j of S = D T
(`expert_rank`). With E experts per MoE layer it holds experts [r E/S, (r+1) E/S), whole: its
rows of dim 0 of `w13`, `b13`, `w2` and `b2` (moe.py's layout); the experts are never cut along
their intermediate dimension (`layers.shard_model(experts=False)`). Everything else is whole on
every rank (T = 1) or tensor-parallel inside each data-parallel rank (T > 1); the routers are
whole everywhere. E must divide by S: an uneven split would give some ranks more GEMM rows than
the others on every step, and the MoE configs users run with S > 1 all have E a power of two.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swaserve.distributed.sharding import Shard
from swaserve.models.moe import SparseMoE

_EXPERT_PARAMS = ("w13", "b13", "w2", "b2")


def expert_rank(dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """The expert-parallel rank of data-parallel rank `dp_rank`'s tensor-parallel rank."""
    return dp_rank * tp_size + tp_rank


def expert_range(num_experts: int, size: int, rank: int, tp_size: int = 1) -> tuple[int, int]:
    """[lo, hi) of the experts expert-parallel rank `rank` of `size` holds; ValueError naming
    the flags when `size` (D x `tp_size`) does not divide `num_experts`."""
    if num_experts % size:
        flags = f"--data-parallel-size {size // tp_size}"
        if tp_size > 1:
            flags += f" x --tensor-parallel-size {tp_size} = {size} expert-parallel ranks"
        raise ValueError(
            f"{flags} with --enable-expert-parallel must divide the model's experts per layer "
            f"({num_experts})"
        )
    n = num_experts // size
    return rank * n, (rank + 1) * n


def shard_experts(model: nn.Module, rank: int, size: int) -> dict[str, Shard]:
    """Make a model built on the meta device hold expert-parallel rank `rank`'s experts only
    (each SparseMoE's `expert_range` set); returns {parameter name: Shard} for the loader."""
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


def check_expert_parallel(hf_config: Any, dp_size: int, tp_size: int = 1) -> None:
    """Whether the model's experts split over the `dp_size` x `tp_size` ranks (on the meta
    device: no memory, no processes): a ValueError naming the flags for a dense model or an
    uneven split; with `tp_size` > 1 also whether attention and the dense parts split over
    `tp_size` (the experts stay whole)."""
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
        expert_range(m.w13.shape[0], dp_size * tp_size, 0, tp_size)
    if tp_size > 1:
        from swaserve.distributed.layers import check_shardable

        check_shardable(hf_config, tp_size, experts=False)
