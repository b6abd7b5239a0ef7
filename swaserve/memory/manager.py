"""MemoryManager: per-request page tables over one unified pool, window retirement
(docs/architecture.md §3).

For each request and attention group a page table lists page ids; entry i covers token
positions [i * page_size, (i + 1) * page_size). Every group of a request covers the same
`num_tokens_allocated` tokens, so all tables of a request have the same length.

Window arithmetic, one SWA group of window w, request with c = num_computed_tokens (the next
query position) and n new tokens being allocated:

    positions  0                  lo = c - w + 1       c                  c + n
               |---- dead keys ----|--- in window ---|--- this chunk ---|
    slots     [NULL  NULL  ...  NULL | p    p    p    p    p    p    p   ]
               0        first_live ^                       len = ceil(allocated / page_size)

    query q sees key k iff q - w < k <= q; every later query is >= c, so keys < lo are dead.
    dead_slots(c) = max(0, lo) // page_size: the slots whose every key is < lo (page-floored).
    Retirement moves `first_live` up to dead_slots(c), pointing the slots at NULL_PAGE and
    dropping the request's reference. Slots at or after first_live always hold a real page.

A chunk's own keys are never dead when it is allocated: key k >= c is seen by query k of the
same chunk, so a chunk longer than the window still needs pages for all its tokens; only keys
before lo are dead. Since allocated >= c, extension slots are never below dead_slots(c).
Full groups never retire (first_live stays 0).

Reference counting: a request's table holds one reference per non-NULL entry. Other holders
(the prefix cache, docs/architecture.md §5) take theirs with `pool.incref` and report them through
`register_external_holder`, so `check_integrity` can match refcounts to holders. A retired or
freed page returns to the free list only when its last holder lets go.

Pure CPU bookkeeping: no torch, no device syncs. The KV tensors live in memory/kv_pool.py.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from swaserve.memory.groups import GroupLayout
from swaserve.memory.pool import NULL_PAGE, PagePool
from swaserve.memory.table_mirror import TableMirror


class RequestLike(Protocol):
    request_id: str
    num_computed_tokens: int  # tokens whose K/V are already in the pool


# page id -> number of references that holder owns
ExternalRefs = Callable[[], Mapping[int, int]]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _settled(slots: int, caps: list[int | None]) -> int:
    """Pages over groups of a table of `slots` page slots, each group at most its cap
    (`MemoryManager._settled_caps`; None: no cap)."""
    return sum(slots if c is None else min(slots, c) for c in caps)


def page_bytes(
    layout: GroupLayout, page_size: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes of one page id: K and V of `page_size` tokens for every layer slot (rows of
    `layout.row_shape(kv_heads, head_dim)`)."""
    kv_heads, head_dim = layout.row_shape(kv_heads, head_dim)
    return layout.slots_per_page * 2 * page_size * kv_heads * head_dim * dtype_bytes


def num_pages_for_bytes(
    layout: GroupLayout,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    num_bytes: int,
) -> int:
    """Page ids (NULL included) that fit in `num_bytes` of KV storage."""
    return int(num_bytes) // page_bytes(layout, page_size, kv_heads, head_dim, dtype_bytes)


@dataclass
class _RequestPages:
    tables: list[list[int]]  # per group
    first_live: list[int]  # per group: slots below are NULL, slots from here are real pages
    num_tokens: int = 0  # tokens covered: len(table) == ceil(num_tokens / page_size)
    row: int = -1  # the request's row in the manager's TableMirror


