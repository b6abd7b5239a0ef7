"""The transfer-backend interface: one-sided writes of whole KV pages between two pools
(DESIGN §9.3, the worker face of the connector, STYLE 15).

A page id names the same thing on both sides: K and V of `page_size` tokens for every layer
slot. The unified pool is page-major, `pages[page, slot, k|v, offset, head, dim]`
(memory/kv_pool.py): page p is one contiguous block of `page_bytes` at `p * page_bytes`. A
backend registers the whole pool tensor (`KVPool.pages`) once and moves byte segments, one per
run of pages consecutive on both sides:

    src pages [3, 4, 5, 9] -> dst pages [7, 8, 9, 2]: runs (3->7, len 3), (9->2, len 1)
    segments: (3 * page_bytes, 7 * page_bytes, 3 * page_bytes), (9 * .., 2 * .., 1 * ..)

(The earlier plane-major pool made 2 x slots_per_page segments of every run; scattered pages
through NIXL on the H200 went at 6-9 GB/s, ~8 us a segment: benchmarks/RESULTS.md, stop 19.)

Both pools share everything but `num_pages` (a decode pool may be larger than a prefill
pool); `connect` refuses a peer whose page layout differs (`LayoutMismatchError`).

Peers are named by their backend's `name`, everywhere: `connect(name, descriptor)` checks the
descriptor carries that name, and a notification reports the sender's name. A write of no
pages still delivers its notification (a decode side whose prefix cache held the whole prompt
still needs the completion notice). A notification arrives after the pages it announces,
which may be after the writer's `poll` said "done": the receiver polls `notifications`.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import asdict, dataclass
from typing import Any, Literal

import msgpack
import numpy as np
import torch

from swaserve.memory.groups import GroupLayout
from swaserve.memory.pool import NULL_PAGE

DESCRIPTOR_VERSION = 2  # 2: page-major pools (1 was plane-major)
TransferState = Literal["pending", "done", "failed"]


class LayoutMismatchError(ValueError):
    """Two pools whose pages do not mean the same bytes."""


@dataclass(frozen=True)
class PageLayout:
    """What a page id means in a pool; `num_pages` is the only field peers may differ in."""

    slots_per_page: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "bfloat16"
    groups: tuple[tuple[str, int | None, tuple[int, ...]], ...] | None  # (kind, window, layers)

    @classmethod
    def of(cls, kv: torch.Tensor, layout: GroupLayout | None = None) -> PageLayout:
        """The layout of a page-major pool tensor (`KVPool.pages`)."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            raise ValueError(
                f"a KV pool is [pages, slots, 2, page_size, heads, dim], got {tuple(kv.shape)}"
            )
        if not kv.is_contiguous():
            raise ValueError("a KV pool tensor must be contiguous to be registered")
        groups = None
        if layout is not None:
            if layout.slots_per_page != kv.shape[1]:
                raise ValueError(
                    f"layout has {layout.slots_per_page} slots per page, the pool "
                    f"tensor {kv.shape[1]}"
                )
            groups = tuple((g.kind, g.window, tuple(g.layers)) for g in layout.groups)
        pages, slots, _, page_size, heads, dim = kv.shape
        return cls(
            slots, pages, page_size, heads, dim, str(kv.dtype).removeprefix("torch."), groups
        )

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()

    @property
    def page_bytes(self) -> int:
        """One whole page id (memory/manager.py `page_bytes`): the unit of every segment."""
        return 2 * self.slots_per_page * self.page_size * self.kv_heads * self.head_dim * (
            self.itemsize
        )

    def check_compatible(self, peer: PageLayout) -> None:
        """Raise LayoutMismatchError naming every field (but num_pages) that differs."""
        mine, theirs = asdict(self), asdict(peer)
        diffs = [
            f"{k}: local {mine[k]!r}, peer {theirs[k]!r}"
            for k in mine
            if k != "num_pages"
            and mine[k] != theirs[k]
            and not (k == "groups" and None in (mine[k], theirs[k]))
        ]
        if diffs:
            raise LayoutMismatchError(
                "KV pools differ in page layout, refusing to connect: " + "; ".join(diffs)
            )


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page lists go up by one, in order."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def check_pages(src: list[int], dst: list[int], src_pages: int, dst_pages: int) -> None:
    """A write's page lists: equal lengths, real pages in range, no dst page written twice."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages but {len(dst)} destination pages")
    for name, pages, n in (("source", src, src_pages), ("destination", dst, dst_pages)):
        bad = [p for p in pages if not NULL_PAGE < p < n]
        if bad:
            raise ValueError(f"{name} pages out of range 1..{n - 1} (0 is NULL): {bad[:8]}")
    if len(set(dst)) != len(dst):
        raise ValueError("a destination page appears twice in one write")


def segments(
    src_layout: PageLayout, dst_layout: PageLayout, src: list[int], dst: list[int]
) -> np.ndarray:
    """`[N, 3]` uint64 rows (src byte offset, dst byte offset, length), one per run of pages
    consecutive on both sides, in order; offsets from each pool's base."""
    check_pages(src, dst, src_layout.num_pages, dst_layout.num_pages)
    runs = np.array(page_runs(src, dst), dtype=np.uint64).reshape(-1, 3)
    return runs * np.uint64(src_layout.page_bytes)


