"""The liveness of a TCP pipe between node 0 and a core on another node (server/link_watch.py),
with real sockets and a real peer process: a peer killed (-9) is a lost link at once, a peer
that stops answering (SIGSTOP: a machine gone, as far as the network can tell) once the
heartbeat times out, a stray TCP connection is not a loss; from the core's side, node 0 gone is
a lost link of its CorePipes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import zmq

from swaserve.server import link_watch
from swaserve.server.core_process import CorePipes
from swaserve.server.ipc import CoreClient

# The peer: connects to node 0's pipes as a core does (plain zmq, no torch: starts fast), sends
# one message on the out pipe, then waits to be killed.
PEER = """
import sys, time, zmq
ctx = zmq.Context()
inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
inp.connect(sys.argv[1]); out.connect(sys.argv[2])
out.send(b"up")
time.sleep(120)
"""


def _wait_lost(is_lost, seconds: float) -> float:
    """Seconds until `is_lost()` (fails after `seconds`)."""
    t0 = time.monotonic()
    while not is_lost():
        assert time.monotonic() - t0 < seconds, "the link was not found lost"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.fixture
def node0(monkeypatch):
    """A CoreClient with TCP pipes (node 0's side of a remote core) and its connected peer."""
    monkeypatch.setattr(link_watch, "HEARTBEAT_TIMEOUT_MS", 1000)  # SIGSTOP: found in ~1-2 s
    client = CoreClient(None, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", max_queue=4)
    peer = subprocess.Popen([sys.executable, "-c", PEER, *client.endpoints()])
    try:
        recv = zmq.Socket.shadow(client._recv.underlying)  # a plain view of the asyncio socket
        assert recv.poll(30_000), "the peer did not connect"  # its handshake is done
        assert recv.recv(zmq.NOBLOCK) == b"up"
        yield client, peer
    finally:
        peer.kill()
        peer.wait()
        client.close()


def _stray_connections(endpoint: str) -> None:
    """A port scan and a stray HTTP client on a pipe's port."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))):
        pass
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    time.sleep(0.3)


def test_a_killed_peer_is_a_lost_link_at_once(node0):
    client, peer = node0
    _stray_connections(client.endpoints()[1])
    assert not client.link_lost()  # strays and a live peer: no loss
    os.kill(peer.pid, signal.SIGKILL)
    assert _wait_lost(client.link_lost, 5) < 1.0  # its kernel closed the connections
    assert client.link_lost()  # and stays lost


def test_a_peer_that_stops_answering_is_lost_after_the_heartbeat_timeout(node0):
    client, peer = node0
    os.kill(peer.pid, signal.SIGSTOP)  # connections open, nothing answers
    try:
        took = _wait_lost(client.link_lost, 10)
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    assert 0.9 < took < 5, took  # the timeout (1 s) after a PING, not the kill's milliseconds


def test_the_core_sees_node_0_go():
    """CorePipes (a remote core's side) against a node 0 process that is then killed."""
    node0 = subprocess.Popen(
        [sys.executable, "-c", """
import sys, zmq
ctx = zmq.Context()
a, b = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
a.bind("tcp://127.0.0.1:*"); b.bind("tcp://127.0.0.1:*")
print(a.getsockopt_string(zmq.LAST_ENDPOINT), b.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
b.recv()
sys.stdin.read()
"""],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        in_addr, out_addr = node0.stdout.readline().split()
        pipes = CorePipes(in_addr, out_addr)
        pipes.out.send(b"ready")
        time.sleep(0.5)  # node 0 got it: the links are up
        assert not pipes.link_lost()
        node0.kill()
        _wait_lost(pipes.link_lost, 5)
        pipes.link.close()
        pipes.ctx.destroy(linger=0)
    finally:
        node0.kill()
        node0.wait()


def test_ipc_pipes_are_not_watched(tmp_path):
    client = CoreClient(None, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", max_queue=4)
    try:
        assert client.link is None and not client.link_lost()
    finally:
        client.close()


def test_wait_up_until_the_handshake():
    """A connecting side can wait for its connection (node k before it starts its cores):
    True once node 0's socket took it, False when nothing listens."""
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        link = link_watch.attach([(push, f"tcp://127.0.0.1:{port}")], bind=False)
        assert link.wait_up(10.0) and not link.lost()
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = s.getsockname()[1]
        lonely = ctx.socket(zmq.PUSH)
        link2 = link_watch.attach([(lonely, f"tcp://127.0.0.1:{dead}")], bind=False)
        t0 = time.monotonic()
        assert not link2.wait_up(0.3) and time.monotonic() - t0 < 2.0
        for lk in (link, link2):
            lk.close()
        for sock in (pull, push, lonely):
            sock.close(linger=0)
    finally:
        ctx.term()
