"""Tensor-parallel layers, swapped into a model built on the meta device (`shard_model`), before
its weights exist, so each rank only ever allocates and loads its own shard.

Per rank r of T (Megatron's split, one all-reduce after attention and one after the MLP):

    embed_tokens   rows [r V', (r+1) V') of the vocabulary padded to V' T >= V; ids outside the
                   shard give zeros, then an all-reduce (VocabParallelEmbedding)
    q_proj         heads [r H/T, (r+1) H/T): column-parallel; sinks split with them
    k_proj/v_proj  KV heads [r K/T, (r+1) K/T) when K >= T, else the one KV head r's query heads
                   read (kv head r K // T, replicated over T / K ranks)
    o_proj         the same input columns as q: row-parallel, all-reduce, bias once
    gate/up_proj   rows [r I/T, (r+1) I/T): column-parallel (the fused w13 of the experts too:
                   its rows of the gate half and of the up half)
    down_proj, w2  the same input columns: row-parallel, all-reduce, bias once
    lm_head        vocabulary rows as embed_tokens (tied: the embedding's shard itself); the
                   runner gathers the logits (tp_runner.py)
    DFlash drafter its attention and MLP as the target's layers (`shard_drafter`): its KV heads
                   per rank then equal the target's, so its layers share each rank's pool;
                   fc, the norms and rotary replicated; the target's embedding and head serve
                   it (distributed/dflash_tp.py)

Norms, rotary and the experts' router are replicated, except q/k norms over whole projections
(OLMo 2/3: `ProjectionRMSNorm`), cut with the heads and summing their squares over the ranks.
Biases of a row-parallel layer are added by rank 0 alone, so the all-reduce sums them once.
An FP8 checkpoint's row scales, which exist only after this plan, follow their weights' shards
(swaserve/weights/fp8_checkpoint.py `scale_shards`: a column-parallel weight's rows, a row-
parallel weight's whole vector).
Under expert parallelism (`experts=False`) the experts are not cut here: each rank holds whole
experts of its own (expert_shards.py), and their output is summed over the ranks by the MoE
exchange (expert_parallel.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.distributed.parallel_state import TPGroup
from swaserve.distributed.sharding import Shard
from swaserve.models.blocks import Attention, GatedMLP, RMSNorm
from swaserve.models.moe import SparseMoE
from swaserve.speculative.dflash_config import DFlashConfig
from swaserve.speculative.dflash_model import DFlashAttention, DFlashDrafter


class RowParallelLinear(nn.Linear):
    """A Linear whose input features are split over the ranks: partial products, summed by one
    all-reduce. The bias (replicated) is added on rank 0 only. `reduce = False`: the partial
    sum is returned and the caller all-reduces it (Cohere2's parallel block sums attention and MLP
    first, one all-reduce for both)."""

    reduce = True

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp.rank == 0 else None
        out = F.linear(x, self.weight, bias)
        return self.tp.all_reduce(out) if self.reduce else out


class ProjectionRMSNorm(RMSNorm):
    """An RMSNorm over a whole projection whose features are split over the ranks (OLMo 2/3's q/k
    norms): each rank holds `dim` of them, and the mean square is the all-reduced sum of squares
    over `dim * T`. A KV head replicated on T/K ranks (fewer KV heads than ranks) enters the
    sum T/K times, as every head does in `dim * T`, so the mean is the whole projection's."""

    def __init__(self, dim: int, eps: float, tp: TPGroup) -> None:
        super().__init__(dim, eps)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))  # [T, 1]
        xf = xf * torch.rsqrt(squares / (x.shape[-1] * self.tp.size) + self.eps)
        return self.weight * xf.to(dtype)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, end) of the embedding (zero rows past the vocabulary); ids outside them
    look up zeros, and the all-reduce adds the one rank's row that holds each id."""

    def __init__(self, rows: int, dim: int, start: int, end: int, tp: TPGroup) -> None:
        super().__init__(rows, dim)
        self.start, self.end, self.tp = start, end, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


