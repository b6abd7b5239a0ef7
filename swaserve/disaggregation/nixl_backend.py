"""The NIXL transfer backend: UCX one-sided writes (DRAM on CPU, VRAM on GPU) between pools.

NIXL calls used (package `nixl-cu13`, module `nixl_cu13`, v1.5.1):

    agent = nixl_agent(name, nixl_agent_config(backends=[]))   # no UCX yet: we pass params
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})   # else "none"
    agent.register_memory(kv)                 # the whole pool tensor, one region
    agent.get_agent_metadata() -> bytes       # goes inside our msgpack descriptor
    agent.add_remote_agent(metadata) -> name  # connect
    agent.initialize_xfer("WRITE", local_descs, remote_descs, peer, notif)  # Nx3 numpy
    agent.transfer(h) / agent.check_xfer_state(h) -> "DONE" | "PROC" | "ERR"
    agent.send_notif(peer, msg)               # a write of no pages
    agent.get_new_notifs() -> {sender: [bytes]}

Descriptors are built per write from the page runs (transfer.segments): a run of consecutive
pages is one segment per plane, so the descriptor count follows the transfer, not the pool.
On one host UCX moves DRAM with cma (process_vm_writev) and talks over tcp on `lo`. With
"peer" error handling (the default) a write to a peer that died fails at once with
NIXL_ERR_REMOTE_DISCONNECT, connected before or not. Shared-memory-only transports
(UCX_TLS=sm,self) refuse "peer" (create_backend raises NIXL_ERR_BACKEND): we fall back to
"none", where a dead peer was still seen at once (measured). A write still in progress at its
timeout is "failed".

VRAM (a pool on CUDA): UCX's cuda_ipc transport writes into the peer's pool with the GPU's
copy engines (a CUDA IPC handle of the peer's allocation, opened once; put only, which is all
a WRITE needs, so no NVLink is required). It loads from the wheel's own `nixl_cu13.libs/ucx`
(UCX 1.23 in nixl-cu13 1.5.1; seen found there on CPU, no UCX_MODULE_DIR needed) and needs
libcuda.so.1 and libnvidia-ml.so.1 on the loader path; without them UCX takes VRAM for host
memory and `register` fails (we say so). The pool, and so its CUDA context, exists before the
backend (build_side), as NIXL's own GPU tests do it: a UCX worker made before any CUDA context
may come up without its CUDA transports. Two agents in one process cannot use cuda_ipc (UCX:
"same process") nor cuda_copy (it reaches its own worker only): UCX would emulate the write
over tcp, so every VRAM test and benchmark puts the two sides in two processes, as served.

Notifications have no size limit of their own with UCX (an active message, rendezvous when
large): the completion notice, whose prompt logprobs grow with the prompt (0.4 MB for 4,000
tokens with the top 5 each, 1.3 MB with the top 20), goes whole with the write, after the
pages. Measured on CPU up to 20 MB, with pages and without, over tcp, cma and sm
(tests/unit/test_disagg_notices.py sends the 4,000-token ones between two processes). Other
NIXL backends may cap notifications (UCCL's plugin had 256 bytes); we create UCX only.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
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

DEFAULT_TIMEOUT_S = 30.0
MODULES = ("nixl_cu13", "nixl_cu12", "nixl")  # the CUDA-13 wheel first, then the others


def _import_nixl() -> Any:
    for module in MODULES:
        try:
            return __import__(module, fromlist=["nixl_agent"])
        except ImportError:
            continue
    raise RuntimeError(
        "the NIXL transfer backend needs the NIXL library: install the nixl-cu13 package "
        "after torch (pip install --no-deps nixl-cu13), or pick another "
        "--disaggregation-transfer-backend"
    )


@dataclass
class _Peer:
    agent: str  # its NIXL agent name (== our name for it)
    layout: PageLayout
    base: int  # address of its pool in its own process
    device_id: int


@dataclass
class _Write:
    xfer: Any | None  # nixl_xfer_handle, None once released or for a bare notification
    timeout_s: float
    deadline: float
    state: TransferState = "pending"
    error: str | None = None


class NixlBackend(TransferBackend):
    kind = "nixl"

    def __init__(
        self,
        name: str,
        ucx_error_handling_mode: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **_: Any,
    ) -> None:
        super().__init__(name)
        nixl = _import_nixl()
        self.timeout_s = timeout_s
        self.agent = nixl.nixl_agent(name, nixl.nixl_agent_config(backends=[]))
        # "peer" error handling where the transports allow it, else "none" (shared memory only)
        modes = [ucx_error_handling_mode] if ucx_error_handling_mode else ["peer", "none"]
        for i, mode in enumerate(modes):
            try:
                self.agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
            except Exception:
                if i == len(modes) - 1:
                    raise
            else:
                self.ucx_error_handling_mode = mode
                break
        self.layout: PageLayout | None = None
        self._kv: torch.Tensor | None = None  # kept alive while registered
        self._reg: Any | None = None
        self._mem_type = "DRAM"
        self._device_id = 0
        self._peers: dict[str, _Peer] = {}
        self._writes: dict[int, _Write] = {}
        self._ids = itertools.count(1)

    def register(self, kv: torch.Tensor, layout: GroupLayout | None = None) -> bytes:
        if self._reg is not None:
            raise RuntimeError("a pool is already registered with this backend")
        self.layout = PageLayout.of(kv, layout)
        self._mem_type = "VRAM" if kv.is_cuda else "DRAM"
        self._device_id = (kv.device.index or 0) if kv.is_cuda else 0
        try:
            self._reg = self.agent.register_memory(kv)
        except Exception as e:
            if not kv.is_cuda:
                raise
            raise RuntimeError(
                f"NIXL could not register the KV pool on {kv.device} ({type(e).__name__}: {e}):"
                " UCX's CUDA transports did not load; they need libcuda.so.1 and "
                "libnvidia-ml.so.1 on the loader path (UCX_LOG_LEVEL=debug names what failed)"
            ) from e
        self._kv = kv
        return encode_descriptor(
            self.kind,
            self.name,
            self.layout,
            metadata=self.agent.get_agent_metadata(),
            base=kv.data_ptr(),
            device_id=self._device_id,
            mem_type=self._mem_type,
        )

    def connect(self, peer: str, descriptor: bytes) -> None:
        body, peer_layout = decode_descriptor(descriptor, self.kind)
        if body["name"] != peer:
            raise ValueError(f"descriptor is from {body['name']!r}, not {peer!r}")
        if self.layout is None:
            raise RuntimeError("register the local pool before connecting to peers")
        self.layout.check_compatible(peer_layout)
        if body["mem_type"] != self._mem_type:  # UCX could, but our pools never mix
            raise ValueError(f"peer pool is in {body['mem_type']}, ours in {self._mem_type}")
        if peer in self._peers:  # a restarted peer: forget the old connection first
            self.agent.remove_remote_agent(self._peers.pop(peer).agent)
        agent = self.agent.add_remote_agent(body["metadata"])
        agent = agent.decode() if isinstance(agent, bytes) else agent
        if agent != peer:
            raise ValueError(f"NIXL agent metadata names {agent!r}, expected {peer!r}")
        self._peers[peer] = _Peer(agent, peer_layout, body["base"], body["device_id"])

    def write_pages(
        self,
        peer: str,
        src_pages: list[int],
        dst_pages: list[int],
        notify: bytes,
        timeout_s: float | None = None,
    ) -> int:
        p = self._peers.get(peer)
        if p is None:
            raise KeyError(f"not connected to {peer!r}")
        assert self.layout is not None and self._kv is not None
        segs = segments(self.layout, p.layout, src_pages, dst_pages)
        handle = next(self._ids)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        w = _Write(None, timeout, time.monotonic() + timeout)
        self._writes[handle] = w
        try:
            if len(segs) == 0:
                self.agent.send_notif(p.agent, bytes(notify))
                w.state = "done"
                return handle
            local = np.empty_like(segs)
            local[:, 0] = segs[:, 0] + np.uint64(self._kv.data_ptr())
            local[:, 1], local[:, 2] = segs[:, 2], self._device_id
            remote = np.empty_like(segs)
            remote[:, 0] = segs[:, 1] + np.uint64(p.base)
            remote[:, 1], remote[:, 2] = segs[:, 2], p.device_id
            w.xfer = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs(local, self._mem_type),
                self.agent.get_xfer_descs(remote, self._mem_type),
                p.agent,
                bytes(notify),
            )
            self._settle(w, self.agent.transfer(w.xfer))
        except Exception as e:  # NIXL raises e.g. nixlRemoteDisconnectError for a dead peer
            self._fail(w, f"write to {peer!r} failed: {type(e).__name__}: {e}")
        return handle

    def poll(self, handle: int) -> TransferState:
        w = self._writes[handle]
        if w.state == "pending":
            try:
                self._settle(w, self.agent.check_xfer_state(w.xfer))
            except Exception as e:
                self._fail(w, f"{type(e).__name__}: {e}")
            if w.state == "pending" and time.monotonic() > w.deadline:
                self._fail(w, f"timed out after {w.timeout_s:g} s")
        return w.state

    def error(self, handle: int) -> str | None:
        return self._writes[handle].error

    def release(self, handle: int) -> None:
        if self._writes[handle].state == "pending":
            raise ValueError(f"write {handle} is still pending")
        del self._writes[handle]

    def notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for sender, msgs in self.agent.get_new_notifs().items():
            sender = sender.decode() if isinstance(sender, bytes) else sender
            out.extend((sender, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        for w in self._writes.values():
            if w.state == "pending":
                self._fail(w, "backend closed")
        for p in self._peers.values():
            try:
                self.agent.remove_remote_agent(p.agent)
            except Exception:
                pass  # a peer that is gone already
        self._peers.clear()
        if self._reg is not None:
            self.agent.deregister_memory(self._reg)
            self._reg, self._kv = None, None

    # ---- helpers ---------------------------------------------------------------------------

    def _settle(self, w: _Write, status: str) -> None:
        if status == "DONE":
            w.state = "done"
            self._release(w)
        elif status == "ERR":
            self._fail(w, "NIXL reported a transfer error")

    def _fail(self, w: _Write, why: str) -> None:
        w.state, w.error = "failed", why
        self._release(w)

    def _release(self, w: _Write) -> None:
        if w.xfer is not None:
            xfer, w.xfer = w.xfer, None
            try:
                xfer.release()  # aborts an active transfer where UCX can
            except Exception:
                pass  # not abortable: the handle's finaliser keeps it for the agent to free
