"""Sparse mixture-of-experts MLP shared by every MoE model: a linear router, top-k selection
by the model's rule, and the experts in one canonical layout:

    w13 [E, 2I, H]   rows 0..I-1: gate projections, rows I..2I-1: up (never interleaved)
    b13 [E, 2I]      optional, same row order
    w2  [E, H, I]    down projections
    b2  [E, H]       optional

so out(x) = sum over the token's top-k experts e of weight_e * (act(x w13[e]^T + b13[e]) w2[e]^T
+ b2[e]). Checkpoints in other layouts are mapped onto it at load (`per_expert_targets`,
`interleaved_targets`). `moe_torch` is the reference; `fused` (set on CUDA) routes to the Triton
kernel in `swaserve.ops.fused_moe`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

SWIGLU_ALPHA = 1.702  # gpt-oss: gate * sigmoid(alpha * gate)


def select_experts(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]) from router logits [T, E].

    "softmax_topk" (Qwen3-MoE): softmax over all experts in float32, top-k, renormalised to sum
    1 when `renormalize`. "topk_softmax" (gpt-oss): top-k of the logits, softmax over those k.
    """
    if scoring == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids
    if scoring == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    raise ValueError(f"unknown expert scoring {scoring!r}")


def _activate(gate_up: torch.Tensor, activation: str, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_pytorch_tanh":  # Gemma 4
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swigluoai":  # gpt-oss: clamped, and (up + 1)
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
    raise ValueError(f"unknown MoE activation {activation!r}")


def moe_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    limit: float = 7.0,
) -> torch.Tensor:
    """Reference MoE: x [T, H] -> [T, H], looping over the experts that got tokens. Sums in
    x's dtype, experts in ascending order, as transformers does."""
    t, k = topk_ids.shape
    out = torch.zeros_like(x)
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        picks = order[start : start + n]
        start += n
        rows = picks // k  # a token holds each expert at most once
        h = _activate(F.linear(x[rows], w13[e], None if b13 is None else b13[e]), activation, limit)
        y = F.linear(h, w2[e], None if b2 is None else b2[e])
        out.index_add_(0, rows, (y * topk_weights.flatten()[picks, None]).to(x.dtype))
    return out


class SparseMoE(nn.Module):
    """Router + top-k experts. Parameters: `router.weight` [E, H] (and `router.bias`), `w13`,
    `w2` (and `b13`, `b2` with `expert_bias`) in the layout of the module docstring."""

    fused = False
    zero_init = ("b13", "b2")  # dummy weights: biases at 0 (`weights.loader._init_dummy`)
    # Tensor parallelism (swaserve/distributed/layers.py): every expert's slice of the
    # intermediate dim; the partial outputs are summed by one all-reduce, b2 added by rank 0.
    tp = None
    # Expert parallelism (swaserve/distributed/expert_parallel.py): this rank holds experts
    # [lo, hi) (`expert_range`), whole; `ep` runs the exchange with the other ranks.
    ep = None
    expert_range: tuple[int, int] | None = None

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        scoring: str,
        renormalize: bool = False,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: str = "silu",
        limit: float = 7.0,
    ) -> None:
        super().__init__()
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize
        self.activation, self.limit = activation, limit
        self.router = nn.Linear(hidden, num_experts, bias=router_bias)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.b13 = nn.Parameter(torch.zeros(num_experts, 2 * inter)) if expert_bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden)) if expert_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is not None:  # experts spread over the data-parallel ranks
            return self.ep.moe_forward(self, x)
        weights, ids = self.route(x)
        b2 = self.b2 if self.tp is None or self.tp.rank == 0 else None
        out = self.run_experts(x, weights, ids, b2)
        return out if self.tp is None else self.tp.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) [T, k] of tokens x [T, H] by the model's rule."""
        return select_experts(self.router(x), self.top_k, self.scoring, self.renormalize)

    def run_experts(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, b2: torch.Tensor | None
    ) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) over the experts this module holds
        (ids index them: local ids under expert parallelism)."""
        if self.fused:
            from swaserve.ops.fused_moe import fused_moe

            return fused_moe(
                x, self.w13, self.w2, weights, ids, b13=self.b13, b2=b2,
                activation=self.activation, limit=self.limit,
            )  # fmt: skip
        return moe_torch(
            x, self.w13, self.b13, self.w2, b2, weights, ids, self.activation, self.limit
        )


# A checkpoint tensor's place in the model: (parameter name, index into it or None, tensor).
Target = tuple[str, tuple | None, torch.Tensor]
_PER_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def per_expert_targets(name: str, t: torch.Tensor) -> list[Target] | None:
    """`P.experts.<e>.{gate,up,down}_proj.weight` (one Linear per expert, the Hub's Qwen3-MoE
    and Mixtral-style layout) -> rows of `P.w13[e]` / all of `P.w2[e]`; None for other names."""
    m = _PER_EXPERT.fullmatch(name)
    if m is None:
        return None
    prefix, e, proj = m[1], int(m[2]), m[3]
    n = t.shape[0]  # I for gate/up: the loader's shape check catches a mismatch
    if proj == "down":
        return [(f"{prefix}.w2", (e,), t)]
    rows = slice(0, n) if proj == "gate" else slice(n, 2 * n)
    return [(f"{prefix}.w13", (e, rows), t)]


def interleaved_targets(param: str, t: torch.Tensor) -> Iterator[Target]:
    """Gate/up interleaved on the last dim (gate = [..., ::2], up = [..., 1::2]) of a
    `[E, H, 2I]` weight or `[E, 2I]` bias -> the gate and up halves of `param` (w13 / b13),
    copied from strided views (no intermediate copy)."""
    i = t.shape[-1] // 2
    gate, up = t[..., ::2], t[..., 1::2]
    if t.ndim == 3:  # [E, H, I] -> [E, I, H]
        gate, up = gate.transpose(1, 2), up.transpose(1, 2)
    yield param, (slice(None), slice(0, i)), gate
    yield param, (slice(None), slice(i, 2 * i)), up
