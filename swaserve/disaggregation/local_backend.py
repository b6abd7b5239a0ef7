"""The local transfer backend: the reference behaviour of `TransferBackend`, in one process or
between processes of one host (`--disaggregation-transfer-backend local`).

Backends that share a `LocalFabric` (the stand-in for the network) see each other's
registered pools. A write copies the same byte segments the NIXL backend hands to UCX
(transfer.segments), synchronously, then appends the notification to the peer's inbox: so it
checks the segment arithmetic without NIXL, and a protocol layer can be tested in one process.
A peer that has closed makes the write "failed".

A peer in another process (its descriptor names a pid that is not ours) is written the way
UCX's cma transport does it: `process_vm_writev` into the peer's pool at the address its
descriptor gives (same user, Linux, CPU pools only), then the notification goes to the peer's
ZMQ PULL socket on loopback (its address is in the descriptor too). A peer process that is
gone fails the write at once (ESRCH).
"""

from __future__ import annotations

import ctypes
import itertools
import os
from typing import Any

import numpy as np
import torch
import zmq

from swaserve.disaggregation.transfer import (
    PageLayout,
    TransferBackend,
    TransferState,
    decode_descriptor,
    encode_descriptor,
    segments,
)
from swaserve.memory.groups import GroupLayout

IOV_MAX = 1024  # iovecs per process_vm_writev call (Linux UIO_MAXIOV)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_writev: Any = None


def _process_vm_writev() -> Any:
    global _writev
    if _writev is None:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.process_vm_writev
        f.restype = ctypes.c_ssize_t
        iov = ctypes.POINTER(_IOVec)
        f.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
        _writev = f
    return _writev


def write_process_memory(pid: int, rows: np.ndarray) -> None:
    """Copy `[N, 3]` rows (local address, remote address, length) into process `pid`.
    Raises OSError (ESRCH: the process is gone; EPERM: not ours to write)."""
    f = _process_vm_writev()
    for start in range(0, len(rows), IOV_MAX):
        part = rows[start : start + IOV_MAX]
        k = len(part)
        local, remote = (_IOVec * k)(), (_IOVec * k)()
        for j, (src, dst, n) in enumerate(part.tolist()):
            local[j].iov_base, local[j].iov_len = src, n
            remote[j].iov_base, remote[j].iov_len = dst, n
        done = f(pid, local, k, remote, k, 0)
        if done < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_writev into pid {pid}: {os.strerror(err)}")
        if done != int(part[:, 2].sum()):
            raise OSError(f"process_vm_writev into pid {pid}: wrote {done} of "
                          f"{int(part[:, 2].sum())} bytes")


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
        # Peers in other processes: (pid, pool address, notification socket) by name.
        self._remote: dict[str, tuple[int, int, zmq.Socket]] = {}
        self._inbox_sock: zmq.Socket | None = None
        self._kv: torch.Tensor | None = None

    def register(self, kv: torch.Tensor, layout: GroupLayout | None = None) -> bytes:
        self.layout = PageLayout.of(kv, layout)
        self._kv = kv
        self._bytes = kv.view(-1).view(torch.uint8)
        # Notifications from peers in other processes arrive here (loopback only).
        # The process-wide context: a context of our own could be collected before its
        # sockets, and its term() would wait for them forever.
        self._inbox_sock = zmq.Context.instance().socket(zmq.PULL)
        self._inbox_sock.setsockopt(zmq.LINGER, 0)
        port = self._inbox_sock.bind_to_random_port("tcp://127.0.0.1")
        return encode_descriptor(
            self.kind, self.name, self.layout, pid=os.getpid(), base=kv.data_ptr(),
            cuda=kv.is_cuda, notify=f"tcp://127.0.0.1:{port}",
        )

    def connect(self, peer: str, descriptor: bytes) -> None:
        body, peer_layout = decode_descriptor(descriptor, self.kind)
        if body["name"] != peer:
            raise ValueError(f"descriptor is from {body['name']!r}, not {peer!r}")
        if self.layout is None:
            raise RuntimeError("register the local pool before connecting to peers")
        self.layout.check_compatible(peer_layout)
        self._peers[peer] = peer_layout
        old = self._remote.pop(peer, None)
        if old is not None:
            old[2].close(linger=0)
        if body.get("pid", os.getpid()) != os.getpid():
            assert self._kv is not None
            if body["cuda"] or self._kv.is_cuda:
                raise ValueError(
                    "the local transfer backend moves CPU pools between processes only; use "
                    "--disaggregation-transfer-backend nixl for GPU pools"
                )
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(body["notify"])
            self._remote[peer] = (int(body["pid"]), int(body["base"]), sock)

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
        if peer in self._remote:
            self._states[handle] = self._write_remote(peer, segs, notify)
            return handle
        target = self.fabric.backends.get(peer)
        if target is None or target._bytes is None:
            self._states[handle] = ("failed", f"peer {peer!r} has closed")
            return handle
        for s, d, n in segs.tolist():
            target._bytes[d : d + n].copy_(self._bytes[s : s + n])
        target._inbox.append((self.name, bytes(notify)))
        self._states[handle] = ("done", None)
        return handle

    def _write_remote(
        self, peer: str, segs: np.ndarray, notify: bytes
    ) -> tuple[TransferState, str | None]:
        assert self._kv is not None
        pid, base, sock = self._remote[peer]
        rows = segs.copy()
        rows[:, 0] += np.uint64(self._kv.data_ptr())
        rows[:, 1] += np.uint64(base)
        try:
            if len(rows):
                write_process_memory(pid, rows)
            else:
                os.kill(pid, 0)  # no pages: the notice alone, to a live process
        except ProcessLookupError:
            return "failed", f"write to {peer!r} failed: process {pid} is gone"
        except OSError as e:
            return "failed", f"write to {peer!r} failed: {e}"
        sock.send_multipart([self.name.encode(), bytes(notify)])
        return "done", None

    def poll(self, handle: int) -> TransferState:
        return self._states[handle][0]

    def error(self, handle: int) -> str | None:
        return self._states[handle][1]

    def release(self, handle: int) -> None:
        del self._states[handle]  # local writes are never pending

    def notifications(self) -> list[tuple[str, bytes]]:
        out, self._inbox = self._inbox, []
        while self._inbox_sock is not None:
            try:
                sender, msg = self._inbox_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            out.append((sender.decode(), msg))
        return out

    def close(self) -> None:
        if self.fabric.backends.get(self.name) is self:
            del self.fabric.backends[self.name]
        self._bytes = self._kv = None
        self._peers.clear()
        for _, _, sock in self._remote.values():
            sock.close(linger=0)
        self._remote.clear()
        if self._inbox_sock is not None:
            self._inbox_sock.close(linger=0)
            self._inbox_sock = None