def encode_descriptor(backend: str, name: str, layout: PageLayout, **extra: Any) -> bytes:
    """What `register` hands to the peer: msgpack, never pickle."""
    body = {
        "version": DESCRIPTOR_VERSION,
        "backend": backend,
        "name": name,
        "layout": asdict(layout),
        **extra,
    }
    return msgpack.packb(body, use_bin_type=True)


def decode_descriptor(data: bytes, backend: str) -> tuple[dict[str, Any], PageLayout]:
    body = msgpack.unpackb(data, raw=False)
    if body.get("version") != DESCRIPTOR_VERSION:
        raise ValueError(
            f"descriptor version {body.get('version')!r}, expected {DESCRIPTOR_VERSION}"
        )
    if body.get("backend") != backend:
        raise ValueError(f"descriptor from a {body.get('backend')!r} backend, this is {backend!r}")
    raw = body["layout"]
    groups = raw["groups"]
    if groups is not None:
        groups = tuple((k, w, tuple(layers)) for k, w, layers in groups)
    return body, PageLayout(**{**raw, "groups": groups})


class TransferBackend(abc.ABC):
    """Moves whole KV pages into a peer's pool, one-sided, with a completion notification.

    Life cycle: `register` the local pool once (its descriptor goes to peers out of band),
    `connect` each peer from its descriptor, then `write_pages` and `poll` until "done" or
    "failed"; the receiving side reads `notifications`. A dead or silent peer makes `poll`
    answer "failed" (at the latest after the write's timeout), never hang."""

    kind: str  # the registry name, also written into descriptors

    def __init__(self, name: str) -> None:
        self.name = name

    @abc.abstractmethod
    def register(self, kv: torch.Tensor, layout: GroupLayout | None = None) -> bytes:
        """Register the local pool tensor; returns this side's descriptor for peers."""

    @abc.abstractmethod
    def connect(self, peer: str, descriptor: bytes) -> None:
        """Make `peer` writable. Raises LayoutMismatchError if its pages differ from ours."""

    @abc.abstractmethod
    def write_pages(
        self,
        peer: str,
        src_pages: list[int],
        dst_pages: list[int],
        notify: bytes,
        timeout_s: float | None = None,
    ) -> int:
        """Start writing local pages `src_pages[i]` into the peer's `dst_pages[i]` (every slot,
        K and V); `notify` reaches the peer once all of them have landed. Returns a handle.
        Bad page lists raise ValueError; a transport failure shows as "failed" in `poll`."""

    @abc.abstractmethod
    def poll(self, handle: int) -> TransferState:
        """The write's state; "done" and "failed" are final."""

    @abc.abstractmethod
    def error(self, handle: int) -> str | None:
        """Why a write failed (None unless `poll` said "failed")."""

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Forget a finished write ("done" or "failed"); a pending one raises ValueError."""

    @abc.abstractmethod
    def notifications(self) -> list[tuple[str, bytes]]:
        """(sender name, message) received since the last call; in arrival order per sender."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister, forget peers; handles still pending become "failed". Idempotent."""


BACKENDS = {
    "nixl": "swaserve.disaggregation.nixl_backend:NixlBackend",
    "local": "swaserve.disaggregation.local_backend:LocalBackend",
}


def create_transfer_backend(kind: str, name: str, **kwargs: Any) -> TransferBackend:
    """The backend `kind` (`--disaggregation-transfer-backend`), imported only when used."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown transfer backend {kind!r}; choose from {sorted(BACKENDS)}")
    module, cls = BACKENDS[kind].split(":")
    return getattr(importlib.import_module(module), cls)(name, **kwargs)


def check_transfer_backend(kind: str) -> None:
    """At start, before any model loads: ValueError (the error text names the package) when
    backend `kind` cannot work here."""
    if kind == "nixl":
        from swaserve.disaggregation.nixl_backend import _import_nixl

        try:
            _import_nixl()
        except RuntimeError as e:
            raise ValueError(str(e)) from None
