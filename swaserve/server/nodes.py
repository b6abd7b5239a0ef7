"""Data-parallel ranks over several machines (`swaserve serve -dp D [-tp T] --nnodes N --node-rank
k --dist-init-addr HOST:PORT`): the same D engine-core processes as on one machine, D/N of them
on each node, rank r on node r // (D/N), each with its T - 1 tensor-parallel workers beside it.
Plain replicas and expert-parallel ranks alike:

    node 0   HTTP frontend, the rendezvous store at HOST:PORT, its D/N cores (IPC sockets).
             For each rank on another node it binds the core's two ZMQ pipes on TCP (HOST's
             address, ports the system picks) and publishes them in the store (`IPC_KEY`).
    node k   no HTTP: `run_node` reads its ranks' pipes from the store, starts their cores
             (`python -m swaserve.server.core_process`, as node 0 does) and waits for them.

Node 0's frontend then routes over all D ranks as on one machine. With expert parallelism the
cores also join one group and step in lockstep (core_loop_ep.py); plain replicas share nothing.

Liveness: every TCP pipe is watched from both ends (link_watch.py: the connection's close, or
heartbeats unanswered for seconds). A remote core whose link is lost (its process, or its whole
node, gone) is a dead core to node 0's watchdog, named with its rank and node (launch.py); a
core that fails sends its last words first. A remote core whose link to node 0 is lost exits
as a local core does when its server process is gone. Without this, plain replicas would never
notice: no collective ties them (under expert parallelism a failing collective also tells).
Node k exits when its cores have: 0 when node 0 stopped them (or is gone), 1 when one failed.
The pipes carry msgpack, never pickle; like the store they are open to whoever reaches HOST
(run it on a trusted network).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from swaserve.config import EngineConfig
from swaserve.distributed.launch import rendezvous_address

log = logging.getLogger("swaserve.server")
IPC_KEY = "swaserve/node_ipc/{}"


def spans_nodes(config: EngineConfig) -> bool:
    """The data-parallel ranks are spread over machines (else `--nnodes` spreads the
    tensor-parallel ranks of one engine, distributed/launch.py)."""
    return config.nnodes > 1 and config.data_parallel_size > 1


def local_ranks(config: EngineConfig) -> range:
    """The data-parallel ranks whose engine cores run on this node: D/N on each of N (with one
    node, all D), or without data parallelism the one core on node 0 (the tensor-parallel ranks
    may span nodes: node k runs workers, no core)."""
    if config.data_parallel_size == 1:
        return range(1) if config.node_rank == 0 else range(0)
    per_node = config.data_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)



def remote_pipes(config: EngineConfig) -> tuple[str, str]:
    """What node 0 binds for a core on another node: TCP on the --dist-init-addr host's IPv4
    address (the address the other nodes reach), any free port."""
    ip = socket.gethostbyname(rendezvous_address(config)[0])
    return f"tcp://{ip}:*", f"tcp://{ip}:*"


def publish_pipes(store: Any, rank: int, endpoints: tuple[str, str]) -> None:
    """Node 0: rank `rank`'s bound (in, out) pipes, for its node to read."""
    store.set(IPC_KEY.format(rank), json.dumps(list(endpoints)))


def expert_parallel_spec(config: EngineConfig, rank: int, host: str, port: int) -> dict | None:
    """A core's place in the expert-parallel group (core_loop_ep.join_group); None for a plain
    replica."""
    if not config.enable_expert_parallel:
        return None
    return {"rank": rank, "size": config.data_parallel_size, "host": host, "port": port,
            "node": config.node_rank}  # fmt: skip


def run_node(config: EngineConfig, folder: Path, log_level: str) -> int:
    """Node k > 0: start this node's cores on the pipes node 0 published, wait for them; 1 if
    one failed. SIGTERM stops them (node 0's server then ends: a rank left)."""
    from swaserve.distributed.parallel_state import open_store
    from swaserve.server.launch import _exit_reason, replica_config, start_core

    host, port = rendezvous_address(config)
    size = config.data_parallel_size
    store = open_store(host, port, size, is_master=False)  # waits for node 0's
    ranks = local_ranks(config)
    procs: dict[int, subprocess.Popen] = {}

    def stop(signum: int, _frame: Any) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for rank in ranks:
            in_addr, out_addr = json.loads(store.get(IPC_KEY.format(rank)))
            ep = expert_parallel_spec(config, rank, host, port)
            # on CPU every rank process of this node (cores and their workers) shares its cores
            procs[rank] = start_core(replica_config(config, rank), folder, in_addr, out_addr,
                                     log_level, cpu_share=len(ranks) * config.tensor_parallel_size,
                                     expert_parallel=ep)  # fmt: skip
            log.info("engine core process %d is loading %s (dp rank %d of %d, node %d)",
                     procs[rank].pid, config.model, rank, size, config.node_rank)
    except BaseException:
        stop(signal.SIGTERM, None)
        raise
    failed = 0
    for rank, p in procs.items():
        code = p.wait()
        if code:
            log.error("dp rank %d's engine core process %d %s", rank, p.pid, _exit_reason(code))
            failed = 1
    return failed
