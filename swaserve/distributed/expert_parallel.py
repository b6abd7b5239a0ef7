"""Data-parallel attention with expert-parallel MoE (`--data-parallel-size D
--enable-expert-parallel`): each of the D ranks runs its own engine (scheduler, KV pool, prefix
cache) on its own requests, with attention and dense weights whole, and holds E/D of every MoE
layer's experts (expert_shards.py). Tokens meet the experts by collectives.

Lockstep. Every rank makes the same collectives in the same order, one step at a time
(EngineCore.step):

    agree_step(tokens)   one all-gather (gloo) of [tokens this step, wants to stop, decode
                         only] per rank: each rank learns every rank's token count, which
                         sizes the step's exchange, whether any rank has work at all, and
                         whether the step takes the fixed-shape decode path (every rank
                         decode-only, none above the cap: decode_workspace.py)
    the forward          only when some rank has tokens: a rank with a batch runs its model, a
                         rank without one an idle forward (`idle_forward`: the MoE layers alone,
                         on zero tokens); either way every MoE layer, in layer order, makes
                         dispatch + combine
    end_step()           the step's sizes are dropped

So when no rank has work nobody blocks in a forward, and a rank with no work still serves its
experts to the others. Forwards outside a step (start-up calibration, which every rank runs)
exchange their sizes in each MoE layer instead.

In each MoE layer (`moe_forward`): the router runs on the rank's own tokens (the same weights on
every rank, so routing equals one process's), then `MoEExchange.dispatch` brings every rank's
tokens with their top-k ids and weights, each rank computes its experts' share for all of them
(`local_experts`), and `MoEExchange.combine` sums the shares and hands each rank its own rows.
`GatherExchange` does it with all-gathers padded to the step's largest rank and one
reduce-scatter; an all-to-all that sends each token only to its experts' ranks can replace it
behind the same two calls. Decode-only steps use `FixedExchange` instead (the same collectives
on buffers of N rows per rank, allocated once: decode_workspace.py).

Speculative decoding (n-gram or DFlash) needs nothing more: each rank drafts for its own
requests (a DFlash drafter is dense: no collective of this group inside it), a verify chunk is
K + 1 tokens of the rank's step like any chunk (counted in the agreement and against the cap),
and a rank without requests joins the verify step with an idle forward. DFlash's context K/V
read the target's kept layer outputs of the rank's forward: its own rows, as the combine
returns them on either path; an idle forward keeps nothing and stores no context.

Every collective runs under `guard()`: a failure caused by a rank that died is re-raised as a
`RankFailure` naming it (`explain`, given by the launcher), never a hang.

With -tp T inside each data-parallel rank (`tp_size` > 1) every data-parallel rank is T
processes; the experts are spread over all D x T, each process runs `moe_forward` on its copy of
its rank's tokens through the exchange of its tensor-parallel index, and the combine ends with
one all-reduce over the rank's tensor-parallel group: ep_tp.py says how and why. The engine
core (tensor-parallel rank 0) makes the agreement and hands its result to its T - 1 workers
(`announce`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.distributed.expert_shards import expert_rank, moe_layers
from swaserve.distributed.launch import RankFailure, naming_dead_ranks
from swaserve.distributed.parallel_state import EPGroup, TPGroup
from swaserve.models.moe import SparseMoE

Explain = Callable[[], "RankFailure | None"]


class MoEExchange(Protocol):
    def dispatch(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, sizes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens x [n, H] with their top-k weights and global expert ids [n, k]
        -> the tokens this rank's experts must see, same layout (ids -1: no expert)."""

    def combine(self, out: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """This rank's experts' share for the dispatched tokens -> the full MoE output of this
        rank's own n tokens (every rank's shares summed)."""

    # where local_experts writes the share of the dispatched rows (same shape), or None: a new
    # tensor per call
    share: torch.Tensor | None


class GatherExchange:
    """All-gather + reduce-scatter. Each rank pads its rows to m = max(sizes), so the gathered
    tensors are rank-major blocks of m rows:

        row:   0 ... s_0 ... m | m ... m + s_1 ... 2m | ...
               rank 0's tokens | rank 1's tokens      |      (padding: x 0, ids and weights -1)

    and the reduce-scatter of the [D m, H] shares gives rank r block r, whose first s_r rows
    are its own tokens' outputs."""

    share = None

    def __init__(self, group: EPGroup) -> None:
        self.group = group

    def dispatch(self, x, weights, ids, sizes):
        n, k = ids.shape
        pad = max(sizes) - n
        # ids travel as float32 beside the weights: exact below 2^24 experts
        route = torch.cat([weights.float(), ids.float()], dim=1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
            route = torch.cat([route, route.new_full((pad, 2 * k), -1.0)])
        xs = torch.cat(self.group.all_gather(x))
        rs = torch.cat(self.group.all_gather(route))
        return xs, rs[:, :k].to(weights.dtype), rs[:, k:].long()

    def combine(self, out, sizes):
        return self.group.reduce_scatter(out)[: sizes[self.group.rank]]


def local_experts(
    moe: SparseMoE,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over the (token, k) assignments to this rank's experts [lo, hi) of weight * expert(x),
    [T, H] (zero rows for tokens with none here), in `out` when given. The assignments are
    compacted to one per row (top-1 in local ids) so that the experts' kernel only computes what
    this rank holds."""
    lo, hi = moe.expert_range
    out = torch.zeros_like(x) if out is None else out.zero_()
    rows, cols = ((ids >= lo) & (ids < hi)).nonzero(as_tuple=True)
    if rows.numel():
        local_ids = (ids[rows, cols] - lo).unsqueeze(1)
        y = moe.run_experts(x[rows], weights[rows, cols].unsqueeze(1), local_ids, moe.b2)
        out.index_add_(0, rows, y.to(x.dtype))
    return out


class ExpertParallel:
    """This rank's handle on the expert-parallel group: the step agreement, the MoE layers'
    exchange, the idle forward. Set on every SparseMoE of the model as `ep`. `group`: the D
    data-parallel ranks' processes of this process's tensor-parallel index `tp_rank` (of
    `tp_size`; 0 of 1 without -tp)."""

    def __init__(
        self,
        group: EPGroup,
        explain: Explain,
        exchange: MoEExchange | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.group = group
        self.rank, self.size = group.rank, group.size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.tp: TPGroup | None = None  # this data-parallel rank's T processes (attach)
        self.explain = explain
        # watches of the other processes of the expert-parallel world (PidWatch, offline rank
        # 0's TensorParallel; set by the launchers): with -tp the engine core's TensorParallel
        # asks them with its own workers
        self.watches: list[Any] = []
        # the engine core with -tp: hands each agreed step's sizes to its workers (tp_runner)
        self.announce: Callable[[list[int], bool], None] | None = None
        self.exchange = exchange or GatherExchange(group)
        # the decode-only path (decode_workspace.py): set by enable_decode_workspace
        self.decode_exchange: MoEExchange | None = None
        self.cap = 0  # N: most tokens per rank on the fixed path; 0: no fixed path
        self.sizes: list[int] | None = None  # tokens of every rank in this step's forward
        self.fixed = False  # this step's MoE layers exchange through the decode workspace
        # counters for memory_stats(): agreed steps with a forward on each path, and this
        # rank's decode-only steps above the cap (the scheduler keeps that at 0)
        self.counts = {"moe_decode_steps": 0, "moe_prefill_steps": 0, "moe_decode_over_cap": 0}
        self.want_stop = False  # this rank asks every rank to stop after this step (server)
        self.stopping = False  # some rank asked: every rank leaves its loop after this step
        self.any_work = False  # some rank had tokens in the last agreed step
        self.failure: RankFailure | None = None
        self.store = None  # the rendezvous store, kept alive as long as the group
        # how to join this world: {"rank", "size", "host", "port", "node"} of this data-parallel
        # rank and the store (its tensor-parallel workers join with it: ep_tp.py)
        self.place: dict | None = None
        self._layers: list[SparseMoE] = []

    @property
    def experts_place(self) -> tuple[int, int]:
        """(expert-parallel rank, size) of this process: which experts it holds
        (expert_shards.py)."""
        return expert_rank(self.rank, self.tp_rank, self.tp_size), self.size * self.tp_size

    def attach(self, model: nn.Module, tp: TPGroup | None = None) -> None:
        """Route the model's MoE layers (built with this process's experts) through this group;
        `tp`: this data-parallel rank's tensor-parallel group (T > 1), whose ranks' shares the
        combine sums."""
        self._layers = moe_layers(model)
        for m in self._layers:
            m.ep = self
        self.tp = tp if tp is not None and tp.size > 1 else None

    def enable_decode_workspace(self, rows: int) -> int:
        """The fixed-shape path for decode-only steps of at most `rows` tokens per rank (after
        `attach`; every rank calls it with the same rows). Returns the workspace's bytes."""
        from swaserve.distributed.decode_workspace import DecodeWorkspace, FixedExchange

        # every MoE layer of a model has the same hidden size and top-k: one set of buffers, in
        # the activations' dtype (the router's)
        shapes = {(m.router.weight.shape[1], m.top_k, m.router.weight.dtype, m.w13.device)
                  for m in self._layers}  # fmt: skip
        assert len(shapes) == 1, f"MoE layers of different shapes: {shapes}"
        h, k, dtype, device = shapes.pop()
        ws = DecodeWorkspace(self.group, rows, h, k, dtype, device)
        self.decode_exchange = FixedExchange(self.group, ws)
        self.cap = rows
        return ws.nbytes

    @property
    def workspace_bytes(self) -> int:
        ex = self.decode_exchange
        return ex.ws.nbytes if ex is not None else 0

    # ---- the step ------------------------------------------------------------------------

    def agree_step(self, num_tokens: int, decode_only: bool = False) -> bool:
        """The step's one agreement: True when some rank has tokens, so every rank runs a
        forward (an idle one without tokens of its own). `decode_only`: every chunk of this
        rank's batch is a decode or a verify (True for an empty batch)."""
        t = torch.tensor([num_tokens, int(self.want_stop), int(decode_only)], dtype=torch.int64)
        with self.guard():
            rows = torch.stack(self.group.all_gather(t, on_cpu=True))
        self.sizes = rows[:, 0].tolist()
        self.stopping = bool(rows[:, 1].any())
        self.any_work = sum(self.sizes) > 0
        # the same rows on every rank: every rank takes the same path
        self.fixed = self.cap > 0 and bool(rows[:, 2].all()) and max(self.sizes) <= self.cap
        if self.any_work and self.announce is not None:  # this rank's workers take the step
            self.announce(self.sizes, self.fixed)
        if self.any_work:
            self.counts["moe_decode_steps" if self.fixed else "moe_prefill_steps"] += 1
            if self.cap and decode_only and num_tokens > self.cap:
                self.counts["moe_decode_over_cap"] += 1
        return self.any_work

    def begin_step(self, sizes: list[int], fixed: bool) -> None:
        """A tensor-parallel worker: the step its engine core agreed on (ep_tp.py)."""
        self.sizes, self.fixed = sizes, fixed

    def end_step(self) -> None:
        self.sizes = None
        self.fixed = False

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """This rank's forward without tokens: every MoE layer joins the exchange with zero rows
        and serves its experts to the other ranks (attention has nothing to do)."""
        for m in self._layers:
            m(torch.empty(0, m.w13.shape[2], dtype=m.w13.dtype, device=m.w13.device))

    # ---- one MoE layer -------------------------------------------------------------------

    def moe_forward(self, moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
        sizes = self.sizes
        if sizes is None:  # a forward outside a step: every rank runs it, sizes exchanged here
            n = torch.tensor([x.shape[0]], dtype=torch.int64)
            with self.guard():
                sizes = [int(s) for s in torch.cat(self.group.all_gather(n, on_cpu=True))]
        elif sizes[self.rank] != x.shape[0]:  # the other ranks would slice wrong rows
            raise RuntimeError(
                f"expert parallelism: a forward of {x.shape[0]} tokens in a step agreed for "
                f"{sizes[self.rank]} on data-parallel rank {self.rank}"
            )
        exchange = self.decode_exchange if self.fixed else self.exchange
        weights, ids = moe.route(x)
        with self.guard():
            xs, ws, es = exchange.dispatch(x, weights, ids, sizes)
        share = local_experts(moe, xs, ws, es, exchange.share)
        with self.guard():
            out = exchange.combine(share, sizes)
            # -tp: each of the rank's T processes holds its tensor-parallel index's experts'
            # sum; every rank of a group has the same token count, so all or none reduce
            if self.tp is not None and out.shape[0]:
                self.tp.all_reduce(out)
            return out

    # ---- failures ------------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around every collective: a failure caused by a dead rank names it (and sticks)."""
        if self.failure is not None:
            raise self.failure
        with naming_dead_ranks(self._explain_and_keep):
            yield

    def _explain_and_keep(self) -> RankFailure | None:
        self.failure = self.explain()
        return self.failure
