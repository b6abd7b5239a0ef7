"""Starting the expert-parallel group of D data-parallel ranks, and naming a rank that died.

Every rank joins one TCPStore: the server's frontend hosts it (launch.py passes its address to
each core process, and with --nnodes the other nodes' launchers to theirs: server/ep_node.py),
offline the Engine's process hosts it as rank 0 and spawns ranks 1..D-1 (ep_worker.py). Each
rank writes its node and pid to the store, then joins the groups (`EPGroup`).

A collective that fails because a rank died (gloo reports the vanished peer at once) is named by
`PidWatch.explain`: a peer of this node whose pid is gone or a zombie; with every such peer
alive and peers on other nodes (whose pids mean nothing here), those, as a collective with them
that failed (their node's log says which died and how). Offline, rank 0 holds its workers'
process handles and uses `TensorParallel`'s watch instead, which also says how the rank died.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from swaserve.config import EngineConfig
from swaserve.distributed.expert_parallel import ExpertParallel
from swaserve.distributed.launch import (
    DEATH_GRACE_S,
    RankFailure,
    TensorParallel,
    _wait_ready,
    ready_key,
    remote_ranks_failed,
)
from swaserve.distributed.parallel_state import EPGroup, open_store, share_cpu_cores

log = logging.getLogger(__name__)
ROLE = "data-parallel"
_CANNOT = "; the expert-parallel group cannot continue"


def _pid_key(rank: int) -> str:
    return f"swaserve/ep_pid/{rank}"


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:<rank> on CUDA (one GPU per rank), else the CPU."""
    device = config.torch_device()
    return torch.device("cuda", rank) if device.type == "cuda" else device


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


class PidWatch:
    """Names a dead peer: by its pid on this node, as "on other nodes" elsewhere. `places`:
    every rank's (node, pid), from the store."""

    def __init__(self, places: dict[int, tuple[int, int]], rank: int) -> None:
        node = places[rank][0]
        self.peers = {r: pid for r, (n, pid) in places.items() if r != rank and n == node}
        self.remote = sorted(r for r, (n, _) in places.items() if n != node)

    def explain(self) -> RankFailure | None:
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            for rank, pid in self.peers.items():
                if _gone(pid):
                    return RankFailure(f"{ROLE} rank {rank} (pid {pid}) is gone{_CANNOT}")
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not self.remote:
            return None
        return RankFailure(remote_ranks_failed(ROLE, self.remote) + _CANNOT)


def join_expert_parallel(
    size: int, rank: int, host: str, port: int, device: torch.device, node: int = 0
) -> ExpertParallel:
    """A rank other than the store's host (a server core, an offline worker) on node `node`:
    join the groups; its failures are named by pid on its node, as remote elsewhere."""
    store = open_store(host, port, size, is_master=False)
    store.set(_pid_key(rank), f"{node}:{os.getpid()}")
    store.set(ready_key(rank), "1")
    group = EPGroup.create(store, rank, size, host, device)
    places = {}
    for r in range(size):
        n, pid = store.get(_pid_key(r)).decode().split(":")
        places[r] = (int(n), int(pid))
    ep = ExpertParallel(group, PidWatch(places, rank).explain)
    ep.store = store  # kept alive with the group
    return ep


def start_offline(config: EngineConfig, folder: Path) -> tuple[TensorParallel, ExpertParallel]:
    """The offline Engine's process as rank 0: host the store, spawn ranks 1..D-1, join."""
    from swaserve.distributed.ep_worker import spawn_workers

    size = config.data_parallel_size
    device = rank_device(config, 0)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        log.info("expert parallelism on CPU: %d threads per rank", share_cpu_cores(size))
    host = "127.0.0.1"
    store = open_store(host, 0, size, is_master=True)
    store.set(_pid_key(0), f"0:{os.getpid()}")
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
    ep = ExpertParallel(group, parallel.explain)
    log.info(
        "expert parallelism: %d data-parallel ranks (%s), store %s:%d",
        size,
        device,
        host,
        store.port,
    )
    return parallel, ep
