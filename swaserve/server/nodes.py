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

Start-up: node k joins node 0 first thing, before it resolves the model or starts a core: it
reads its control pipe's address from the store (`CONTROL_KEY`, bound by node 0 as `NodeWatch`)
and connects (`NodeLink`), watched like the cores' pipes. Until every core is ready node 0 asks
each node's `NodeWatch` too, so a node that dies, or whose core dies, before that core connects
fails the start within seconds, not at the ready timeout; a node that fails at start (its model
missing there, a core that exits) says why (`failed`) before it exits. A node that never joins
is only caught by the start-up timeout (--startup-timeout; node 0 cannot tell it from one not
started yet, and logs the nodes it still waits for every 30 s).

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
import os
import signal
import socket
import subprocess
import time
from typing import Any

import msgpack
import zmq

from swaserve.config import EngineConfig
from swaserve.distributed.launch import rendezvous_address
from swaserve.server.link_watch import LinkWatch, attach

log = logging.getLogger("swaserve.server")
IPC_KEY = "swaserve/node_ipc/{}"
CONTROL_KEY = "swaserve/node_control/{}"  # node k's control pipe (node 0 binds it)
HELLO, FAILED = "hello", "failed"  # node k -> node 0, on the control pipe (msgpack)
JOIN_TIMEOUT_S = 60.0  # node k's control pipe connects to node 0 within this, or node k fails
NODE_POLL_S = 0.2  # node k looks at its cores this often


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
    return node_ranks(config, config.node_rank)


def node_ranks(config: EngineConfig, node: int) -> range:
    """The data-parallel ranks of node `node` (data parallelism over nodes)."""
    per_node = config.data_parallel_size // config.nnodes
    return range(node * per_node, (node + 1) * per_node)


def describe_node(config: EngineConfig, node: int) -> str:
    """`node 1 (dp ranks 2-3)`, or `node 1 (dp rank 1)`."""
    ranks = node_ranks(config, node)
    if len(ranks) == 1:
        return f"node {node} (dp rank {ranks[0]})"
    return f"node {node} (dp ranks {ranks[0]}-{ranks[-1]})"


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


class NodeWatch:
    """Node 0's end of node k's control pipe, bound (watched from before node k can connect) on
    the address node 0 binds the remote cores' pipes on. Asked while the cores start."""

    def __init__(self, config: EngineConfig, node: int) -> None:
        self.node = node
        self.name = describe_node(config, node)
        self.num_ranks = len(node_ranks(config, node))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        link = attach([(self.sock, remote_pipes(config)[0])], bind=True)
        assert link is not None  # a TCP pipe is always watched
        self.link: LinkWatch = link
        self.joined = False  # node k said hello
        self.reason: str | None = None  # the first failure node k reported (it is final)

    def endpoint(self) -> str:
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def failure(self) -> str | None:
        """Why node k cannot bring its cores up, if it cannot: what it said, else its link lost
        (its process or its machine gone). Reads what has arrived, never waits."""
        while self.reason is None:
            try:
                msg = msgpack.unpackb(self.sock.recv(zmq.NOBLOCK), raw=False)
            except zmq.Again:
                break
            if msg[0] == HELLO:
                self.joined = True
                log.info("%s joined: its launcher is pid %s on %s", self.name, msg[1]["pid"],
                         msg[1]["host"])  # fmt: skip
            elif msg[0] == FAILED:
                self.reason = str(msg[1])
        if self.reason is not None:
            return self.reason
        if self.link.lost():
            return (f"node {self.node} closed its connection (its process or its machine is "
                    "gone, or it stopped answering)")
        return None

    def close(self) -> None:
        self.link.close()
        self.sock.close()
        self.ctx.term()


def watch_nodes(config: EngineConfig, store: Any) -> list[NodeWatch]:
    """Node 0: a bound control pipe per other node, published in the store (none unless the
    data-parallel ranks span nodes)."""
    if not spans_nodes(config):
        return []
    watches = [NodeWatch(config, node) for node in range(1, config.nnodes)]
    for w in watches:
        store.set(CONTROL_KEY.format(w.node), json.dumps(w.endpoint()))
    return watches


class NodeLink:
    """Node k's end of its control pipe to node 0: `hello` once connected, `failed` with the
    reason when it cannot bring its cores up."""

    def __init__(self, store: Any, node: int) -> None:
        addr = json.loads(store.get(CONTROL_KEY.format(node)))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 2000)  # what it said reaches node 0 before it exits
        self.link = attach([(self.sock, addr)], bind=False)
        self._send([HELLO, {"pid": os.getpid(), "host": socket.gethostname()}])
        # ZMQ connects in the background: until the handshake is done, node 0 could not tell
        # this node's death from slowness (it would wait out its ready timeout); so no core
        # starts before it (a node killed right after starting its cores, under load, did that)
        if self.link is not None and not self.link.wait_up(JOIN_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"node {node} could not connect to node 0's control pipe at "
                               f"{addr} within {JOIN_TIMEOUT_S:.0f} s")  # fmt: skip

    def report(self, reason: str) -> None:
        self._send([FAILED, reason])

    def _send(self, msg: list) -> None:
        try:
            self.sock.send(msgpack.packb(msg, use_bin_type=True), zmq.NOBLOCK)
        except zmq.ZMQError:  # node 0 gone (a full queue): nobody to tell
            pass

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.sock.close()
        self.ctx.term()  # waits up to the linger for what is queued


def _reason(e: BaseException) -> str:
    if isinstance(e, ValueError):  # a flag or a model this node cannot take: its message
        return str(e)
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return f"{type(e).__name__}: {e}"


def run_node(config: EngineConfig, log_level: str) -> int:
    """Node k > 0: join node 0 (first thing), resolve the model, start this node's cores on the
    pipes node 0 published, wait for them; 1 if one failed. A failure to start is reported to
    node 0 before it is raised. SIGTERM stops the cores (node 0's server then ends: a rank
    left)."""
    from swaserve.distributed.parallel_state import open_store

    host, port = rendezvous_address(config)
    store = open_store(host, port, config.data_parallel_size, is_master=False)  # waits for node 0
    link = NodeLink(store, config.node_rank)
    try:
        return _run_cores(config, store, link, log_level)
    except BaseException as e:
        link.report(_reason(e))
        raise
    finally:
        link.close()


def _run_cores(config: EngineConfig, store: Any, link: NodeLink, log_level: str) -> int:
    from swaserve.engine.engine import resolve_folder
    from swaserve.server.launch import _exit_reason, replica_config, start_core

    folder = resolve_folder(config.model)  # GGUF conversion happens here, once
    host, port = rendezvous_address(config)
    size = config.data_parallel_size
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
    # Polled, not waited on in turn: node 0 hears of a core that failed as soon as it is gone
    # (one that never connected its pipes is known to node 0 only from here).
    failed, running = 0, dict(procs)
    while running:
        time.sleep(NODE_POLL_S)
        for rank, p in list(running.items()):
            code = p.poll()
            if code is None:
                continue
            del running[rank]
            if code:
                why = f"dp rank {rank}'s engine core process {p.pid} {_exit_reason(code)}"
                log.error("%s", why)
                link.report(why)
                failed = 1
    return failed