class MemoryManager:
    def __init__(
        self, layout: GroupLayout, page_size: int, num_pages: int, watermark_pages: int = 0
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if watermark_pages < 0:
            raise ValueError(f"watermark_pages must be >= 0, got {watermark_pages}")
        self.layout = layout
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        self.watermark_pages = watermark_pages
        self._swa = [(g.index, g.window) for g in layout.groups if g.kind == "swa"]
        self._requests: dict[str, _RequestPages] = {}
        # the tables again as array rows, for building a step's tables (table_arrays)
        self._mirror = TableMirror(len(layout.groups))
        # Per page: references held by request page tables; per group: distinct such pages.
        self._req_refs = [0] * num_pages
        self._group_pages = [0] * len(layout.groups)
        self._external: list[ExternalRefs] = []
        self._checks: list[Callable[[], None]] = []
        self._pending_copies: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def num_tokens_allocated(self, request_id: str) -> int:
        """Tokens covered by the request's page tables (0 for an unknown request)."""
        st = self._requests.get(request_id)
        return st.num_tokens if st else 0

    def page_table(self, request_id: str) -> list[list[int]]:
        """A copy of the request's page table per group (NULL_PAGE where retired).

        Raises KeyError for a request with nothing allocated."""
        return [list(t) for t in self._requests[request_id].tables]

    def table_arrays(self, request_ids: Iterable[str]) -> list[np.ndarray]:
        """Per group, the requests' page tables as one new `[B, W]` int32 array, W the longest
        table (at least 1), zeros (NULL_PAGE) after each request's own entries. Raises KeyError
        for a request with nothing allocated."""
        sts = [self._requests[rid] for rid in request_ids]
        width = max(1, _ceil_div(max((st.num_tokens for st in sts), default=0), self.page_size))
        return self._mirror.gather([st.row for st in sts], width)

    def max_request_tokens(self, verify_drafts: int = 0) -> int:
        """The most tokens one request alone can hold: the largest L (a whole number of pages)
        with pages(L) + watermark_pages <= capacity, where pages(L) sums over groups
        ceil(L / page_size) for a full group and min(ceil(L / page_size), ceil((w - 1) /
        page_size) + 1) for an SWA group of window w: its footprint settles at the pages of
        the w - 1 keys the next query reads plus the page it writes (chunks shrink to what
        fits and out-of-window pages retire first). 0 when not one page per group fits;
        sys.maxsize when every group is SWA and all their footprints fit.

        `verify_drafts` K > 0: the request also runs whole verify chunks [last, K drafts] (a
        seeded sampling request's cannot shrink): an SWA group then holds the window behind
        the chunk's first position and the chunk, ceil((w - 1 + K) / page_size) + 1 pages."""
        budget = self.pool.capacity - self.watermark_pages
        caps = self._settled_caps(verify_drafts)

        def pages(slots: int) -> int:
            return _settled(slots, caps)

        if None in caps:
            hi = max(0, budget)  # a full group needs one page per slot: slots <= budget
        else:
            hi = max(caps)
            if pages(hi) <= budget:
                return sys.maxsize
        lo = 0  # pages() is nondecreasing: the largest slot count that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if pages(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.page_size

    def _settled_caps(self, verify_drafts: int = 0) -> list[int | None]:
        """Per group, the most pages a request's table holds once its out-of-window pages
        retire (None: a full group, one page per slot); see `max_request_tokens`."""
        return [
            None if g.window is None
            else _ceil_div(g.window - 1 + verify_drafts, self.page_size) + 1
            for g in self.layout.groups
        ]

    def settled_pages(self, num_tokens: int) -> int:
        """Pages, summed over groups, that a request of `num_tokens` tokens holds in the
        pool: one per page of tokens in a full group, at most a window's worth in an SWA group."""
        return _settled(_ceil_div(num_tokens, self.page_size), self._settled_caps())

    def pages_needed(self, request: RequestLike, num_new_tokens: int) -> int:
        """New pages, summed over groups, to compute tokens [c, c + num_new_tokens).

        Dead SWA slots (keys < c - window + 1) never need pages; as allocated >= c they all lie
        before the extension, so every group needs the same number of new slots."""
        st = self._checked(request, num_new_tokens)
        old = st.num_tokens if st else 0
        new = max(old, request.num_computed_tokens + num_new_tokens)
        new_slots = _ceil_div(new, self.page_size) - _ceil_div(old, self.page_size)
        return new_slots * len(self.layout.groups)

    def pages_to_cover(self, num_tokens: int, new_num_tokens: int) -> int:
        """New pages, summed over groups, to grow tables covering `num_tokens` tokens to
        `new_num_tokens` (for a request that will attach a prefix of num_tokens first)."""
        slots = _ceil_div(new_num_tokens, self.page_size) - _ceil_div(num_tokens, self.page_size)
        return max(0, slots) * len(self.layout.groups)

    def shortfall(self, request: RequestLike, num_new_tokens: int) -> int:
        """Pages that `allocate(request, num_new_tokens)` lacks (0 if it would succeed)."""
        needed = self.pages_needed(request, num_new_tokens)
        return max(0, needed - self._free_after_retire(request))

    def can_admit(self, request: RequestLike, num_new_tokens: int) -> bool:
        """Joint fit: pages for every group at once, keeping `watermark_pages` free after.

        Counts the pages this request's own retirement would return to the pool (allocate
        retires first). `can_admit` true implies `allocate` succeeds."""
        needed = self.pages_needed(request, num_new_tokens)
        return needed + self.watermark_pages <= self._free_after_retire(request)

    # ---- mutations -----------------------------------------------------------------------

    def allocate(self, request: RequestLike, num_new_tokens: int) -> bool:
        """Retire what is out of window, then cover num_computed_tokens + num_new_tokens tokens
        in every group. All groups or none: on False nothing has changed (not even retirement).
        Does not keep the watermark: that margin is for running requests."""
        st = self._requests.get(request.request_id)
        c, end = request.num_computed_tokens, request.num_computed_tokens + num_new_tokens
        if (st is not None and 0 <= num_new_tokens and c <= st.num_tokens
                and end <= len(st.tables[0]) * self.page_size
                and (not self._swa
                     or all(self._dead_slots(c, w) <= st.first_live[g] for g, w in self._swa))):
            # Within the pages it has (most decode steps: 15 of 16 with 16-token pages) and
            # no window retirement due: nothing to take from the pool.
            st.num_tokens = max(st.num_tokens, end)
            return True
        needed = self.pages_needed(request, num_new_tokens)
        if needed > self._free_after_retire(request):
            return False
        if st is None:
            st = _RequestPages([[] for _ in self.layout.groups], [0] * len(self.layout.groups),
                               row=self._mirror.add_row())
            self._requests[request.request_id] = st
        self.pool.decref(self._retire(st, request.num_computed_tokens))
        pages = self.pool.alloc(needed)
        assert pages is not None, "joint fit promised by _free_after_retire"
        per_group = needed // len(self.layout.groups)
        for g, table in enumerate(st.tables):  # extension slots are >= first_live: all live
            new = pages[g * per_group : (g + 1) * per_group]
            if new:
                self._mirror.write(st.row, g, len(table), new)
            table.extend(new)
            for p in new:
                self._add_ref(p, g)
        st.num_tokens = max(st.num_tokens, request.num_computed_tokens + num_new_tokens)
        return True

    def retire_out_of_window(self, requests: Iterable[RequestLike]) -> int:
        """Drop each request's reference to SWA pages no query at >= num_computed_tokens can
        see. Returns the number of references dropped; a page goes back to the free list only
        if no other holder has it. Work is O(pages retired) per (request, group)."""
        if not self._swa:  # no window: nothing ever retires (the step loop calls this always)
            return 0
        dropped: list[int] = []
        for request in requests:
            st = self._requests.get(request.request_id)
            if st is not None:
                dropped.extend(self._retire(st, request.num_computed_tokens))
        self.pool.decref(dropped)
        return len(dropped)

    def free(self, request: RequestLike | str) -> list[int]:
        """Drop all the request's references (finish, abort or preempt, at any point).

        Idempotent: an unknown id is a no-op. Returns the pages that became free."""
        request_id = request if isinstance(request, str) else request.request_id
        st = self._requests.pop(request_id, None)
        if st is None:
            return []
        dropped = []
        for g, table in enumerate(st.tables):
            for p in table[st.first_live[g] :]:
                self._drop_ref(p, g)
                dropped.append(p)
        self._mirror.drop_row(st.row, len(st.tables[0]))
        return self.pool.decref(dropped)

    def attach_prefix(self, request_id: str, tables: list[list[int]], num_tokens: int) -> None:
        """Seam for prefix-cache hits: a fresh request takes its own reference to pages
        another holder has, covering tokens [0, num_tokens).

        Each table has ceil(num_tokens / page_size) entries: NULL_PAGE for a prefix of
        retired/tombstoned SWA slots, then live pages (full groups: no NULLs). The caller
        owns the copy-on-write of a shared partial last page (see `copy_pages`)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id} already has pages")
        if len(tables) != len(self.layout.groups):
            raise ValueError(f"{len(tables)} tables for {len(self.layout.groups)} groups")
        length = _ceil_div(num_tokens, self.page_size)
        first_live = []
        for group, table in zip(self.layout.groups, tables):
            if len(table) != length:
                raise ValueError(f"group {group.index}: {len(table)} slots for {length}")
            nulls = next((i for i, p in enumerate(table) if p != NULL_PAGE), len(table))
            if NULL_PAGE in table[nulls:] or (nulls and not group.is_swa):
                raise ValueError(f"group {group.index}: NULL slots must be an SWA prefix")
            first_live.append(nulls)
        live = [p for g, t in enumerate(tables) for p in t[first_live[g] :]]
        if len(set(live)) != len(live):
            raise ValueError("a page appears twice in the attached tables")
        self.pool.incref(live)  # raises, changing nothing, on a free page
        st = _RequestPages([list(t) for t in tables], first_live, num_tokens,
                           self._mirror.add_row())
        self._requests[request_id] = st
        for g, table in enumerate(st.tables):
            self._mirror.write(st.row, g, 0, table)
            for p in table[first_live[g] :]:
                self._add_ref(p, g)

    def share_pages(self, request_id: str, swaps: list[tuple[int, int, int]]) -> list[int]:
        """Point live table slots of a request at pages another holder has with the same K/V
        (the prefix cache's copy of tokens the request computed itself, concurrently with
        another): `swaps` lists (group, slot, page). The request takes a reference to each new
        page and drops its old one; returns the pages that became free.

        The forward already enqueued may still read an old page: one freed here is handed out
        by a later step, whose writes come after it on the same stream."""
        st = self._requests[request_id]
        dropped = []
        for g, slot, page in swaps:
            old = st.tables[g][slot]
            if slot < st.first_live[g] or old == NULL_PAGE:
                raise ValueError(f"share_pages: group {g} slot {slot} of {request_id} is retired")
            if self.pool.refcount(page) == 0:
                raise ValueError(f"share_pages: page {page} is free")
            self.pool.incref([page])
            self._add_ref(page, g)
            st.tables[g][slot] = page
            self._mirror.write(st.row, g, slot, [page])
            self._drop_ref(old, g)
            dropped.append(old)
        return self.pool.decref(dropped)

    def copy_pages(self, src: list[int], dst: list[int]) -> list[tuple[int, int]]:
        """Record page copies src[i] -> dst[i] (copy-on-write of a shared partial page).

        Bookkeeping only: no data moves here and no reference changes (the caller already
        holds both pages). The prefix cache drains `take_copies()` in `move_pages` (called by
        EngineCore.step before the forward) and copies every layer slot of K and V
        (`KVPool.copy_pages`). Returns the pairs."""
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} sources, {len(dst)} destinations")
        for s, d in zip(src, dst):
            if s == d or self.pool.refcount(s) == 0 or self.pool.refcount(d) == 0:
                raise ValueError(f"copy_pages: bad pair {s} -> {d} (pages must be held)")
        if len(set(dst)) != len(dst):
            raise ValueError("copy_pages: a destination appears twice")
        pairs = list(zip(src, dst))
        self._pending_copies.extend(pairs)
        return pairs

    def take_copies(self) -> list[tuple[int, int]]:
        """The page copies recorded since the last call, in order."""
        pairs, self._pending_copies = self._pending_copies, []
        return pairs

    def register_external_holder(self, refs: ExternalRefs) -> None:
        """Declare a holder outside request page tables (the prefix cache): `refs()` returns
        {page: references it holds}. Used by `check_integrity` only. A bound method is held
        weakly (`_held`)."""
        self._external.append(_held(refs))

    def register_integrity_check(self, check: Callable[[], None]) -> None:
        """Another holder's own invariants, run at the end of `check_integrity` (a bound
        method held weakly, `_held`)."""
        self._checks.append(_held(check))

    # ---- accounting ----------------------------------------------------------------------

    def stats(self) -> dict:
        """Pool usage: per group the distinct pages held by request page tables;
        `pages_held_by_others` are referenced by no request (prefix cache, host loads)."""
        held = sum(self._group_pages)
        return {
            "page_size": self.page_size,
            "pages_total": self.pool.capacity,
            "pages_free": self.pool.num_free,
            "pages_held_by_requests": held,
            "pages_held_by_others": self.pool.num_used - held,
            "num_requests": len(self._requests),
            "groups": [
                {
                    "index": g.index,
                    "kind": g.kind,
                    "window": g.window,
                    "layers": list(g.layers),
                    "pages_used": self._group_pages[g.index],
                }
                for g in self.layout.groups
            ],
        }

    def check_integrity(self) -> None:
        """Assert every invariant (docs/architecture.md §11); O(pages + table entries). For
        tests."""
        pool, ps = self.pool, self.page_size
        free = pool.free_pages()
        free_set = set(free)
        assert len(free_set) == len(free), "duplicate page on the free list"
        assert NULL_PAGE not in free_set, "NULL page on the free list"
        assert all(0 < p < pool.num_pages for p in free), "out-of-range page on the free list"

        occurrences: Counter[int] = Counter()
        owner: dict[int, int] = {}
        for rid, st in self._requests.items():
            length = _ceil_div(st.num_tokens, ps)
            for group, table, first in zip(self.layout.groups, st.tables, st.first_live):
                where = f"request {rid} group {group.index}"
                assert len(table) == length, f"{where}: {len(table)} slots for {length}"
                assert 0 <= first <= length, f"{where}: first_live {first} of {length}"
                assert group.is_swa or first == 0, f"{where}: full group with retired slots"
                assert all(p == NULL_PAGE for p in table[:first]), f"{where}: live below cursor"
                mirrored = self._mirror.row(st.row, group.index)
                assert mirrored[:length].tolist() == table and not mirrored[length:].any(), (
                    f"{where}: the table mirror differs from the table"
                )
                for p in table[first:]:
                    assert 0 < p < pool.num_pages, f"{where}: bad page {p} at/after cursor"
                    assert owner.setdefault(p, group.index) == group.index, (
                        f"page {p} in groups {owner[p]} and {group.index}"
                    )
                    occurrences[p] += 1

        external: Counter[int] = Counter()
        for held in self._external:
            refs = held()
            if refs is None:  # its holder is gone
                continue
            for p, c in refs().items():
                assert p != NULL_PAGE, "external holder references the NULL page"
                external[p] += c

        referenced = 0
        for p in range(1, pool.num_pages):
            rc = pool.refcount(p)
            holders = occurrences[p] + external[p]
            assert self._req_refs[p] == occurrences[p], (
                f"page {p}: request refs tracked {self._req_refs[p]}, found {occurrences[p]}"
            )
            assert rc == holders, (
                f"page {p}: refcount {rc} != holders {holders} "
                f"(requests {occurrences[p]}, external {external[p]})"
            )
            if rc == 0:
                assert p in free_set, f"page {p}: refcount 0 but not on the free list"
            else:
                assert p not in free_set, f"page {p}: refcount {rc} but on the free list"
                referenced += 1
        assert pool.refcount(NULL_PAGE) == 0, "NULL page has references"
        assert len(free) + referenced == pool.capacity, (
            f"free {len(free)} + referenced {referenced} != capacity {pool.capacity}"
        )
        self._mirror.check([st.row for st in self._requests.values()])
        per_group = Counter(owner.values())
        for g in self.layout.groups:
            assert self._group_pages[g.index] == per_group[g.index], (
                f"group {g.index}: pages_used {self._group_pages[g.index]}, "
                f"found {per_group[g.index]}"
            )
        for held in self._checks:
            check = held()
            if check is not None:
                check()

    # ---- internals -----------------------------------------------------------------------

    def _checked(self, request: RequestLike, num_new_tokens: int) -> _RequestPages | None:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        st = self._requests.get(request.request_id)
        allocated = st.num_tokens if st else 0
        if request.num_computed_tokens > allocated:
            raise ValueError(
                f"request {request.request_id}: {request.num_computed_tokens} computed tokens "
                f"but only {allocated} allocated"
            )
        return st

    def _dead_slots(self, next_query_pos: int, window: int) -> int:
        """Slots whose every key k < next_query_pos - window + 1 (see the module diagram)."""
        return max(0, next_query_pos - window + 1) // self.page_size

    def _retire_range(self, st: _RequestPages, next_query_pos: int, g: int, window: int):
        return st.first_live[g], min(self._dead_slots(next_query_pos, window), len(st.tables[g]))

    def _free_after_retire(self, request: RequestLike) -> int:
        """Free pages once the request's own retirement has returned what only it holds."""
        st = self._requests.get(request.request_id)
        freed = 0
        if st is not None:
            for g, window in self._swa:
                start, end = self._retire_range(st, request.num_computed_tokens, g, window)
                freed += sum(1 for p in st.tables[g][start:end] if self.pool.refcount(p) == 1)
        return self.pool.num_free + freed

    def _retire(self, st: _RequestPages, next_query_pos: int) -> list[int]:
        """Point dead SWA slots at NULL; returns the pages to decref (caller does it)."""
        dropped = []
        for g, window in self._swa:
            start, end = self._retire_range(st, next_query_pos, g, window)
            if end <= start:
                continue
            table = st.tables[g]
            for i in range(start, end):
                self._drop_ref(table[i], g)
                dropped.append(table[i])
                table[i] = NULL_PAGE
            self._mirror.clear(st.row, g, start, end)
            st.first_live[g] = end
        return dropped

    def _add_ref(self, page: int, group: int) -> None:
        if self._req_refs[page] == 0:
            self._group_pages[group] += 1
        self._req_refs[page] += 1

    def _drop_ref(self, page: int, group: int) -> None:
        self._req_refs[page] -= 1
        if self._req_refs[page] == 0:
            self._group_pages[group] -= 1


def _held(fn: Callable) -> Callable[[], Callable | None]:
    """`fn` behind a call that returns it, or None once its object is gone: a bound method
    weakly (its object, the prefix cache, holds this manager: a strong reference made a cycle,
    and an engine's start-up objects sit in the collector's frozen generation (gc_heap.py),
    which is never collected, so a dropped Engine kept its KV pool, 68.7 GiB on the H200,
    benchmarks/RESULTS.md), any other callable strongly."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn

