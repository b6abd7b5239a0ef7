"""Whether the process at the other end of a TCP pipe is still there (`--nnodes`: an engine core
on another machine and node 0's frontend, each watching the other).

`attach` binds or connects a pipe's sockets; over TCP it sets up both watches, which run in
ZMQ's I/O thread, none in Python, so a core busy in a long forward still answers:

- a socket monitor: the connection's `DISCONNECTED` event. A process that exits or is killed
  (kill -9 included) has its sockets closed by its kernel, which tells the peer at once (FIN or
  RST): the event arrives within milliseconds.
- ZMTP heartbeats (HEARTBEAT_IVL_MS / HEARTBEAT_TIMEOUT_MS): a machine that dies, or a network
  that parts, sends nothing; when a PING has had no answer (no traffic at all) for
  HEARTBEAT_TIMEOUT_MS the connection is closed as broken, and the same event follows.

Both together are sufficient: a peer that exits, or cannot answer, is reported within
HEARTBEAT_TIMEOUT_MS. What they cannot see is a peer process alive but stuck in Python with
its ZMQ thread answering, which a local core can be too (neither is watched).

Only a connection that completed the ZMTP handshake counts: one that fails it (a port scan, a
stray client) reports HANDSHAKE_FAILED_* just before its DISCONNECTED, and is ignored. Every
socket watched has one legitimate peer, so the first other DISCONNECTED means that peer is gone
(ZMQ would reconnect after a network blip, but what was in flight may be lost: it is a loss).
"""

from __future__ import annotations

import itertools
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

HEARTBEAT_IVL_MS = 1000  # a PING each second on an idle connection
HEARTBEAT_TIMEOUT_MS = 5000  # no traffic this long after a PING: the connection is broken
_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_STRAY = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_DOWN = zmq.EVENT_DISCONNECTED
_ids = itertools.count()


class LinkWatch:
    """The connections of some sockets to one peer (set up before the peer connects).
    `lost()` is True, and stays so, once one that was up closed or broke."""

    def __init__(self, sockets: list[zmq.Socket]) -> None:
        self._monitors: list[tuple[zmq.Socket, zmq.Socket]] = []
        self._up = [False] * len(sockets)  # a handshake completed on socket i
        self._strays = [0] * len(sockets)  # failed handshakes whose DISCONNECTED is to come
        self._lost = False
        for sock in sockets:
            addr = f"inproc://swaserve-link-{next(_ids)}"
            sock.monitor(addr, _UP | _STRAY | _DOWN)
            mon = zmq.Socket(sock.context, zmq.PAIR)  # plain, even for an asyncio socket
            mon.connect(addr)
            self._monitors.append((sock, mon))

    def lost(self) -> bool:
        """Reads the events so far, never waits."""
        for i, (_, mon) in enumerate(self._monitors):
            while not self._lost:
                try:
                    event = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))["event"]
                except zmq.Again:
                    break
                if event & _UP:
                    self._up[i] = True
                elif event & _STRAY:
                    self._strays[i] += 1
                elif self._strays[i]:  # a stray connection's end
                    self._strays[i] -= 1
                elif self._up[i]:
                    self._lost = True
        return self._lost

    def wait_up(self, timeout: float) -> bool:
        """Until every socket's connection completed its handshake (True), or `timeout`
        seconds (False). The peer sees the connection, and so its loss, from then on."""
        deadline = time.monotonic() + timeout
        while not all(self._up):
            if self.lost() or time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Before the sockets' context terminates (a monitor left open would block it)."""
        for sock, mon in self._monitors:
            if not sock.closed:
                sock.disable_monitor()
            mon.close(linger=0)
        self._monitors = []


def attach(pipes: list[tuple[zmq.Socket, str]], bind: bool) -> LinkWatch | None:
    """Binds (node 0) or connects (the core) each socket to its address. Over TCP the sockets
    get heartbeats and a LinkWatch, both set up before any connection exists (so that none
    goes unseen), which is returned; None for IPC pipes (a core of this machine, whose
    process is watched instead)."""
    remote = all(addr.startswith("tcp://") for _, addr in pipes)
    link = LinkWatch([sock for sock, _ in pipes]) if remote else None
    for sock, addr in pipes:
        if remote:
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if bind:
            sock.bind(addr)
        else:
            sock.connect(addr)
    return link
