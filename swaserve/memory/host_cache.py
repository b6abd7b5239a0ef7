"""Offload tiers of the prefix cache (docs/architecture.md §6): host memory, then optionally a
file on disk.

An `OffloadPool` holds pages in the device pool's layout, page-major and as raw bytes, so one
page is one contiguous block whatever the KV dtype (FP8 included); on CUDA the host tier's
memory is page-locked at its exact size (memory/pinned.py):

    data[page, slot, k|v, offset, head, byte]          page 0 is NULL (never handed out)

Each offload page has exactly one holder (a slot of a radix-tree node), so a free list and a
set of held pages are the whole bookkeeping: no reference counts.

`PageMover` runs the copies the cache decides, in the order it decided them: device -> tier
(store), tier -> device (load), tier -> tier (demote to disk), and device -> device on the
load stream (copy-on-write of a page still being loaded). Order matters: a device page freed
by an eviction may be handed out again in the same step, so its store must run before anything
writes it; an offload page freed and reused must be read before it is rewritten. `flush()`,
once per step before the forward, issues the queue in order.

On CUDA two side streams run it, each first waiting for the compute stream (a store reads what
the last forward wrote; a load's destination may be a page a finished request used):

    store stream   stores (pinned host: asynchronous) and moves; the compute stream waits for
                   it at the end of the flush: a device page a store reads may be reused by the
                   very next forward. Moves copy on the host after synchronising it.
    load stream    loads and device copies; nobody waits for it. Each op first waits for the
                   store stream (its destination may be a page a store is still reading, its
                   source an offload page a store is still writing); an event after each op
                   and one per flush (`landed(n)`) tell when it is complete.

The other direction of the ordering: a store or move that overwrites an offload page a load is
still reading first waits for that load's event (`_reading`): rare, since a freshly loaded
node is the most recently used. The device pages a load or copy writes, or a copy reads, are
the cache's to protect until `landed`: it holds a reference to them and keeps requests that
read them out of the forward until then (radix_cache.py), then orders the compute stream after
the flush's event (`wait`). On CPU every copy is synchronous and `ready` is always true;
`emulate_async` lets tests run loads late, as a lagging stream would.

No host syncs with a host tier: index tensors go to the device from pinned memory
(`_index`; a pageable copy would block the host until the stream's earlier work, a whole
forward, is done). A disk tier does block the host: a store to it (`.cpu()`) and a move
(host -> disk) wait for the store stream; a load from it reads the file on the host first.

Tensor parallelism (SGLang's hierarchical cache under TP): rank 0's mover decides, every rank
moves its own shard of the bytes. Each rank has tiers of the same slot layout (its pages hold
its KV heads), so rank 0's page ids mean the same everywhere. Rank 0 sends each flush's ops
before issuing them (`mirror_moves`) and each flush it first sees landed (`mirror_landed`);
a worker `replay`s the flush under the same number, on its own streams, and on a landed
message orders its compute stream after its own loads of that flush (`follow`, an event wait,
no host sync). That is enough: rank 0 reads or reuses a page a load wrote only after it saw
the flush land, and tells the workers before the message (FORWARD, COPY, the next flush) that
reads or overwrites the page on their side.
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from swaserve.memory.kv_pool import KVPool
from swaserve.memory.pinned import PinnedHostBuffer, pinned_empty

NULL = 0
# One queued copy: (src tier or None for the device, src pages, dst tier or None, dst pages).
Op = tuple[int | None, list[int], int | None, list[int]]
DISK_CACHE_GB = 16.0  # default disk tier size, at most half the free space of its directory


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
        self._pinned: PinnedHostBuffer | None = None
        shape = (num_pages, *page_shape)
        if path is not None:
            numel = 1
            for d in shape:
                numel *= d
            # A sparse file mapped into memory: disk blocks are used as pages are written.
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=torch.uint8)
            self.data = flat.view(shape)
            self._remove_file = weakref.finalize(self, _remove, path)  # at close, GC or exit
        elif pin:  # page-locked at its exact size (memory/pinned.py): async copies
            self.data, self._pinned = pinned_empty(shape)
        else:
            self.data = torch.empty(shape, dtype=torch.uint8)
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
        """Give the memory back (the page mover has drained: no copy is in flight)."""
        if self.path is None and self._pinned is None:
            return  # plain host memory: freed with the pool
        self.data = torch.empty(0, dtype=torch.uint8)
        if self.path is not None:
            self._remove_file()
        else:
            self._pinned.release()
            self._pinned = None


def _remove(path: Path) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def device_page_shape(kv: KVPool) -> tuple[int, ...]:
    """One page of the device pool, as bytes: [slot, k|v, offset, head, byte]."""
    return tuple(_bytes(kv.pages).shape[1:])


def build_tiers(
    kv: KVPool,
    host_cache_gb: float,
    disk_cache_dir: str | None,
    disk_cache_gb: float | None = None,
    agree: Callable[[list[int]], list[int]] | None = None,
) -> list[OffloadPool]:
    """The offload tiers the config asks for: host (if host_cache_gb > 0), then disk (in a
    sparse file of disk_cache_gb GiB, default min(16 GiB, half the directory's free space)).
    `agree` (tensor parallelism): the page counts every rank can hold, the smallest, so that
    offload page ids mean the same on every rank."""
    shape = device_page_shape(kv)
    page_bytes = 1
    for d in shape:
        page_bytes *= d
    counts = []
    if host_cache_gb > 0:
        counts.append(max(2, int(host_cache_gb * 2**30) // page_bytes))
    if disk_cache_dir:
        counts.append(max(2, _disk_bytes(Path(disk_cache_dir), disk_cache_gb) // page_bytes))
    if agree is not None and counts:
        counts = [int(n) for n in agree(counts)]
    tiers = []
    if host_cache_gb > 0:
        tiers.append(OffloadPool("host", counts.pop(0), shape, pin=torch.cuda.is_available()))
    if disk_cache_dir:
        path = Path(disk_cache_dir) / f"swaserve-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        tiers.append(OffloadPool("disk", counts.pop(0), shape, path=path))
    return tiers


def config_tiers(config: Any, kv: KVPool, tp: Any = None) -> list[OffloadPool]:
    """This rank's tiers for an EngineConfig (--host-cache-gb, --disk-cache-dir, --disk-cache-gb).

    Tensor parallelism (`tp`, a TPGroup of T > 1; every rank calls this at the same point of
    its start-up, a collective): the sizes are per rank, as SGLang's --hicache-size and
    vLLM's --swap-space are (and as --kv-cache-gb is here): each rank's host memory holds its
    own shard of every page, so a user sizes it by what one rank's host share can pin; the
    page counts are then the smallest over the ranks (they agree unless disk space differs).
    A disk tier goes into DIR/tp{T}-rank{r}: a run with another T never mixes its shards."""
    folder = config.disk_cache_dir
    agree = None
    if tp is not None and tp.size > 1:
        agree = partial(tp.agree, op="min")
        if folder:
            folder = str(Path(folder) / f"tp{tp.size}-rank{tp.rank}")
    return build_tiers(kv, config.host_cache_gb, folder, config.disk_cache_gb, agree)


def _disk_bytes(folder: Path, disk_cache_gb: float | None) -> int:
    """The disk tier's size: disk_cache_gb GiB, default min(16 GiB, half the free space)."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if disk_cache_gb is None:
        return int(min(DISK_CACHE_GB * 2**30, free / 2))
    size = disk_cache_gb * 2**30
    if size > free:
        raise ValueError(
            f"disk_cache_gb={disk_cache_gb} is more than the free space of "
            f"{folder} ({free / 2**30:.2f} GiB)"
        )
    return int(size)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


class _Lane:
    """CPU stand-in for the load stream (tests, `PageMover.emulate_async`): its ops run only
    when landed, in order, so a test sees what a real side stream would allow: a page read
    before its load landed, or reused while a copy into it is still pending."""

    def __init__(self) -> None:
        self.ops: deque[tuple[int, Callable[[], None]]] = deque()
        self.issued = 0  # ops put so far
        self.ran = 0  # ops run so far (a prefix of those put)

    def put(self, fn: Callable[[], None]) -> _LaneEvent:
        self.issued += 1
        self.ops.append((self.issued, fn))
        return _LaneEvent(self, self.issued)

    def run_to(self, n: int) -> None:
        while self.ops and self.ops[0][0] <= n:
            k, fn = self.ops.popleft()
            fn()
            self.ran = k


class _LaneEvent:
    """The event of a `_Lane` op: `query` and `synchronize` like a torch.cuda.Event."""

    def __init__(self, lane: _Lane, n: int) -> None:
        self.lane, self.n = lane, n

    def query(self) -> bool:
        return self.lane.ran >= self.n

    def synchronize(self) -> None:
        self.lane.run_to(self.n)


class PageMover:
    """An ordered queue of page copies between the device KV pool and offload tiers, flushed
    once per step; loads run on their own stream and are tracked per flush (see the module
    docstring)."""

    def __init__(self, kv: KVPool, tiers: list[OffloadPool]) -> None:
        self.kv = kv
        self.tiers = tiers
        self.dev = _bytes(kv.pages)  # [page, slot, k|v, offset, head, byte]: a page a row
        # Tensor parallelism, rank 0 (swaserve/distributed/tp_runner.py; None: one process):
        # every copy-on-write copy (`copy_now`), every flush's ops under its number before they
        # are issued, and every flush whose loads this rank first finds landed, so the other
        # ranks make the same copies in their pools and tiers (module docstring).
        self.mirror: Callable[[list[int], list[int]], None] | None = None
        self.mirror_moves: Callable[[int, list[Op]], None] | None = None
        self.mirror_landed: Callable[[int], None] | None = None
        self.cuda = self.dev.device.type == "cuda"
        dev = self.dev.device
        self._store_stream = torch.cuda.Stream(dev) if self.cuda else None
        self._load_stream = torch.cuda.Stream(dev) if self.cuda else None
        self._lane: _Lane | None = None  # CPU emulation of the load stream (tests)
        self._lag = 0
        self._ops: list[Op] = []
        self._flushes = 0  # flushes so far: the next one is number `next_flush`
        self._events: dict[int, Any] = {}  # flush -> event after its loads, until they land
        self._landed: dict[int, Any] = {}  # events found complete since the last flush
        # (tier, page) -> (flush, event) of the load reading that offload page (a store or a
        # move that overwrites the page must wait for it); stale entries are harmless.
        self._reading: dict[tuple[int, int], tuple[int, Any]] = {}

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def asynchronous(self) -> bool:
        """Loads land after the flush that issues them (CUDA, or the emulation in tests)."""
        return self.cuda or self._lane is not None

    @property
    def next_flush(self) -> int:
        """The number of the flush that will run what is queued now."""
        return self._flushes

    def emulate_async(self, lag: int) -> None:
        """Tests on CPU: run loads like a side stream that lags `lag` >= 1 flushes behind
        (the loads of flush n land at the start of flush n + lag, or when waited for)."""
        assert not self.cuda and lag >= 1 and not self._ops
        self._lane, self._lag = _Lane(), lag

    # ---- queueing -------------------------------------------------------------------------

    def store(self, dev_pages: list[int], tier: int, pages: list[int]) -> None:
        self._queue(None, dev_pages, tier, pages)

    def load(self, tier: int, pages: list[int], dev_pages: list[int]) -> None:
        self._queue(tier, pages, None, dev_pages)

    def move(self, src: int, src_pages: list[int], dst: int, dst_pages: list[int]) -> None:
        self._queue(src, src_pages, dst, dst_pages)

    def copy(self, src_pages: list[int], dst_pages: list[int]) -> None:
        """Device page copies on the load stream (copy-on-write of a page being loaded)."""
        self._queue(None, src_pages, None, dst_pages)

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

    # ---- running --------------------------------------------------------------------------

    def flush(self) -> None:
        """Issue every queued copy, in order (see the module docstring for the stream rules).
        Stores and moves are complete, for the compute stream, when this returns; loads and
        device copies land later: `landed(next_flush before this call)`."""
        ops, self._ops = self._ops, []
        n = self._flushes
        self._flushes += 1
        self._landed.clear()
        if self._lane is not None:
            self._land(n - self._lag)
        if not ops:
            return
        if self.mirror_moves is not None:
            self.mirror_moves(n, ops)
        if not self.asynchronous:
            for op in ops:
                self._run(*op)
            return
        compute = torch.cuda.current_stream(self.dev.device) if self.cuda else None
        if compute is not None:
            # What earlier forwards wrote (a store's source) or still use (a page freed by a
            # request and now a load's destination) comes first.
            self._store_stream.wait_stream(compute)
            self._load_stream.wait_stream(compute)
        last = None
        for op in ops:
            src, src_pages, dst, _ = op
            if dst is None:  # a load or a device copy: the load stream
                last = self._issue_load(op)
                if src is not None:
                    for p in src_pages:
                        self._reading[(src, p)] = (n, last)
            else:  # a store or a move: wait for the loads still reading the pages it writes
                for ev in self._readers(dst, op[3], n):
                    if self.cuda and src is None:
                        self._store_stream.wait_event(ev)
                    else:
                        ev.synchronize()
                if self.cuda:
                    with torch.cuda.stream(self._store_stream):
                        self._run(*op)
                else:
                    self._run(*op)
        if compute is not None:
            compute.wait_stream(self._store_stream)
        if last is not None:
            self._events[n] = last

    def _issue_load(self, op) -> Any:
        if not self.cuda:
            return self._lane.put(lambda: self._run(*op))
        # A device page freed after a store read it, or an offload page a store is writing:
        # the stores issued so far come first.
        self._load_stream.wait_stream(self._store_stream)
        with torch.cuda.stream(self._load_stream):
            self._run(*op)
        ev = torch.cuda.Event()
        ev.record(self._load_stream)
        return ev

    def _readers(self, tier: int, pages: list[int], current: int) -> list[Any]:
        """Events of the loads that may still read these offload pages: those of an earlier
        flush not landed yet, and those issued earlier in the flush in progress (`current`,
        recorded in `_events` only once it ends)."""
        out: dict[int, Any] = {}
        for p in pages:
            entry = self._reading.pop((tier, p), None)
            if entry is not None and (entry[0] == current or entry[0] in self._events):
                out[id(entry[1])] = entry[1]
        return list(out.values())

    def _land(self, n: int) -> None:
        """Emulation only: run the loads of flushes <= n."""
        due = [ev for f, ev in self._events.items() if f <= n]
        if due:
            due[-1].synchronize()

    # ---- completion -----------------------------------------------------------------------

    def landed(self, n: int) -> bool:
        """Flush n has run and its loads are complete: pages it wrote or read may be reused."""
        if n >= self._flushes:
            return False
        ev = self._events.get(n)
        if ev is None:
            return True
        if not ev.query():
            return False
        self._landed[n] = self._events.pop(n)
        if not self._events:
            self._reading.clear()
        if self.mirror_landed is not None:
            self.mirror_landed(n)
        return True

    def ready(self, n: int) -> bool:
        """A forward may read what flush n loads: on CPU always (the flush runs before the
        forward, synchronously), else once it landed."""
        return not self.asynchronous or self.landed(n)

    def wait(self, n: int) -> None:
        """Order the compute stream after flush n's loads, once `ready(n)` (so cheap). An
        event already forgotten was complete before this step's flush: nothing to wait for."""
        ev = self._events.get(n, self._landed.get(n))
        if ev is None:
            return
        if self.cuda:
            torch.cuda.current_stream(self.dev.device).wait_event(ev)
        else:
            ev.synchronize()

    def synchronize(self) -> None:
        """Block until every flushed load has landed."""
        if self._events:
            if self.cuda:
                self._load_stream.synchronize()
            else:
                self._lane.run_to(self._lane.issued)
            if self.mirror_landed is not None:
                self.mirror_landed(max(self._events))
        self._events.clear()
        self._reading.clear()

    # ---- a tensor-parallel worker: rank 0's flushes, on this rank's shard ------------------

    def replay(self, n: int, ops: list[Op]) -> None:
        """Run rank 0's flush n (its ops, in its order) on this rank's pool and tiers, on this
        rank's streams: its loads are tracked under the same number, for `follow`."""
        assert self._lane is None and not self._ops
        self._flushes, self._ops = n, [(a, list(b), c, list(d)) for a, b, c, d in ops]
        self.flush()

    def follow(self, n: int) -> None:
        """Rank 0 saw flush n's loads land and may now read or reuse what they wrote (or read):
        order this rank's compute stream after its own loads of flushes <= n, without a host
        sync. The load stream runs in order, so the latest of them covers the rest; a later
        flush's streams first wait for the compute stream, so its stores and moves come after
        them too."""
        due = sorted(f for f in self._events if f <= n)
        if not due:
            return
        ev = self._events[due[-1]]
        for f in due:
            del self._events[f]
        if not self._events:
            self._reading.clear()
        if self.cuda:
            torch.cuda.current_stream(self.dev.device).wait_event(ev)
        else:
            ev.synchronize()

    # ---- the copies -----------------------------------------------------------------------

    def copy_now(self, src_pages: list[int], dst_pages: list[int]) -> None:
        """Device page copies on the current stream (copy-on-write), without a host sync."""
        if src_pages:
            if self.mirror is not None:
                self.mirror(src_pages, dst_pages)
            self._copy(src_pages, dst_pages)

    def _copy(self, src_pages: list[int], dst_pages: list[int]) -> None:
        self.dev[self._index(dst_pages)] = self.dev[self._index(src_pages)]

    def _index(self, pages: list[int]) -> torch.Tensor:
        """Page ids as an index on the device, copied asynchronously: a plain torch.tensor(...,
        device=cuda) is a pageable copy, which would block the host until the stream's
        earlier work (a whole forward) is done."""
        t = torch.tensor(pages, dtype=torch.int64)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.dev.device, non_blocking=True)

    def _run(self, src: int | None, src_pages: list[int], dst: int | None, dst_pages) -> None:
        if src is None and dst is None:  # part of a flush: mirrored with it, not as a copy
            self._copy(src_pages, dst_pages)
        elif src is None:
            self._store(src_pages, self.tiers[dst], dst_pages)
        elif dst is None:
            self._load(self.tiers[src], src_pages, dst_pages)
        else:
            if self.cuda:
                self._store_stream.synchronize()  # a store into a source page may be in flight
            a, b = self.tiers[src], self.tiers[dst]
            b.data[torch.tensor(dst_pages)] = a.data[torch.tensor(src_pages)]

    def _store(self, dev_pages: list[int], pool: OffloadPool, pages: list[int]) -> None:
        block = self.dev[self._index(dev_pages)]  # [n, slot, ...], contiguous
        if self.cuda and pool.pinned:
            for i, p in enumerate(pages):
                pool.data[p].copy_(block[i], non_blocking=True)
        else:  # a file: the host waits for the stream (and the forward before it)
            pool.data[torch.tensor(pages)] = block.cpu()

    def _load(self, pool: OffloadPool, pages: list[int], dev_pages: list[int]) -> None:
        if self.cuda and pool.pinned:
            block = torch.empty(
                (len(pages), *pool.data.shape[1:]), dtype=torch.uint8, device=self.dev.device
            )
            for i, p in enumerate(pages):
                block[i].copy_(pool.data[p], non_blocking=True)
        else:  # pageable memory (a file): read now, on the host
            block = pool.data[torch.tensor(pages)]
            if self.cuda:
                block = block.pin_memory().to(self.dev.device, non_blocking=True)
        self.dev[self._index(dev_pages)] = block
