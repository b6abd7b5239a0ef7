"""Offload tiers of the prefix cache (DESIGN §4): host memory, then optionally a file on disk.

An `OffloadPool` holds pages in the device pool's layout, page-major and as raw bytes, so one
page is one contiguous block whatever the KV dtype (FP8 included):

    data[page, slot, k|v, offset, head, byte]          page 0 is NULL (never handed out)

Each offload page has exactly one holder (a slot of a radix-tree node), so a free list and a
set of held pages are the whole bookkeeping: no reference counts.

`PageMover` runs the copies the cache decides, strictly in the order it decided them:
device -> tier (store), tier -> device (load), tier -> tier (demote to disk). Order matters: a
device page freed by an eviction may be handed out again in the same step, so its store must
run before anything writes it; a host page freed and reused must be read before it is
rewritten. One queue, run in order by `flush()`, keeps both true.

On CUDA the queue runs on a side stream: it first waits for the compute stream (a store reads
what the last forward wrote), and the compute stream waits for it before the next forward
(a load must land before attention reads it). Pages in flight are therefore pinned by stream
order: nothing on either stream touches them before the copy completes. Host memory is
pinned so that the per-page copies are asynchronous. CPU <-> CPU copies (host <-> disk) first
synchronise the side stream, since a store into that host page may still be in flight.
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from pathlib import Path

import torch

from swaserve.memory.kv_pool import KVPool

NULL = 0
DISK_CACHE_GB = 16.0  # disk tier size, at most half the free space of its directory


class OffloadPool:
    """Pages of one offload tier: host memory (pinned when CUDA is present) or a file."""

    def __init__(
        self,
        name: str,
        num_pages: int,
        page_shape: tuple[int, ...],
        pin: bool = False,
        path: Path | None = None,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"{name} tier needs 2 pages or more (page 0 is NULL), not {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self.path = path
        shape = (num_pages, *page_shape)
        if path is not None:
            numel = 1
            for d in shape:
                numel *= d
            # A sparse file mapped into memory: disk blocks are used as pages are written.
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=torch.uint8)
            self.data = flat.view(shape)
            self._remove_file = weakref.finalize(self, _remove, path)  # at close, GC or exit
        else:
            self.data = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
        self.pinned = path is None and pin
        self._free = list(range(num_pages - 1, NULL, -1))
        self._held: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

    def alloc(self, n: int) -> list[int] | None:
        """n free pages, or None (and no change) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._held.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._held:
                raise RuntimeError(f"{self.name} page {p} freed twice or never allocated")
        for p in pages:
            self._held.remove(p)
            self._free.append(p)

    def held(self) -> set[int]:
        return set(self._held)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: duplicate page on the free list"
        assert NULL not in free and NULL not in self._held, f"{self.name}: NULL page in use"
        assert not free & self._held, f"{self.name}: a page both free and held"
        assert len(free) + len(self._held) == self.capacity, f"{self.name}: pages lost"

    def close(self) -> None:
        if self.path is not None:
            self.data = torch.empty(0, dtype=torch.uint8)
            self._remove_file()


def _remove(path: Path) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def device_page_shape(kv: KVPool) -> tuple[int, ...]:
    """One page of the device pool, as bytes: [slot, k|v, offset, head, byte]."""
    b = _bytes(kv.kv)
    return (b.shape[0], b.shape[1], *b.shape[3:])


