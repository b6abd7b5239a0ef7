"""Attention tensor parallelism inside the ranks of DP attention + expert-parallel MoE
(`--data-parallel-size D --tensor-parallel-size T --enable-expert-parallel`, vLLM's meaning):
D x T processes.

    data-parallel rank i   T processes (i, 0) .. (i, T-1): the engine core (i, 0), with the
                           rank's scheduler, KV pool and prefix cache, and T - 1 tensor-parallel
                           workers (worker.py) mirroring its steps. Attention, the dense MLPs,
                           embeddings and head are sharded over the T as with plain -tp
                           (layers.shard_model(experts=False)); KV heads split or replicated.
    the experts            spread over all D x T: (i, j) is expert-parallel rank i T + j and
                           holds E / (D T) experts of every MoE layer, whole (expert_shards.py)

Groups, besides each data-parallel rank's own tensor-parallel group (TP_i, launch.py):

    EP_j, j = 0..T-1       (0, j) .. (D-1, j): every data-parallel rank's tensor-parallel rank
                           j (parallel_state.expert_group_store); EP_0, the engine cores, also
                           carries each step's agreement (and, offline, rank 0's messages)

Inside TP_i every process holds the same hidden states (attention ends with an all-reduce), so
the MoE layer on (i, j) sees the same n_i tokens as its T - 1 siblings:

    route      the router, whole everywhere: the same top-k on every copy
    dispatch   all-gather over EP_j: (i, j) gets every data-parallel rank's tokens, each once
               (from that rank's tensor-parallel rank j)
    experts    (i, j)'s own experts on those rows: each (token, expert) pair is computed by the
               one process holding the expert, from the one copy that reached it through EP_j
    combine    reduce-scatter over EP_j: rank i's rows of the sum over EP_j's experts; then
               all-reduce over TP_i: the sum over j, every expert's share counted once

Why every tensor-parallel rank dispatches all of its rank's tokens, rather than 1/T of them
each followed by an all-gather over TP_i: the layer keeps the shape of both parents. Over EP_j
the token counts are the data-parallel ranks' own, so the step's one agreement, the exchanges
(GatherExchange, and FixedExchange's N rows per rank for the decode workspace) and the
scheduler's cap are T = 1's unchanged; over TP_i the one all-reduce after the MoE is plain
tensor parallelism's (its partial sums are per expert here, per intermediate slice there).
Each process receives sum_i n_i rows either way (a 1/T split over D x T ranks gathers as many);
what the split would save is half of the combine's TP_i traffic (an all-gather of n_i / T rows
instead of an all-reduce of n_i), at the cost of uneven splits of n_i, per-process sizes in the
agreement and a fixed path of N / T rows: a later change behind the same MoEExchange calls if
a measurement asks for it. The result equals one process's up to the order of the sums.

The step: the engine core makes the agreement over EP_0 (ExpertParallel.agree_step) and, when
some rank has tokens, hands the sizes and the path (fixed or not) to its workers before the
forward (step_wire MOE, `ExpertParallel.announce`); a worker whose rank has no tokens then runs
the idle forward with its core. A worker registers its pid in the expert-parallel store and
names a process of this node that died (ep_launch.PidWatch); the engine core's TensorParallel
asks that watch before its own workers, so a worker that failed because another rank died does
not hide that death.
"""

from __future__ import annotations

import os
import time

import torch

from swaserve.config import EngineConfig
from swaserve.distributed.ep_launch import PidWatch, register, registered
from swaserve.distributed.expert_parallel import ExpertParallel
from swaserve.distributed.expert_shards import expert_rank
from swaserve.distributed.launch import RankFailure
from swaserve.distributed.parallel_state import (
    RENDEZVOUS_TIMEOUT,
    EPGroup,
    TPGroup,
    expert_group_store,
    open_store,
)
from swaserve.speculative.dflash_config import DFlashConfig


def join_as_worker(place: dict, tp: TPGroup, device: torch.device) -> ExpertParallel:
    """Tensor-parallel worker tp.rank of data-parallel rank place["rank"] (the core's
    `ExpertParallel.place`): register, wait for the other data-parallel ranks' workers of its
    index (a process of this node that dies meanwhile is a RankFailure naming it), join EP_j."""
    size, rank, host = place["size"], place["rank"], place["host"]
    store = open_store(host, place["port"], size, is_master=False)
    world = size * tp.size
    me = expert_rank(rank, tp.rank, tp.size)
    register(store, me, place["node"])
    watch = PidWatch({me: (place["node"], os.getpid())}, me, tp.size, store, world)
    peers = [expert_rank(r, tp.rank, tp.size) for r in range(size)]
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while not registered(store, peers):
        failure = watch.poll()
        if failure is not None:
            raise failure
        if time.monotonic() > deadline:
            raise RankFailure(
                f"tensor-parallel rank {tp.rank}'s expert-parallel peers did not all reach "
                f"{host}:{place['port']} within {RENDEZVOUS_TIMEOUT.total_seconds():.0f} s"
            )
        time.sleep(0.05)
    group = EPGroup.create(expert_group_store(store, tp.rank), rank, size, host, device)
    ep = ExpertParallel(group, watch.explain, tp_rank=tp.rank, tp_size=tp.size)
    ep.watches = [watch]
    ep.store = store  # kept alive with the group
    return ep


def attach_worker(
    ep: ExpertParallel,
    model: torch.nn.Module,
    tp: TPGroup,
    config: EngineConfig,
    dflash: DFlashConfig | None = None,
) -> None:
    """A worker's model (built with its experts) joins the exchange, with the decode workspace
    its core allocates: the same N, from the same config and the same K drafts per verify
    (`dflash`: the DFlash drafter's config, whose block gives K; n-gram's from the config). A
    worker's N that differed from its rank 0's would pad the fixed-path collectives to other
    shapes."""
    from swaserve.distributed.decode_workspace import decode_cap
    from swaserve.engine.speculation import num_draft_tokens

    ep.attach(model, tp)
    cap = decode_cap(config, num_draft_tokens(config, dflash))
    if cap:
        ep.enable_decode_workspace(cap)
