"""Data-parallel ranks over nodes (plain replicas or expert-parallel ranks), without
processes: which flags are taken, which ranks a node runs, how a failed collective is named
when the dead peer is on this node (its pid) or on another (a remote rank, whose pid means
nothing here), the pipes node 0 binds and publishes for a remote core, and the control pipe
over which node 0 hears of a node failing at start. The two-node servers themselves:
tests/e2e/test_two_node_dp_server.py and test_two_node_ep_server.py (slow); a lost link:
tests/unit/test_link_watch.py; a node failing at start: tests/e2e/test_two_node_startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from swaserve.config import EngineConfig
from swaserve.distributed.ep_launch import PidWatch
from swaserve.server.ipc import CoreClient
from swaserve.server.nodes import (
    IPC_KEY,
    NodeLink,
    local_ranks,
    publish_pipes,
    remote_pipes,
    watch_nodes,
)


def _ep(**kw) -> EngineConfig:
    return EngineConfig(model="x", data_parallel_size=4, enable_expert_parallel=True, **kw)


def test_replicas_spread_over_nodes_that_divide_them():
    two = dict(nnodes=2, dist_init_addr="127.0.0.1:1234")
    EngineConfig(data_parallel_size=2, **two)
    EngineConfig(data_parallel_size=4, tensor_parallel_size=2, node_rank=1, **two)
    with pytest.raises(ValueError, match=r"^invalid --nnodes 2 \(nnodes\): must be >= 1 and "
                       r"divide --data-parallel-size \(3\)"):  # fmt: skip
        EngineConfig(data_parallel_size=3, **two)
    # without -dp the tensor-parallel ranks spread: they must divide
    with pytest.raises(ValueError, match=r"divide --tensor-parallel-size \(1\)"):
        EngineConfig(**two)


def test_local_ranks():
    assert local_ranks(_ep()) == range(4)
    two = dict(nnodes=2, dist_init_addr="127.0.0.1:1")
    assert local_ranks(_ep(**two)) == range(0, 2)
    assert local_ranks(_ep(**two, node_rank=1)) == range(2, 4)
    assert local_ranks(EngineConfig(model="x", data_parallel_size=3)) == range(3)
    # plain replicas: the same split, each replica's -tp processes on its node
    plain = dict(model="x", data_parallel_size=4, tensor_parallel_size=2, **two)
    assert local_ranks(EngineConfig(**plain)) == range(0, 2)
    assert local_ranks(EngineConfig(**plain, node_rank=1)) == range(2, 4)
    # tensor parallelism over nodes: node 0 runs the one core, node 1 its workers only
    tp = dict(model="x", tensor_parallel_size=2, **two)
    assert local_ranks(EngineConfig(**tp)) == range(1)
    assert local_ranks(EngineConfig(**tp, node_rank=1)) == range(0)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no such process (until the pid is reused)


def test_pid_watch_names_a_local_peer_by_pid_and_remote_ranks_as_such():
    me, dead = os.getpid(), _dead_pid()
    # rank 1 (this node) died: named by its pid, even with ranks on another node
    watch = PidWatch({0: (0, me), 1: (0, dead), 2: (1, me), 3: (1, me)}, 0)
    assert (watch.peers, watch.remote) == ({1: dead}, [2, 3])
    with pytest.raises(RuntimeError, match=rf"data-parallel rank 1 \(pid {dead}\) is gone"):
        raise watch.explain()
    assert watch.explain().dp_rank == 1
    # with -tp 2: world rank 3 is data-parallel rank 1's worker
    failure = PidWatch({0: (0, me), 1: (0, me), 2: (0, me), 3: (0, dead)}, 0, tp_size=2).explain()
    assert "data-parallel rank 1, tensor-parallel rank 1" in str(failure)
    assert failure.dp_rank == 1
    # every peer here lives: the ranks on the other node are the failure; a remote rank's pid
    # (dead here) is never looked up on this machine
    watch = PidWatch({0: (1, me), 1: (1, me), 2: (0, dead), 3: (0, me)}, 1)
    failure = watch.explain()
    assert "data-parallel ranks 2-3 on other nodes failed" in str(failure)
    assert "expert-parallel group cannot continue" in str(failure)
    # one node: nothing to blame (the error is not a rank's death)
    assert PidWatch({0: (0, me), 1: (0, me)}, 0).explain() is None


def test_the_server_names_the_blamed_cores_own_last_words():
    """Rank 1's worker killed: rank 1's core says how (its child), rank 0's core only that rank
    1 is gone. Whatever order their words arrive in, the server gives rank 1's; a core that
    blames a rank still running (or itself) keeps its place."""
    from types import SimpleNamespace

    from swaserve.server.launch import _first_gone

    running = SimpleNamespace(poll=lambda: None, pid=1)
    procs = [running, running, running]

    def core(dead=None, blames=None):
        return SimpleNamespace(dead=dead, blames=blames, link_lost=lambda: False)

    own = "RankFailure: tensor-parallel rank 1 (pid 9) was killed by SIGKILL"
    follows = "RankFailure: data-parallel rank 1 (pid 8) is gone"
    assert _first_gone(procs, [core(follows, 1), core(own), core()]) == (1, own)
    assert _first_gone(procs, [core(follows, 1), core(), core()]) == (0, follows)
    assert _first_gone(procs, [core("x", 0), core("y", 2), core()]) == (0, "x")
    # a core gone without last words (killed) still comes first
    killed = SimpleNamespace(poll=lambda: -9, pid=7)
    got = _first_gone([running, running, killed], [core(follows, 1), core(own), core()])
    assert got[0] == 2 and "7" in got[1]


def test_node0_publishes_bound_tcp_pipes():
    cfg = _ep(nnodes=2, dist_init_addr="localhost:29500")
    pipes = remote_pipes(cfg)
    assert pipes == ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    client = CoreClient(None, *pipes, max_queue=4)
    store = dist.HashStore()
    try:
        assert client.link is not None and not client.link_lost()  # watched, nobody came yet
        bound = client.endpoints()
        assert all(e.startswith("tcp://127.0.0.1:") and not e.endswith(":*") for e in bound)
        publish_pipes(store, 3, bound)
        assert json.loads(store.get(IPC_KEY.format(3))) == list(bound)
    finally:
        client.close()


@pytest.mark.parametrize("expert", [True, False])
def test_offline_engine_refuses_nodes(expert):
    """The offline Engine runs its ranks here: over nodes it is refused before any starts."""
    from swaserve import Engine

    with pytest.raises(ValueError, match=r"--nnodes 2 with --data-parallel-size 2 is for "
                       r"`swaserve serve`"):  # fmt: skip
        Engine(model="gemma-3-270m", load_format="dummy", device="cpu", data_parallel_size=2,
               enable_expert_parallel=expert, nnodes=2, dist_init_addr="127.0.0.1:1")  # fmt: skip


def test_node_0_hears_a_node_fail_at_start():
    """Node k's control pipe (NodeLink) to node 0's NodeWatch: `hello` makes it joined, a
    reported failure is node 0's reason (the first one, final); a node that closes the pipe
    without a word is a failure too."""
    cfg = _ep(nnodes=2, dist_init_addr="127.0.0.1:29500")
    store = dist.HashStore()
    (watch,) = watch_nodes(cfg, store)
    try:
        assert watch.name == "node 1 (dp ranks 2-3)" and watch.num_ranks == 2
        link = NodeLink(store, 1)
        _until(lambda: watch.failure() is None and watch.joined)
        link.report("unknown model 'M'")
        link.report("dp rank 2's engine core process 9 exited with status 1")
        assert _until(watch.failure) == "unknown model 'M'"
        link.close()  # and then it is gone: what it said stays the reason
        time.sleep(0.3)
        assert watch.failure() == "unknown model 'M'"
    finally:
        watch.close()
    (watch,) = watch_nodes(cfg, store)
    try:
        link = NodeLink(store, 1)
        _until(lambda: watch.joined or watch.failure())
        link.close()
        assert _until(watch.failure).startswith("node 1 closed its connection")
    finally:
        watch.close()


def test_one_node_has_no_node_watch():
    store = dist.HashStore()
    assert watch_nodes(_ep(), store) == []
    assert watch_nodes(EngineConfig(model="x", tensor_parallel_size=2, nnodes=2,
                                    dist_init_addr="127.0.0.1:1"), store) == []  # fmt: skip


def _until(what, seconds: float = 5.0):
    """`what()` once truthy (fails after `seconds`)."""
    deadline = time.monotonic() + seconds
    while not (found := what()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return found


def test_node_that_never_joins_is_named_while_waiting_and_at_the_timeout(caplog):
    """Node 0's wait for a node that never starts (nobody connects to its control pipe or to
    its cores' pipes): every `every` seconds the log names what it waits for, and at
    --startup-timeout the start fails naming the node (the default is 900 s; a short one here)."""
    import asyncio
    import logging

    from swaserve.server.launch import _wait_ready

    cfg = _ep(nnodes=2, dist_init_addr="localhost:29500")
    clients = [CoreClient(None, *remote_pipes(cfg), max_queue=4) for _ in range(2)]
    (watch,) = watch_nodes(cfg, dist.HashStore())
    caplog.set_level(logging.INFO, logger="swaserve.server")
    t = time.monotonic()
    try:
        ok = asyncio.run(_wait_ready([], clients, [watch], timeout=1.0, every=0.3))
    finally:
        watch.close()
        for c in clients:
            c.close()
    assert not ok and 1.0 <= time.monotonic() - t < 5.0
    waiting = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(waiting) >= 2
    assert all("never joined: node 1 (dp ranks 2-3)" in m for m in waiting), waiting
    (err,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "not ready after 1 s (--startup-timeout)" in err
    assert "dp ranks 0, 1" in err and "never joined: node 1 (dp ranks 2-3)" in err


def test_startup_timeout_flag_checked(capsys):
    from swaserve.cli import main

    assert main(["serve", "--model", "x", "--startup-timeout", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --startup-timeout must be > 0"
