"""The memory manager's table mirror: `table_arrays` equals the page tables, padded, through
every change a table sees (allocation within and past a page, window retirement, prefix
attach, page sharing, free and row reuse), past the mirror's initial rows and columns; and the
attention inputs built from lists equal those built from arrays."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from swaserve.attention.base import AttentionInputs
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import MemoryManager


@dataclass
class Req:
    request_id: str
    num_computed_tokens: int = 0


def padded(mgr: MemoryManager, ids: list[str]) -> list[np.ndarray]:
    """The reference: each group's tables from `page_table`, zero-padded to the longest."""
    tables = [mgr.page_table(r) for r in ids]
    width = max(1, max(len(t[0]) for t in tables))
    out = []
    for g in range(len(mgr.layout.groups)):
        a = np.zeros((len(ids), width), dtype=np.int32)
        for i, t in enumerate(tables):
            a[i, : len(t[g])] = t[g]
        out.append(a)
    return out


def check(mgr: MemoryManager, live: dict[str, Req], rng: random.Random) -> None:
    mgr.check_integrity()  # asserts each mirror row equals its table, free rows zero
    ids = [r for r in live if r in mgr]
    if not ids:
        return
    ids = rng.sample(ids, rng.randint(1, len(ids)))
    got, want = mgr.table_arrays(ids), padded(mgr, ids)
    for g, w in zip(got, want):
        assert g.dtype == np.int32 and np.array_equal(g, w)
    lists = AttentionInputs([1] * len(ids), [0] * len(ids), [mgr.page_table(r) for r in ids])
    arrays = AttentionInputs([1] * len(ids), [0] * len(ids), arrays=got)
    for g in range(len(got)):
        assert np.array_equal(lists.group_table(g), arrays.group_table(g))


def test_table_arrays_follow_every_table_change():
    rng = random.Random(3)
    ps = 4
    mgr = MemoryManager(build_layout([None, 10, None, 10]), ps, num_pages=3000)
    live: dict[str, Req] = {}
    serial = 0
    for _ in range(600):
        op = rng.random()
        if op < 0.15 or not live:  # a new request, sometimes from another's prefix
            serial += 1
            rid = f"r{serial}"
            donor = rng.choice(list(live.values())) if live and rng.random() < 0.3 else None
            if donor is not None and donor.num_computed_tokens >= ps and donor.request_id in mgr:
                k = donor.num_computed_tokens // ps * ps  # whole pages, still held by the donor
                tables = [t[: k // ps] for t in mgr.page_table(donor.request_id)]
                mgr.attach_prefix(rid, tables, k)
                live[rid] = Req(rid, k)
            else:
                live[rid] = Req(rid)
        elif op < 0.25:  # finish one
            req = live.pop(rng.choice(list(live)))
            mgr.free(req)
        else:  # a step: a decode or a chunk (crosses pages, retires out-of-window slots)
            req = live[rng.choice(list(live))]
            n = 1 if rng.random() < 0.6 else rng.randint(2, 3 * ps)
            if mgr.allocate(req, n):
                req.num_computed_tokens += n
        check(mgr, live, rng)
    assert serial > 64  # past the mirror's first 64 rows
    assert max(mgr.num_tokens_allocated(r) for r in live if r in mgr) > 0


def test_rows_and_columns_grow_and_rows_are_reused_clean():
    ps = 2
    mgr = MemoryManager(build_layout([None]), ps, num_pages=6000)
    reqs = [Req(f"r{i}") for i in range(100)]  # more than 64 rows
    for i, r in enumerate(reqs):
        assert mgr.allocate(r, 1 + i * 2)  # the longest: 100 pages, past 64 columns
        r.num_computed_tokens = 1 + i * 2
    ids = [r.request_id for r in reqs]
    assert np.array_equal(mgr.table_arrays(ids)[0], padded(mgr, ids)[0])
    for r in reqs[::2]:
        mgr.free(r)
    mgr.check_integrity()  # freed rows are zero again
    fresh = [Req(f"n{i}") for i in range(10)]
    for r in fresh:
        assert mgr.allocate(r, 3)
    ids = [r.request_id for r in fresh + reqs[1::2]]
    assert np.array_equal(mgr.table_arrays(ids)[0], padded(mgr, ids)[0])
    mgr.check_integrity()


def test_share_pages_updates_the_mirror():
    ps = 4
    mgr = MemoryManager(build_layout([None]), ps, num_pages=64)
    a, b = Req("a"), Req("b")
    assert mgr.allocate(a, 8) and mgr.allocate(b, 8)
    a.num_computed_tokens = b.num_computed_tokens = 8
    page = mgr.page_table("b")[0][1]
    mgr.share_pages("a", [(0, 1, page)])
    assert mgr.table_arrays(["a"])[0][0, 1] == page
    mgr.check_integrity()
