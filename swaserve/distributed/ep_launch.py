"""Starting the expert-parallel group of D data-parallel ranks, and naming a rank that died.

Every rank joins one TCPStore: the server's frontend hosts it (launch.py passes its address to
each core process, and with --nnodes the other nodes' launchers to theirs: server/nodes.py),
offline the Engine's process hosts it as rank 0 and spawns ranks 1..D-1 (ep_worker.py). Each
rank writes its node and pid to the store, then joins the groups (`EPGroup`). With -tp T every
data-parallel rank's T - 1 tensor-parallel workers write theirs too, under their expert-parallel
rank (expert_shards.expert_rank), and join their own groups (ep_tp.py).

A collective that fails because a rank died (gloo reports the vanished peer at once) is named by
`PidWatch.explain`: a process of this node whose pid is gone or a zombie; with every such process
alive and peers on other nodes (whose pids mean nothing here), those, as a collective with them
that failed (their node's log says which died and how). Offline, rank 0 holds its workers'
process handles and asks `TensorParallel`'s watch first, which also says how the rank died.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from swaserve.config import EngineConfig
from swaserve.distributed.expert_parallel import ExpertParallel
from swaserve.distributed.expert_shards import expert_rank
from swaserve.distributed.launch import (
    RankFailure,
    TensorParallel,
    _wait_ready,
    ready_key,
    remote_ranks_failed,
    watch_for_failure,
)
from swaserve.distributed.parallel_state import EPGroup, open_store, share_cpu_cores

log = logging.getLogger(__name__)
ROLE = "data-parallel"
_CANNOT = "; the expert-parallel group cannot continue"


def _pid_key(rank: int) -> str:
    return f"swaserve/ep_pid/{rank}"


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The engine core's device: cuda:<rank x T> on CUDA (one GPU per process: its T - 1
    tensor-parallel workers take the next ones), else the CPU."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank * config.tensor_parallel_size)


def _gone(pid: int) -> bool:
    """The process has exited (or is a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    except OSError:
        return False
    return state in ("Z", "X")


def process_name(world_rank: int, tp_size: int) -> str:
    """How errors name a process of the expert-parallel world (expert_shards.expert_rank)."""
    dp, tp = divmod(world_rank, tp_size)
    return f"{ROLE} rank {dp}" + (f", tensor-parallel rank {tp}" if tp else "")


class PidWatch:
    """Names a dead process of the expert-parallel world: by its pid on this node, as "on other
    nodes" elsewhere. `places`: (node, pid) of world ranks from the store; with `store` and
    `world` (its D x T processes) the others are read from it as they register (tensor-parallel
    workers register after their core joined). `skip`: world ranks this process's own
    TensorParallel watches (its children: it knows how they ended)."""

    def __init__(
        self,
        places: dict[int, tuple[int, int]],
        rank: int,
        tp_size: int = 1,
        store: Any = None,
        world: int = 0,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        self.places, self.rank, self.tp_size = dict(places), rank, tp_size
        self.node = places[rank][0]
        self.store, self.world, self.skip = store, world, skip

    @property
    def peers(self) -> dict[int, int]:
        """{world rank: pid} of the other processes of this node (but `skip`)."""
        node, out = self.node, {self.rank, *self.skip}
        return {r: pid for r, (n, pid) in self.places.items() if r not in out and n == node}

    @property
    def remote(self) -> list[int]:
        """The data-parallel ranks with processes on other nodes."""
        return sorted({r // self.tp_size for r, (n, _) in self.places.items() if n != self.node})

    def _read_new(self) -> None:
        for r in range(self.world):
            if r in self.places:
                continue
            key = _pid_key(r)
            try:
                if not self.store.check([key]):
                    continue
                n, pid = self.store.get(key).decode().split(":")
            except (RuntimeError, OSError):  # the store's host is gone: what is known
                return
            self.places[r] = (int(n), int(pid))

    def poll(self, killed_only: bool = False) -> RankFailure | None:
        """One look: a process of this node found gone, else None (always with `killed_only`:
        how a process that is not a child ended is unknown here)."""
        if killed_only:
            return None
        if len(self.places) < self.world:
            self._read_new()
        for rank, pid in sorted(self.peers.items()):
            if _gone(pid):
                name = process_name(rank, self.tp_size)
                return RankFailure(f"{name} (pid {pid}) is gone" + _CANNOT,
                                   dp_rank=rank // self.tp_size)  # fmt: skip
        return None

    def explain(self) -> RankFailure | None:
        failure = watch_for_failure([self.poll])
        if failure is not None or not self.remote:
            return failure
        return RankFailure(remote_ranks_failed(ROLE, self.remote) + _CANNOT)


def register(store: Any, world_rank: int, node: int) -> None:
    """This process's node and pid under its world rank, for the others' PidWatch."""
    store.set(_pid_key(world_rank), f"{node}:{os.getpid()}")


def registered(store: Any, ranks: list[int]) -> bool:
    """Whether every world rank in `ranks` has registered (no wait)."""
    return store.check([_pid_key(r) for r in ranks])


def read_places(store: Any, ranks: range) -> dict[int, tuple[int, int]]:
    """(node, pid) of `ranks`, which have registered (blocks until they have)."""
    places = {}
    for r in ranks:
        n, pid = store.get(_pid_key(r)).decode().split(":")
        places[r] = (int(n), int(pid))
    return places


def join_expert_parallel(
    size: int,
    rank: int,
    host: str,
    port: int,
    device: torch.device,
    node: int = 0,
    tp_size: int = 1,
) -> ExpertParallel:
    """A rank other than the store's host (a server core, an offline worker) on node `node`:
    join the groups; its failures are named by pid on its node, as remote elsewhere. With
    `tp_size` > 1 this core is tensor-parallel rank 0 of its data-parallel rank."""
    store = open_store(host, port, size, is_master=False)
    me = expert_rank(rank, 0, tp_size)
    register(store, me, node)
    store.set(ready_key(rank), "1")
    group = EPGroup.create(store, rank, size, host, device)
    places = read_places(store, range(0, size * tp_size, tp_size))  # the cores: all joined
    own = frozenset(range(me + 1, me + tp_size))  # this core's workers, its TensorParallel's
    watch = PidWatch(places, me, tp_size, store, size * tp_size, own)
    ep = ExpertParallel(group, watch.explain, tp_size=tp_size)
    ep.watches = [watch]
    ep.place = {"rank": rank, "size": size, "host": host, "port": port, "node": node}
    ep.store = store  # kept alive with the group
    return ep


def start_offline(config: EngineConfig, folder: Path) -> tuple[TensorParallel, ExpertParallel]:
    """The offline Engine's process as rank 0: host the store, spawn ranks 1..D-1, join."""
    from swaserve.distributed.ep_worker import spawn_workers

    size, tp_size = config.data_parallel_size, config.tensor_parallel_size
    device = rank_device(config, 0)
    threads = torch.get_num_threads()
    if device.type == "cpu":  # every process of the D x T shares the cores
        log.info("expert parallelism on CPU: %d threads per rank", share_cpu_cores(size * tp_size))
    host = "127.0.0.1"
    store = open_store(host, 0, size, is_master=True)
    register(store, 0, 0)
    procs = spawn_workers(config, folder, host, store.port)
    try:
        _wait_ready(store, range(1, size), procs, ROLE)
        group = EPGroup.create(store, 0, size, host, device)
    except BaseException:
        for p in procs.values():
            p.terminate()
        torch.set_num_threads(threads)
        raise
    parallel = TensorParallel(group, procs, store, threads, role=ROLE)
    ep = ExpertParallel(group, parallel.explain, tp_size=tp_size)
    # rank 0 knows how its spawned ranks (and with -tp its own workers) died; the pids name the
    # other ranks' workers
    children = frozenset(range(1, tp_size)) | frozenset(range(tp_size, size * tp_size, tp_size))
    watch = PidWatch({0: (0, os.getpid())}, 0, tp_size, store, size * tp_size, children)
    ep.watches = [parallel, watch]
    ep.place = {"rank": 0, "size": size, "host": host, "port": store.port, "node": 0}
    log.info(
        "expert parallelism: %d data-parallel ranks (%s), store %s:%d",
        size,
        device,
        host,
        store.port,
    )
    return parallel, ep
