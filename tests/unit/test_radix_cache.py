"""The SWA-aware radix prefix cache and its offload tiers, without a model.

A small simulator plays the scheduler's part (admit with a hit, compute chunks, insert,
retire, finish, abort, preempt, evict) over a tiny real KV pool in which every computed key
is written as (token id, position, group). So besides `check_integrity()` after every
operation (pool, request tables, tree and tiers agree; no double free; no leaf without a
usable end), each test checks the *data*: every key a request can still attend to holds the
right token at the right position, whatever was evicted, stored, loaded or copied. A wrong
hit would show up there, not only in the bookkeeping.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.memory.groups import build_layout
from swaserve.memory.host_cache import OffloadPool, device_page_shape
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager
from swaserve.memory.pool import NULL_PAGE
from swaserve.memory.radix_cache import RadixCache


@dataclass
class Req:
    request_id: str
    all_tokens: list[int]
    num_computed_tokens: int = 0
    hit: int = 0

    def tokens(self, start: int, end: int) -> list[int]:
        return self.all_tokens[start:end]

    @property
    def num_tokens(self) -> int:
        return len(self.all_tokens)


@dataclass
class Sim:
    """The cache with a manager, a KV pool whose pages hold (token, position, group), and the
    scheduler's side of the protocol."""

    windows: list[int | None]
    page_size: int
    num_pages: int
    host_pages: int = 0
    disk_path: str | None = None
    disk_pages: int = 0
    write_through: bool = False
    running: dict[str, Req] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.layout = build_layout(self.windows)
        self.memory = MemoryManager(self.layout, self.page_size, self.num_pages)
        self.kv = KVPool(
            self.layout, self.num_pages, self.page_size, 1, 3, torch.float32, torch.device("cpu")
        )
        shape = device_page_shape(self.kv)
        tiers = []
        if self.host_pages:
            tiers.append(OffloadPool("host", self.host_pages, shape))
        if self.disk_path:
            tiers.append(OffloadPool("disk", self.disk_pages, shape, path=self.disk_path))
        self.cache = RadixCache(self.memory, self.kv, tiers, self.write_through)
        self.ids = itertools.count()
        self.win = [g.window for g in self.layout.groups]

    # ---- the scheduler's part -------------------------------------------------------------

    def admit(self, tokens: list[int], chunk: int) -> Req | None:
        """Match, make room (hit locked), attach, allocate the first chunk, compute it."""
        req = Req(f"r{next(self.ids)}", list(tokens))
        hit = self.cache.match(tokens, len(tokens) - 1)
        p = hit.num_tokens
        assert 0 <= p < len(tokens)
        n = max(1, min(chunk, len(tokens) - p))
        need = self.memory.pages_to_cover(p, p + n) + hit.extra_pages
        short = need - self.memory.pool.num_free
        if short > 0:
            self.locked_evict(hit, short)
        if need > self.memory.pool.num_free:
            self.check()
            return None
        self.cache.attach(req.request_id, hit, len(tokens))
        req.num_computed_tokens = req.hit = p
        assert self.memory.allocate(req, n)
        self.running[req.request_id] = req
        self.compute(req, n)
        return req

    def step(self, req: Req, chunk: int) -> bool:
        """Compute the next chunk of a running request; False if it could not get pages."""
        n = max(1, min(chunk, req.num_tokens - req.num_computed_tokens))
        if req.num_computed_tokens + n > req.num_tokens:
            return False
        while not self.memory.allocate(req, n):
            if not self.evict(self.memory.shortfall(req, n)):
                return False
        self.compute(req, n)
        return True

    def compute(self, req: Req, n: int) -> None:
        """One forward: pending moves first, then the request must see exactly its keys, then
        it writes its n new keys; after the step its pages enter the cache and it retires."""
        self.cache.move_pages()
        self.check_visible(req)
        c = req.num_computed_tokens
        tables = self.memory.page_table(req.request_id)
        ps = self.page_size
        for g, table in enumerate(tables):
            for k in range(c, c + n):
                page = table[k // ps]
                assert page != NULL_PAGE
                self.kv.kv[:, 0, page, k % ps, 0] = torch.tensor(
                    [req.all_tokens[k], k, g], dtype=torch.float32
                )
        req.num_computed_tokens += n
        self.check_visible(req)
        self.cache.insert(req)
        self.memory.retire_out_of_window([req])
        self.cache.tidy()
        self.check()

    def finish(self, req: Req) -> None:
        """Finish or abort (at any point): the cache takes the computed pages, then free."""
        self.cache.insert(req)
        self.memory.free(req)
        self.cache.release(req.request_id)
        del self.running[req.request_id]
        self.check()

    def evict(self, n: int, swa_only: bool = False) -> int:
        """Evict, checking that no locked page (held by a request, or pinned) was touched."""
        locked = self.locked_pages()
        freed = self.cache.evict(n, swa_only=swa_only)
        assert locked <= self.tree_pages(), "a locked page was evicted"
        self.cache.move_pages()
        self.check()
        return freed

    def locked_evict(self, hit, n: int) -> int:
        self.cache.lock(hit)
        pinned = {
            (id(node), g, i, node.dev[g][i])
            for node in hit.nodes
            for g in range(len(self.win))
            for i in range(node.n_slots)
        }
        offl = {
            (id(node), t, g, i, node.off[t][g][i])
            for node in hit.nodes
            for t in range(len(node.off))
            for g in range(len(self.win))
            for i in range(node.n_slots)
        }
        try:
            freed = self.evict(n)
            for node in hit.nodes:
                assert node in self.cache.nodes, "a locked node was removed"
        finally:
            self.cache.unlock(hit)
        now = {
            (id(node), g, i, node.dev[g][i])
            for node in hit.nodes
            for g in range(len(self.win))
            for i in range(node.n_slots)
        }
        now_off = {
            (id(node), t, g, i, node.off[t][g][i])
            for node in hit.nodes
            for t in range(len(node.off))
            for g in range(len(self.win))
            for i in range(node.n_slots)
        }
        assert pinned == now and offl == now_off, "a pinned node changed during eviction"
        self.check()
        return freed

    # ---- checks ---------------------------------------------------------------------------

    def tree_pages(self) -> set[tuple[int, int, int, int]]:
        return {
            (id(n), g, i, p)
            for n in self.cache.nodes
            for g, row in enumerate(n.dev)
            for i, p in enumerate(row)
            if p != NULL_PAGE
        }

    def locked_pages(self) -> set[tuple[int, int, int, int]]:
        pool = self.memory.pool
        return {t for t in self.tree_pages() if pool.refcount(t[3]) > 1}

    def check(self) -> None:
        self.memory.check_integrity()  # runs the cache's check_integrity too

    def check_visible(self, req: Req) -> None:
        """Every key the next query of the request can see holds its token and position."""
        c, ps = req.num_computed_tokens, self.page_size
        tables = self.memory.page_table(req.request_id)
        for g, table in enumerate(tables):
            w = self.win[g]
            lo = 0 if w is None else max(0, c - w + 1)
            for k in range(lo, c):
                page = table[k // ps]
                assert page != NULL_PAGE, f"group {g}: key {k} of {req.request_id} retired"
                got = self.kv.kv[0, 0, page, k % ps, 0].tolist()
                want = [float(req.all_tokens[k]), float(k), float(g)]
                assert got == want, f"group {g} key {k}: {got} != {want} (hit {req.hit})"


def run_to_end(sim: Sim, tokens: list[int], chunk: int = 10**9) -> Req:
    req = sim.admit(tokens, chunk)
    assert req is not None
    while req.num_computed_tokens < req.num_tokens - 1:
        assert sim.step(req, chunk)
    return req


# ---- deterministic cases ------------------------------------------------------------------


def test_full_attention_hit_reuses_pages_and_copies_partial_page():
    sim = Sim([None, None], page_size=4, num_pages=64)
    a = run_to_end(sim, list(range(100, 130)))
    sim.finish(a)  # 29 computed tokens: 7 full pages cached
    assert sim.cache.stats()["cache_pages"] == 7
    # Diverges at 18, mid-page: 4 full pages shared, page 4 copied (its first 2 tokens valid).
    b = sim.admit(list(range(100, 118)) + [7, 8, 9, 10], chunk=100)
    assert b.hit == 18
    shared = sim.memory.page_table(b.request_id)[0][:4]
    assert all(sim.memory.pool.refcount(p) == 2 for p in shared)
    assert sim.cache.stats()["cache_hit_tokens"] == 18
    sim.finish(b)
    # The limit: at least one token is always computed.
    c = sim.admit(list(range(100, 129)), chunk=100)
    assert c.hit == 28
    sim.finish(c)


def test_swa_hit_needs_only_the_window_before_the_reuse_point():
    sim = Sim([6, None], page_size=4, num_pages=80)
    a = run_to_end(sim, list(range(40)))  # all 40 in one chunk, then keys < 35 are dead
    assert sim.memory.page_table(a.request_id)[0][:8] == [NULL_PAGE] * 8  # retired by a...
    sim.finish(a)
    assert all(p != NULL_PAGE for n in sim.cache.nodes for p in n.dev[0])  # ...kept by the tree
    b = sim.admit(list(range(30)) + [99] * 5, chunk=100)  # diverges mid-page 7
    assert b.hit == 30  # needs keys 25..29 only: slots 6 and 7 (a private copy of 7)
    sim.finish(b)


@pytest.mark.parametrize("window,page_size", [(1, 4), (2, 8), (3, 8), (5, 16)])
def test_window_smaller_than_a_page(window, page_size):
    sim = Sim([window, None, window], page_size=page_size, num_pages=200)
    tokens = [random.Random(window).randrange(50) for _ in range(70)]
    sim.finish(run_to_end(sim, tokens, chunk=9))
    for cut in (16, 17, 23, 40, 63):
        b = sim.admit(tokens[:cut] + [999, 998, 997], chunk=5)
        assert b.hit == cut
        sim.finish(b)


def test_hit_refused_when_the_window_before_the_reuse_point_was_evicted():
    sim = Sim([8, None], page_size=4, num_pages=200)
    tokens = list(range(1000, 1060))
    sim.finish(run_to_end(sim, tokens))
    # 15 pages cached. SWA pages outside the node's tail window (keys 53..59: slots 13, 14)
    # go first and become tombstones.
    sim.evict(10**6, swa_only=True)
    (node,) = sim.cache.nodes
    assert node.dev[0][:13] == [NULL_PAGE] * 13 and NULL_PAGE not in node.dev[0][13:]
    mid = sim.admit(tokens[:30] + [1, 2, 3], chunk=100)
    assert mid.hit == 0  # keys 23..29 (and every window before) are tombstones: a miss
    sim.finish(mid)
    end = sim.admit(tokens[:59] + [1, 2, 3], chunk=100)
    assert end.hit == 59  # keys 52..58: live
    sim.finish(end)


def test_branch_end_stays_reusable_under_swa_pressure():
    sim = Sim([8, None], page_size=4, num_pages=300)
    base = list(range(500, 540))
    for tail in ([1] * 12, [2] * 12, [3] * 12):
        sim.finish(run_to_end(sim, base + tail + [0]))
    sim.evict(10**6, swa_only=True)
    for tail in ([1] * 12, [2] * 12, [3] * 12):
        r = sim.admit(base + tail + [7], chunk=100)
        assert r.hit == 52  # every branch end
        sim.finish(r)
    r = sim.admit(base + [4] * 12, chunk=100)
    assert r.hit == 40  # the branch point, whose tail window is protected too
    sim.finish(r)


def test_unfinished_request_inserts_after_its_path_was_evicted():
    """The request retired (and the tree evicted) its early SWA pages; its later inserts
    must record them as tombstones, not as page ids (the dropped evicted-length bug)."""
    sim = Sim([4, None], page_size=2, num_pages=120)
    tokens = list(range(300, 360))
    req = sim.admit(tokens, chunk=8)
    for _ in range(3):
        assert sim.step(req, 8)
    sim.evict(10**6)  # the request holds its full pages and window: the rest goes
    for _ in range(3):
        assert sim.step(req, 8)
    sim.finish(req)
    again = sim.admit(tokens, chunk=100)
    assert again.hit == 56
    sim.finish(again)


def test_concurrent_duplicates_and_revival_of_tombstones():
    sim = Sim([4, None], page_size=4, num_pages=200)
    tokens = list(range(60))
    a = sim.admit(tokens, chunk=16)
    b = sim.admit(tokens, chunk=16)  # computes the same pages (a's are not in the tree yet)
    assert b.hit == 16  # a's first chunk, inserted after its step
    while a.num_computed_tokens < 59:
        sim.step(a, 16)
    sim.finish(a)
    sim.evict(10**6, swa_only=True)  # tombstones in the middle of a's node
    while b.num_computed_tokens < 59:
        sim.step(b, 16)  # b's live window revives them as it inserts
    sim.finish(b)


def test_preempt_and_recompute_hits_own_pages():
    sim = Sim([8, None, 8], page_size=4, num_pages=200)
    tokens = list(range(70))
    req = sim.admit(tokens, chunk=20)
    sim.step(req, 20)
    sim.finish(req)  # preempted: drops its pages after the cache took them
    again = sim.admit(tokens, chunk=20)
    assert again.hit == 40
    sim.finish(again)


def test_eviction_frees_only_unlocked_pages_and_reports_it():
    sim = Sim([4, None], page_size=4, num_pages=60)
    a = run_to_end(sim, list(range(40)))
    held = sim.memory.pool.num_used
    assert sim.evict(10**6) == 0 or sim.memory.pool.num_used < held
    # a still runs: every page its table holds is still in the tree
    sim.finish(a)
    freed = sim.evict(10**6)
    assert freed > 0 and sim.memory.pool.num_free == sim.memory.pool.capacity
    assert not sim.cache.nodes and sim.cache.stats()["evictions"] >= freed


def test_host_tier_store_and_load_back(tmp_path):
    sim = Sim([8, None], page_size=4, num_pages=60, host_pages=100)
    tokens = list(range(2000, 2050))
    sim.finish(run_to_end(sim, tokens))
    sim.evict(10**6)  # the whole branch goes to host: full pages + the SWA tail window
    assert sim.cache.num_dev == 0 and sim.cache.stats()["host_pages"] == 12 + 2
    r = sim.admit(tokens + [5], chunk=100)
    assert r.hit == 48 and sim.cache.stats()["host_loads"] == 12 + 2
    sim.finish(r)
    mid = sim.admit(tokens[:20] + [5], chunk=100)
    assert mid.hit == 0  # only the tail window was backed up: mid-branch SWA keys are gone
    sim.finish(mid)


def test_disk_tier_below_host(tmp_path):
    sim = Sim(
        [4, None],
        page_size=4,
        num_pages=60,
        host_pages=20,
        disk_path=str(tmp_path / "kv"),
        disk_pages=200,
    )
    seqs = [[s] * 3 + list(range(100 * s, 100 * s + 30)) for s in range(1, 5)]
    for tokens in seqs:
        sim.finish(run_to_end(sim, tokens))
        sim.evict(10**6)
    assert sim.cache.stats()["disk_pages"] > 0
    for tokens in seqs:
        r = sim.admit(tokens + [1], chunk=100)
        assert r.hit == 32
        sim.finish(r)
        sim.evict(10**6)
    sim.cache.close()
    assert not (tmp_path / "kv").exists()


def test_write_through_stores_full_pages_at_insert():
    sim = Sim([4, None], page_size=4, num_pages=60, host_pages=50, write_through=True)
    tokens = list(range(33))
    req = run_to_end(sim, tokens)
    assert sim.cache.stats()["host_pages"] == 8  # full pages, as they were inserted
    sim.finish(req)
    sim.evict(10**6)
    assert sim.cache.stats()["host_stores"] == 8 + 1  # + the SWA tail slot, at eviction
    r = sim.admit(tokens + [1], chunk=100)
    assert r.hit == 32
    sim.finish(r)


# ---- property tests -----------------------------------------------------------------------

WINDOW = st.one_of(st.integers(1, 8), st.integers(1, 64), st.integers(1, 1024))
PAGE = st.one_of(st.integers(1, 4), st.integers(1, 64))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    data=st.data(),
    windows=st.lists(st.one_of(st.none(), WINDOW), min_size=1, max_size=3),
    page_size=PAGE,
    tiers=st.sampled_from(["none", "host", "host+disk", "disk", "write_through"]),
)
def test_cache_random_operations(data, windows, page_size, tiers, tmp_path_factory):
    rng = random.Random(data.draw(st.integers(0, 2**31)))
    max_len = data.draw(st.integers(2, 6 * page_size + 40))
    layout = build_layout(windows)
    slots = -(-max_len // page_size)
    one_request = slots * len(layout.groups)
    num_pages = data.draw(st.integers(one_request + 1, 3 * one_request + 2))
    host = data.draw(st.integers(2, 2 * one_request + 2)) if tiers != "none" else 0
    path = str(tmp_path_factory.mktemp("disk") / "kv") if "disk" in tiers else None
    sim = Sim(
        [None if w is None else w for w in windows],
        page_size,
        num_pages,
        host_pages=host if tiers != "disk" else 0,
        disk_path=path,
        disk_pages=host,
        write_through=tiers == "write_through",
    )
    vocab = data.draw(st.integers(1, 4))
    bases = [[rng.randrange(vocab) for _ in range(max_len)] for _ in range(2)]

    def sequence() -> list[int]:
        base = rng.choice(bases)
        cut = rng.randrange(0, max_len + 1)
        length = rng.randrange(max(2, cut), max_len + 1)
        return base[:cut] + [rng.randrange(vocab) for _ in range(length - cut)]

    waiting: list[list[int]] = []
    ops = ["admit", "step", "step", "finish", "abort", "preempt", "evict", "swa", "lock"]
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(ops))
        chunk = data.draw(st.integers(1, max_len))
        running = list(sim.running.values())
        if op == "admit" or not running and op != "evict":
            tokens = waiting.pop() if waiting and rng.random() < 0.5 else sequence()
            if len(tokens) >= 2:
                sim.admit(tokens, chunk)
        elif op == "step":
            req = rng.choice(running)
            if req.num_computed_tokens < req.num_tokens - 1:
                sim.step(req, min(chunk, req.num_tokens - 1 - req.num_computed_tokens))
            else:
                sim.finish(req)
        elif op in ("finish", "abort"):
            sim.finish(rng.choice(running))
        elif op == "preempt":
            req = rng.choice(running)
            sim.finish(req)
            waiting.append(req.all_tokens)
        elif op in ("evict", "swa"):
            sim.evict(data.draw(st.integers(1, num_pages)), swa_only=op == "swa")
        elif op == "lock":
            hit = sim.cache.match(sequence())
            sim.locked_evict(hit, data.draw(st.integers(1, num_pages)))
    for req in list(sim.running.values()):
        sim.finish(req)
    sim.evict(10**9)
    assert sim.memory.pool.num_free == sim.memory.pool.capacity
    assert sim.cache.num_dev == 0
    sim.cache.close()
