"""The bootstrap protocol between a prefill and a decode instance (DESIGN §9.3).

The router gives one request to both instances with one bootstrap id (HTTP headers below);
each instance's engine core binds a ZMQ PULL socket (its *bootstrap address*) for messages
from peers, and sends to a peer through a PUSH socket connected to that peer's address.
A request's key is `bootstrap id . prompt index . sample index` on both sides.

    decode                                    prefill
    admit, reserve pages  --- reserve --->    waits for it, then computes the prompt
                                              writes pages straight into the reservation
    continue, stream     <=== notice ====     (transfer backend: after the pages landed)
                         <--- failed ----     write failed / aborted / timed out (or an ack
                                              of a cancel)
    client gone          --- cancel --->      drops the request; acks with `failed`

Every message is a msgpack list whose first item is its kind (never pickle):

    ["reserve", key, decode_addr, decode_name, descriptor, tables, num_cached_tokens]
        tables: the decode side's page table per group (NULL below each SWA group's window)
    ["cancel", key]
    ["failed", key, message]

The completion notice travels as the transfer's notification (so it arrives after the pages):

    ["notice", key, output_wire, generator_state | None, num_pages, num_bytes]
        output_wire: the prefill side's first-token output (ipc.output_to_wire): the token,
        its logprob and top-logprob ids, prompt logprobs, the prefill side's cached tokens.
        generator_state: the seeded request's torch.Generator state after that token's draw.

A decode side never frees reserved pages while a write into them may still be in flight: on a
cancel it keeps them until the prefill side's `failed` (or notice) or the timeout.
"""

from __future__ import annotations

import socket
from typing import Any

import msgpack
import zmq

BOOTSTRAP_HEADER = "X-Swaserve-Bootstrap"  # the bootstrap id (router -> both instances)
PEER_HEADER = "X-Swaserve-Prefill"  # the prefill core's bootstrap address (router -> decode)

RESERVE, CANCEL, FAILED, NOTICE = "reserve", "cancel", "failed", "notice"


def encode(msg: list) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def request_key(bootstrap: str, index: int) -> str:
    """One sample's key: `bootstrap` already names the prompt (`id.prompt`)."""
    return f"{bootstrap}.{index}"


def advertised_host(host: str) -> str:
    """The address peers reach a socket bound on `host` by."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class Bootstrap:
    """This core's bootstrap sockets: one PULL bound for peers' messages, PUSH per peer."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.ctx = zmq.Context.instance()  # see local_backend.py: never a context of our own
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        bind = f"tcp://{host}"
        if port:
            self.inbox.bind(f"{bind}:{port}")
        else:
            port = self.inbox.bind_to_random_port(bind)
        self.address = f"tcp://{advertised_host(host)}:{port}"
        self._out: dict[str, zmq.Socket] = {}

    def send(self, address: str, msg: list) -> None:
        """Never blocks: a peer that is gone only leaves the message queued (timeouts act)."""
        sock = self._out.get(address)
        if sock is None:
            sock = self._out[address] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(address)
        sock.send(encode(msg), zmq.NOBLOCK)

    def receive(self) -> list[list[Any]]:
        out = []
        while True:
            try:
                out.append(decode(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def close(self) -> None:
        for sock in self._out.values():
            sock.close(linger=0)
        self.inbox.close(linger=0)