def vocab_shard(vocab: int, tp: TPGroup) -> tuple[int, int, int]:
    """(rows per rank, first id, end id) of rank tp.rank's vocabulary shard."""
    rows = -(-vocab // tp.size)
    start = min(vocab, tp.rank * rows)
    return rows, start, min(vocab, start + rows)


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    return max(1, num_kv_heads // size)


def _split(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    if total % tp.size:
        raise ValueError(
            f"--tensor-parallel-size {tp.size} must divide the model's {what} ({total})"
        )
    n = total // tp.size
    return n * tp.rank, n * (tp.rank + 1)


class _Planner:
    """Shrinks parameters on the meta model and records each one's Shard by its name."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.shards: dict[str, Shard] = {}

    def keep(
        self,
        owner: nn.Module,
        prefix: str,
        leaf: str,
        dim: int,
        ranges: list[tuple[int, int]],
        local: int | None = None,
    ) -> None:
        """Parameter `leaf` of `owner` keeps `ranges` of `dim` (local size: their total, or
        `local` with padding)."""
        p = getattr(owner, leaf)
        if p is None:
            return
        full = tuple(p.shape)
        shape = list(full)
        shape[dim] = local if local is not None else sum(hi - lo for lo, hi in ranges)
        setattr(owner, leaf, nn.Parameter(torch.empty(shape, dtype=p.dtype), requires_grad=False))
        self.shards[f"{prefix}{leaf}"] = Shard(full, dim, tuple(ranges))

    def heads(self, num_heads: int, num_kv_heads: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """This rank's query heads [h0, h1) and KV heads [k0, k1) (the module docstring)."""
        tp = self.tp
        h = _split(num_heads, tp, "attention heads")
        if num_kv_heads >= tp.size:
            return h, _split(num_kv_heads, tp, "KV heads")
        if tp.size % num_kv_heads:
            raise ValueError(
                f"--tensor-parallel-size {tp.size} must divide the model's KV heads "
                f"({num_kv_heads}) or be a multiple of them"
            )
        k0 = tp.rank * num_kv_heads // tp.size  # fewer KV heads than ranks: the one its
        return h, (k0, k0 + 1)  # query heads read

    def attention(self, a: Attention, prefix: str) -> None:
        s = a.spec
        (h0, h1), (k0, k1) = self.projections(a, prefix, s.num_heads, s.num_kv_heads, s.head_dim)
        self.keep(a, prefix, "sinks", 0, [(h0, h1)])
        if a.qk_norm_whole:  # norms over the whole q/k projections: cut with them, reduced
            d = s.head_dim
            a.q_norm = self._projection_norm(a.q_norm, f"{prefix}q_norm.", (h0 * d, h1 * d))
            a.k_norm = self._projection_norm(a.k_norm, f"{prefix}k_norm.", (k0 * d, k1 * d))
        a.spec = dataclasses.replace(s, num_heads=h1 - h0, num_kv_heads=k1 - k0)

    def query_only_attention(self, a: nn.Module, prefix: str) -> None:
        """A layer reading another layer's K/V (Gemma 4's KV sharing: q_proj and o_proj only):
        its query heads as `attention` cuts them, the KV heads of its source's cut."""
        s, d = a.spec, a.spec.head_dim
        (h0, h1), (k0, k1) = self.heads(s.num_heads, s.num_kv_heads)
        for leaf in ("weight", "bias"):
            self.keep(a.q_proj, f"{prefix}q_proj.", leaf, 0, [(h0 * d, h1 * d)])
        a.q_proj.out_features = (h1 - h0) * d
        a.o_proj = self._row_parallel(a.o_proj, f"{prefix}o_proj.", [(h0 * d, h1 * d)])
        a.spec = dataclasses.replace(s, num_heads=h1 - h0, num_kv_heads=k1 - k0)

    def _projection_norm(
        self, norm: RMSNorm, prefix: str, cols: tuple[int, int]
    ) -> ProjectionRMSNorm:
        new = ProjectionRMSNorm(cols[1] - cols[0], norm.eps, self.tp).to(norm.weight.dtype)
        self.shards[f"{prefix}weight"] = Shard(tuple(norm.weight.shape), 0, (cols,))
        return new

    def projections(
        self, a: nn.Module, prefix: str, num_heads: int, num_kv_heads: int, d: int
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """Cut `a`'s q/k/v_proj (column-parallel) and o_proj (row-parallel) to this rank's
        heads; returns them as `heads` does."""
        (h0, h1), (k0, k1) = self.heads(num_heads, num_kv_heads)
        for proj, (lo, hi) in (("q_proj", (h0, h1)), ("k_proj", (k0, k1)), ("v_proj", (k0, k1))):
            lin = getattr(a, proj)
            for leaf in ("weight", "bias"):
                self.keep(lin, f"{prefix}{proj}.", leaf, 0, [(lo * d, hi * d)])
            lin.out_features = (hi - lo) * d
        a.o_proj = self._row_parallel(a.o_proj, f"{prefix}o_proj.", [(h0 * d, h1 * d)])
        return (h0, h1), (k0, k1)

    def mlp(self, m: GatedMLP, prefix: str) -> None:
        lo, hi = _split(m.gate_proj.out_features, self.tp, "intermediate size")
        for proj in ("gate_proj", "up_proj"):
            lin = getattr(m, proj)
            for leaf in ("weight", "bias"):
                self.keep(lin, f"{prefix}{proj}.", leaf, 0, [(lo, hi)])
            lin.out_features = hi - lo
        m.down_proj = self._row_parallel(m.down_proj, f"{prefix}down_proj.", [(lo, hi)])

    def experts(self, m: SparseMoE, prefix: str) -> None:
        inter = m.w2.shape[2]
        lo, hi = _split(inter, self.tp, "expert intermediate size")
        halves = [(lo, hi), (inter + lo, inter + hi)]  # its rows of gate, then of up
        self.keep(m, prefix, "w13", 1, halves)
        self.keep(m, prefix, "b13", 1, halves)
        self.keep(m, prefix, "w2", 2, [(lo, hi)])
        m.tp = self.tp  # all-reduce after the experts, b2 on rank 0 (moe.py)

    def _row_parallel(self, lin: nn.Linear, prefix: str, ranges) -> RowParallelLinear:
        full_in = lin.in_features
        new = RowParallelLinear(
            sum(hi - lo for lo, hi in ranges), lin.out_features, lin.bias is not None, self.tp
        ).to(lin.weight.dtype)
        self.shards[f"{prefix}weight"] = Shard((lin.out_features, full_in), 1, tuple(ranges))
        return new

    def vocab(self, model: nn.Module) -> None:
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Embedding) and not isinstance(module, VocabParallelEmbedding):
                rows, start, end = vocab_shard(module.num_embeddings, self.tp)
                new = VocabParallelEmbedding(rows, module.embedding_dim, start, end, self.tp)
                self.shards[f"{name}.weight"] = Shard(
                    tuple(module.weight.shape), 0, ((start, end),)
                )
                _set_submodule(model, name, new.to(module.weight.dtype))
        head = getattr(model, "lm_head", None)
        if isinstance(head, nn.Linear):
            rows, start, end = vocab_shard(head.out_features, self.tp)
            self.keep(head, "lm_head.", "weight", 0, [(start, end)], local=rows)
            head.out_features = rows


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def shard_model(model: nn.Module, tp: TPGroup, experts: bool = True) -> dict[str, Shard]:
    """Make a model built on the meta device rank tp.rank's shard (see the module docstring);
    returns {parameter name: Shard} for the loader. ValueError naming the flag when a dimension
    does not split. `experts`: cut the MoE experts too (False under expert parallelism)."""
    planner = _Planner(tp)
    with torch.device("meta"):
        for name, module in list(model.named_modules()):
            prefix = f"{name}." if name else ""
            if isinstance(module, Attention):
                planner.attention(module, prefix)
            elif getattr(module, "tp_query_only", False):
                planner.query_only_attention(module, prefix)
            elif isinstance(module, GatedMLP):
                planner.mlp(module, prefix)
            elif isinstance(module, SparseMoE) and experts:
                planner.experts(module, prefix)
        planner.vocab(model)
    return planner.shards


def check_shardable(hf_config, size: int, experts: bool = True) -> None:
    """Whether the model splits over `size` ranks (on the meta device: no memory, no
    processes): a ValueError naming --tensor-parallel-size before any worker starts."""
    from swaserve.models.registry import model_class

    with torch.device("meta"):
        model = model_class(hf_config)(hf_config)
    shard_model(model, TPGroup.layout_only(0, size), experts)


def shard_drafter(drafter: DFlashDrafter, tp: TPGroup) -> dict[str, Shard]:
    """`shard_model` for a DFlash drafter built on the meta device. fc stays whole: its input,
    the target's kept hidden states, is replicated on every rank after the target's
    all-reduces, and so is its output."""
    planner = _Planner(tp)
    with torch.device("meta"):
        for name, module in list(drafter.named_modules()):
            prefix = f"{name}."
            if isinstance(module, DFlashAttention):
                (h0, h1), (k0, k1) = planner.projections(
                    module, prefix, module.num_heads, module.num_kv_heads, module.head_dim
                )
                module.num_heads, module.num_kv_heads = h1 - h0, k1 - k0
            elif isinstance(module, GatedMLP):
                planner.mlp(module, prefix)
    return planner.shards


def check_drafter_shardable(cfg: DFlashConfig, size: int) -> None:
    """`check_shardable` for a DFlash drafter's config (the error names the drafter)."""
    with torch.device("meta"):
        drafter = DFlashDrafter(cfg)
    try:
        shard_drafter(drafter, TPGroup.layout_only(0, size))
    except ValueError as e:
        raise ValueError(f"DFlash drafter: {e}".replace("the model's", "its")) from e