def build_tiers(kv: KVPool, host_cache_gb: float, disk_cache_dir: str | None) -> list[OffloadPool]:
    """The offload tiers the config asks for: host (if host_cache_gb > 0), then disk."""
    shape = device_page_shape(kv)
    page_bytes = 1
    for d in shape:
        page_bytes *= d
    tiers = []
    if host_cache_gb > 0:
        pages = int(host_cache_gb * 2**30) // page_bytes
        tiers.append(OffloadPool("host", max(2, pages), shape, pin=torch.cuda.is_available()))
    if disk_cache_dir:
        folder = Path(disk_cache_dir)
        folder.mkdir(parents=True, exist_ok=True)
        size = min(DISK_CACHE_GB * 2**30, shutil.disk_usage(folder).free / 2)
        path = folder / f"swaserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        tiers.append(OffloadPool("disk", max(2, int(size) // page_bytes), shape, path=path))
    return tiers


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class PageMover:
    """An ordered queue of page copies between the device KV pool and offload tiers."""

    def __init__(self, kv: KVPool, tiers: list[OffloadPool]) -> None:
        self.kv = kv
        self.tiers = tiers
        self.dev = _bytes(kv.kv)  # [slot, k|v, page, offset, head, byte]
        self.cuda = self.dev.device.type == "cuda"
        self._side = torch.cuda.Stream(self.dev.device) if self.cuda else None
        # (src tier or None for device, src pages, dst tier or None, dst pages)
        self._ops: list[tuple[int | None, list[int], int | None, list[int]]] = []

    def __len__(self) -> int:
        return len(self._ops)

    def store(self, dev_pages: list[int], tier: int, pages: list[int]) -> None:
        self._queue(None, dev_pages, tier, pages)

    def load(self, tier: int, pages: list[int], dev_pages: list[int]) -> None:
        self._queue(tier, pages, None, dev_pages)

    def move(self, src: int, src_pages: list[int], dst: int, dst_pages: list[int]) -> None:
        self._queue(src, src_pages, dst, dst_pages)

    def _queue(self, src, src_pages, dst, dst_pages) -> None:
        assert len(src_pages) == len(dst_pages)
        if not src_pages:
            return
        last = self._ops[-1] if self._ops else None
        # Same direction: one batch, unless a page is written twice (freed and handed out
        # again before the flush): a batched scatter with repeated indices has no order.
        if last and last[0] == src and last[2] == dst and not set(dst_pages) & set(last[3]):
            last[1].extend(src_pages)
            last[3].extend(dst_pages)
        else:
            self._ops.append((src, list(src_pages), dst, list(dst_pages)))

    def flush(self) -> None:
        """Run every queued copy in order (see the module docstring for the stream rules)."""
        ops, self._ops = self._ops, []
        if not ops:
            return
        if not self.cuda:
            for op in ops:
                self._run(*op)
            return
        side = self._side
        side.wait_stream(torch.cuda.current_stream(self.dev.device))
        with torch.cuda.stream(side):
            for op in ops:
                self._run(*op)
        torch.cuda.current_stream(self.dev.device).wait_stream(side)

    def _run(self, src: int | None, src_pages: list[int], dst: int | None, dst_pages) -> None:
        if src is None:
            self._store(src_pages, self.tiers[dst], dst_pages)
        elif dst is None:
            self._load(self.tiers[src], src_pages, dst_pages)
        else:
            if self._side is not None:
                self._side.synchronize()
            a, b = self.tiers[src], self.tiers[dst]
            b.data[torch.tensor(dst_pages)] = a.data[torch.tensor(src_pages)]

    def _store(self, dev_pages: list[int], pool: OffloadPool, pages: list[int]) -> None:
        idx = torch.tensor(dev_pages, device=self.dev.device)
        block = self.dev[:, :, idx].movedim(2, 0).contiguous()  # [n, slot, k|v, ...]
        if self.cuda and pool.pinned:
            for i, p in enumerate(pages):
                pool.data[p].copy_(block[i], non_blocking=True)
        else:
            if self._side is not None:
                self._side.synchronize()
            pool.data[torch.tensor(pages)] = block.cpu()

    def _load(self, pool: OffloadPool, pages: list[int], dev_pages: list[int]) -> None:
        if self.cuda and pool.pinned:
            block = torch.empty(
                (len(pages), *pool.data.shape[1:]), dtype=torch.uint8, device=self.dev.device
            )
            for i, p in enumerate(pages):
                block[i].copy_(pool.data[p], non_blocking=True)
        else:
            if self._side is not None:
                self._side.synchronize()
            block = pool.data[torch.tensor(pages)].to(self.dev.device)
        idx = torch.tensor(dev_pages, device=self.dev.device)
        self.dev[:, :, idx] = block.movedim(0, 2)
