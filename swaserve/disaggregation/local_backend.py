"""An in-process transfer backend: the reference behaviour of `TransferBackend`.

Backends that share a `LocalFabric` (the stand-in for the network) see each other's
registered pools. A write copies the same byte segments the NIXL backend hands to UCX
(transfer.segments), synchronously, then appends the notification to the peer's inbox: so it
checks the segment arithmetic without NIXL, and a protocol layer can be tested in one process.
A peer that has closed makes the write "failed".
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from swaserve.disaggregation.transfer import (
    PageLayout,
    TransferBackend,
    TransferState,
    decode_descriptor,
    encode_descriptor,
    segments,
)
from swaserve.memory.groups import GroupLayout


class LocalFabric:
    """Registered backends by name: what a write can reach."""

    def __init__(self) -> None:
        self.backends: dict[str, LocalBackend] = {}


DEFAULT_FABRIC = LocalFabric()


class LocalBackend(TransferBackend):
    kind = "local"

    def __init__(self, name: str, fabric: LocalFabric | None = None, **_: Any) -> None:
        super().__init__(name)
        self.fabric = DEFAULT_FABRIC if fabric is None else fabric
        if name in self.fabric.backends:
            raise ValueError(f"a local transfer backend named {name!r} already exists")
        self.fabric.backends[name] = self
        self.layout: PageLayout | None = None
        self._bytes: torch.Tensor | None = None  # the pool as flat bytes
        self._peers: dict[str, PageLayout] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._states: dict[int, tuple[TransferState, str | None]] = {}
        self._ids = itertools.count(1)

    def register(self, kv: torch.Tensor, layout: GroupLayout | None = None) -> bytes:
        self.layout = PageLayout.of(kv, layout)
        self._bytes = kv.view(-1).view(torch.uint8)
        return encode_descriptor(self.kind, self.name, self.layout)

    def connect(self, peer: str, descriptor: bytes) -> None:
        body, peer_layout = decode_descriptor(descriptor, self.kind)
        if body["name"] != peer:
            raise ValueError(f"descriptor is from {body['name']!r}, not {peer!r}")
        if self.layout is None:
            raise RuntimeError("register the local pool before connecting to peers")
        self.layout.check_compatible(peer_layout)
        self._peers[peer] = peer_layout

    def write_pages(
        self,
        peer: str,
        src_pages: list[int],
        dst_pages: list[int],
        notify: bytes,
        timeout_s: float | None = None,
    ) -> int:
        if peer not in self._peers:
            raise KeyError(f"not connected to {peer!r}")
        assert self.layout is not None and self._bytes is not None
        segs = segments(self.layout, self._peers[peer], src_pages, dst_pages)
        handle = next(self._ids)
        target = self.fabric.backends.get(peer)
        if target is None or target._bytes is None:
            self._states[handle] = ("failed", f"peer {peer!r} has closed")
            return handle
        for s, d, n in segs.tolist():
            target._bytes[d : d + n].copy_(self._bytes[s : s + n])
        target._inbox.append((self.name, bytes(notify)))
        self._states[handle] = ("done", None)
        return handle

    def poll(self, handle: int) -> TransferState:
        return self._states[handle][0]

    def error(self, handle: int) -> str | None:
        return self._states[handle][1]

    def release(self, handle: int) -> None:
        del self._states[handle]  # local writes are never pending

    def notifications(self) -> list[tuple[str, bytes]]:
        out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        if self.fabric.backends.get(self.name) is self:
            del self.fabric.backends[self.name]
        self._bytes = None
        self._peers.clear()
