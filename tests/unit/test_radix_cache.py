"""The SWA-aware radix prefix cache and its offload tiers, without a model.

A small simulator plays the scheduler's part (admit with a hit, compute chunks, insert,
retire, finish, abort, preempt, evict) over a tiny real KV pool in which every computed key
is written as (token id, position, group). So besides `check_integrity()` after every
operation (pool, request tables, tree and tiers agree; no double free; no leaf without a
usable end), each test checks the *data*: every key a request can still attend to holds the
right token at the right position, whatever was evicted, stored, loaded or copied. A wrong
hit would show up there, not only in the bookkeeping.

With `lag` > 0 the loads run late, as on a CUDA side stream (`PageMover.emulate_async`): a
request whose prefix is still being loaded is held (not computed) until `loads_pending` turns
false, and every running request's keys are checked after every operation, so a page handed
out again while a copy into it was pending, or read before its load landed, shows up too.
"""

from __future__ import annotations

import itertools
import random
import shutil
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.config import EngineConfig
from swaserve.memory import host_cache
from swaserve.memory.groups import build_layout
from swaserve.memory.host_cache import OffloadPool, build_tiers, device_page_shape
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager
from swaserve.memory.pool import NULL_PAGE
from swaserve.memory.radix_cache import RadixCache, build_prefix_cache


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
    lag: int = 0  # > 0: loads land that many flushes late (held requests)
    running: dict[str, Req] = field(default_factory=dict)
    held: int = 0  # compute attempts refused for pending loads

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
        if self.lag:
            self.cache.mover.emulate_async(self.lag)
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
        # As the scheduler does, the hit stays locked from the match until attach: unlocking
        # tidies, and may remove a node of the hit whose own end is not a reuse point.
        self.cache.lock(hit)
        try:
            if short > 0:
                self._evict_locked(hit, short)
            fits = need <= self.memory.pool.num_free
            if fits:
                self.cache.attach(req.request_id, hit, len(tokens))
        finally:
            self.cache.unlock(hit)
        if not fits:
            self.check()
            return None
        req.num_computed_tokens = req.hit = p
        assert self.memory.allocate(req, n)
        self.running[req.request_id] = req
        self.compute(req, n)  # or held: its loads are pending
        return req

    def step(self, req: Req, chunk: int) -> bool:
        """Compute the next chunk of a running request (unless held: it keeps its pages, and
        a later step allocates its chunk again); False if it could not get pages."""
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
        it writes its n new keys; after the step its pages enter the cache and it retires.
        A request whose loads are pending is held instead (nothing computed)."""
        self.cache.move_pages()
        if self.cache.loads_pending(req.request_id):
            assert self.lag, "loads pending on CPU without the emulation"
            self.held += 1
            self.check()
            return
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
        # By page id: eviction may split a node (the unshared tail of a node in use).
        locked = {t[3] for t in self.locked_pages()}
        freed = self.cache.evict(n, swa_only=swa_only)
        assert locked <= {t[3] for t in self.tree_pages()}, "a locked page was evicted"
        self.cache.move_pages()
        self.check()
        return freed

    def _pages_of(self, hit) -> set[tuple]:
        """Every device and offload page slot of the hit's nodes."""
        groups = range(len(self.win))
        dev = {
            (id(node), g, i, node.dev[g][i])
            for node in hit.nodes for g in groups for i in range(node.n_slots)
        }
        off = {
            (id(node), t, g, i, node.off[t][g][i])
            for node in hit.nodes for t in range(len(node.off)) for g in groups
            for i in range(node.n_slots)
        }
        return dev | {("off", *key) for key in off}

    def locked_evict(self, hit, n: int) -> int:
        self.cache.lock(hit)
        try:
            return self._evict_locked(hit, n)
        finally:
            self.cache.unlock(hit)
            self.check()

    def _evict_locked(self, hit, n: int) -> int:
        """Evict with the hit locked (by the caller): its nodes stay, their pages unchanged."""
        before = self._pages_of(hit)
        freed = self.evict(n)
        for node in hit.nodes:
            assert node in self.cache.nodes, "a locked node was removed"
        assert before == self._pages_of(hit), "a pinned node changed during eviction"
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
        """Tree pages a request holds or a node pin protects (not only an in-flight copy: a
        short eviction may wait for those and then take the page)."""
        pool, inflight = self.memory.pool, self.cache._inflight
        return {t for t in self.tree_pages() if pool.refcount(t[3]) - (t[3] in inflight) > 1}

    def check(self) -> None:
        self.memory.check_integrity()  # runs the cache's check_integrity too
        for req in self.running.values():
            if not self.pending(req):
                self.check_visible(req)

    def pending(self, req: Req) -> bool:
        """Loads the request needs are still pending (without counting a held step)."""
        n = self.cache._waits.get(req.request_id)
        return n is not None and not self.cache.mover.ready(n)

    def land(self) -> None:
        """Every pending load lands now."""
        self.cache.mover.synchronize()
        self.check()

    def check_visible(self, req: Req) -> None:
        """Every key the next query of the request can see holds its token and position."""
        c, ps = req.num_computed_tokens, self.page_size
        tables = self.memory.page_table(req.request_id)
        for g, table in enumerate(tables):
            w = self.win[g]
            lo = 0 if w is None else max(0, c - w + 1)
            if lo >= c:
                continue
            keys = range(lo, c)
            pages = [table[k // ps] for k in keys]
            assert NULL_PAGE not in pages, f"group {g}: a key of {req.request_id} retired"
            got = self.kv.kv[0, 0, pages, [k % ps for k in keys], 0].cpu()
            want = torch.tensor([[req.all_tokens[k], k, g] for k in keys], dtype=self.kv.kv.dtype)
            if not torch.equal(got, want):
                k = lo + int((got != want).any(1).nonzero()[0])
                raise AssertionError(
                    f"{req.request_id} group {g} key {k}: {got[k - lo].tolist()} != "
                    f"{want[k - lo].tolist()} (hit {req.hit})"
                )


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


def test_partial_page_match_among_many_siblings():
    """Under a shared prefix (a chat template), a partial page's hit is the sibling sharing
    the most leading tokens: the sorted-keys lookup equals a scan of every sibling, and
    siblings come and go (eviction, splits) without the keys going stale."""
    ps, prefix = 4, [900, 901, 902, 903, 904, 905, 906, 907]
    sim = Sim([None], page_size=ps, num_pages=4096)
    rng = random.Random(5)
    pages = set()
    while len(pages) < 150:  # 4**4 possible: siblings share 0 to 3 leading tokens
        pages.add(tuple(rng.randint(1, 4) for _ in range(ps)))
    for page in sorted(pages, key=lambda _: rng.random()):
        sim.finish(run_to_end(sim, prefix + list(page) + [50, 51, 52, 53, 54]))
    split_at = prefix + list(sorted(pages)[0]) + [50, 60, 61]  # splits a sibling mid-way
    sim.finish(run_to_end(sim, split_at))
    sim.cache.evict(40)  # drops some siblings' leaves
    sim.check()
    kept = [k for k in sim.cache.nodes if k.parent is not None and k.parent.start == 0
            and k.start == len(prefix)]
    kept_pages = {tuple(n.key[:ps]) for n in kept}
    assert 0 < len(kept_pages) < len(pages)
    for _ in range(60):
        q = [rng.randint(1, 4) for _ in range(rng.randint(1, ps))]
        want = max(next((i for i in range(len(q)) if q[i] != k[i]), len(q)) for k in kept_pages)
        hit = sim.cache.match(prefix + q + [999])
        assert hit.num_tokens == len(prefix) + want, (q, hit.num_tokens)


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


def test_loads_in_flight_hold_requests_and_pages():
    """Loads that land late (a side stream): the hit's request is held, a second request
    sharing the pages being loaded waits too, an abort with loads in flight frees nothing that
    is still being written, and every request sees exactly its keys once they landed."""
    sim = Sim([64, None], page_size=4, num_pages=100, host_pages=100, lag=2)
    tokens = list(range(2000, 2050))
    sim.finish(run_to_end(sim, tokens))
    sim.evict(10**6)  # to host: 12 pages per group (the window covers the whole branch)
    assert sim.cache.num_dev == 0
    b = sim.admit(tokens + [5], chunk=100)
    assert b.hit == 48 and sim.pending(b) and b.num_computed_tokens == 48
    assert sim.cache.stats()["host_load_waits"] == 1 and sim.held == 1
    assert len(sim.cache._inflight) == 24
    c = sim.admit(tokens[:46] + [6], chunk=100)  # the same pages, already on their way
    assert c.hit == 46 and sim.pending(c)
    assert sim.cache.stats()["host_loads"] == 24
    inflight = set(sim.cache._inflight)  # + c's own copies of the pages holding 46
    assert len(inflight) == 26
    assert all(t[11] in inflight for t in sim.memory.page_table(c.request_id))
    sim.finish(b)  # aborted while its loads are in flight
    assert all(sim.memory.pool.refcount(p) >= 1 for p in inflight)
    d = sim.admit(list(range(9000, 9030)), chunk=100)  # a miss: fresh pages only
    assert not {p for t in sim.memory.page_table(d.request_id) for p in t} & inflight
    while sim.pending(c):
        assert sim.step(c, 100)
    assert c.num_computed_tokens == len(c.all_tokens)  # computed once the loads landed
    assert sim.cache.stats()["host_load_waits"] == sim.held == 2  # b and c, at admission
    for r in (c, d):
        sim.finish(r)
    assert not sim.cache._inflight  # landed, let go: b's copy went back to the pool
    sim.evict(10**9)
    assert sim.memory.pool.num_free == sim.memory.pool.capacity


def test_short_eviction_waits_for_loads_in_flight():
    """Pages held only by pending copies are freed by waiting for them, not reported lost."""
    sim = Sim([4, None], page_size=4, num_pages=40, host_pages=100, lag=3)
    tokens = list(range(500, 560))
    sim.finish(run_to_end(sim, tokens))
    sim.evict(10**6)
    r = sim.admit(tokens + [1], chunk=100)
    assert sim.pending(r)
    sim.finish(r)  # nothing holds the loaded pages but the tree and the copies
    used = sim.memory.pool.num_used
    assert sim.evict(10**6) == used  # waits for the loads, then evicts everything
    assert sim.memory.pool.num_free == sim.memory.pool.capacity and not sim.cache._inflight


def test_loads_land_in_one_flush_on_cpu():
    """Without the emulation (CPU): the flush runs every copy: nothing is ever pending."""
    sim = Sim([8, None], page_size=4, num_pages=60, host_pages=100)
    tokens = list(range(2000, 2050))
    sim.finish(run_to_end(sim, tokens))
    sim.evict(10**6)
    r = sim.admit(tokens + [5], chunk=100)
    assert r.num_computed_tokens == len(r.all_tokens) and sim.held == 0
    assert not sim.cache._inflight and not sim.cache.loads_pending(r.request_id)
    assert sim.cache.stats()["host_load_waits"] == 0
    sim.finish(r)


def test_disk_cache_gb(tmp_path, monkeypatch):
    layout = build_layout([4, None])
    kv = KVPool(layout, 8, 4, 1, 3, torch.float32, torch.device("cpu"))
    page = 1
    for d in device_page_shape(kv):
        page *= d
    (tier,) = build_tiers(kv, 0, str(tmp_path), disk_cache_gb=0.0001)
    assert tier.name == "disk" and tier.num_pages == int(0.0001 * 2**30) // page
    tier.close()
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ValueError, match="disk_cache_gb"):
        build_tiers(kv, 0, str(tmp_path), disk_cache_gb=2 * free / 2**30 + 1)
    assert not list(tmp_path.iterdir())  # no file left behind
    monkeypatch.setattr(host_cache, "DISK_CACHE_GB", 0.0002)  # the default, when below free/2
    (default,) = build_tiers(kv, 0, str(tmp_path))
    assert default.num_pages == int(0.0002 * 2**30) // page
    default.close()
    # Through the config (EngineConfig / --disk-cache-gb).
    memory = MemoryManager(layout, 4, 8)
    config = EngineConfig(disk_cache_dir=str(tmp_path), disk_cache_gb=0.0001)
    cache = build_prefix_cache(config, memory, kv)
    assert cache.tiers[0].num_pages == int(0.0001 * 2**30) // page
    cache.close()
    with pytest.raises(ValueError, match="disk_cache_gb"):
        config = EngineConfig(disk_cache_dir=str(tmp_path), disk_cache_gb=2 * free / 2**30 + 1)
        build_prefix_cache(config, MemoryManager(layout, 4, 8), kv)
    with pytest.raises(ValueError, match="disk_cache_dir"):
        build_prefix_cache(EngineConfig(disk_cache_gb=1.0), MemoryManager(layout, 4, 8), kv)


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
    lag=st.sampled_from([0, 0, 1, 2, 4]),
)
def test_cache_random_operations(data, windows, page_size, tiers, lag, tmp_path_factory):
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
        lag=lag if tiers != "none" else 0,
    )
    vocab = data.draw(st.integers(1, 4))
    bases = [[rng.randrange(vocab) for _ in range(max_len)] for _ in range(2)]

    def sequence() -> list[int]:
        base = rng.choice(bases)
        cut = rng.randrange(0, max_len + 1)
        length = rng.randrange(max(2, cut), max_len + 1)
        return base[:cut] + [rng.randrange(vocab) for _ in range(length - cut)]

    waiting: list[list[int]] = []
    ops = ["admit", "step", "step", "finish", "abort", "preempt", "evict", "swa", "lock", "land"]
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
        elif op == "land":
            sim.land()
    for req in list(sim.running.values()):
        sim.finish(req)
    sim.evict(10**9)
    assert sim.memory.pool.num_free == sim.memory.pool.capacity
    assert sim.cache.num_dev == 0
    sim.cache.close()


# ---- regressions (issue 10) ---------------------------------------------------------------


def test_host_page_not_reused_while_a_queued_load_reads_it():
    """A hit queues loads from host pages; in the same step (before the flush) an eviction
    for another request stores a node into the host tier. The loading node's host copies look
    redundant (its slots have device pages now), but the loads still read them: taking them
    for the store made the request attend to the other node's K/V (issue 10, bug 1)."""
    sim = Sim([4, None], page_size=4, num_pages=64, host_pages=10, lag=2)
    a = list(range(100, 132))
    sim.finish(run_to_end(sim, a))
    sim.evict(10**6)  # a -> host: 8 full pages + the SWA tail window (1 page): all 9 host pages
    assert sim.cache.num_dev == 0 and sim.cache.tiers[0].num_free == 0
    b = list(range(300, 332))
    sim.finish(run_to_end(sim, b))  # on device, unlocked
    # The scheduler's admission of a request hitting a: lock, attach (loads queued), unlock.
    req = Req("hit-a", a + [7])
    hit = sim.cache.match(req.all_tokens, req.num_tokens - 1)
    assert hit.num_tokens == 32
    sim.cache.lock(hit)
    sim.cache.attach(req.request_id, hit, req.num_tokens)
    sim.cache.unlock(hit)
    req.num_computed_tokens = req.hit = hit.num_tokens
    assert sim.memory.allocate(req, 1)
    sim.running[req.request_id] = req
    # Then the next admission needs room: b leaves the device, to host if it can.
    sim.cache.evict(10**6)
    sim.cache.move_pages()
    sim.land()  # checks every running request's keys: a's, not b's
    sim.check_visible(req)
    sim.finish(req)
    again = sim.admit(b + [1], chunk=100)  # b went to host or was dropped; never corrupted
    sim.finish(again)


def test_store_waits_for_a_load_of_the_same_flush():
    """PageMover alone: a load from host page h and a later store into h in one flush (h freed
    and reused meanwhile): the load reads h's old contents, on a lagging stream too."""
    layout = build_layout([None])
    kv = KVPool(layout, 8, 2, 1, 3, torch.float32, torch.device("cpu"))
    host = OffloadPool("host", 4, device_page_shape(kv))
    mover = host_cache.PageMover(kv, [host])
    mover.emulate_async(2)
    kv.kv[:, :, 1] = 1.0
    kv.kv[:, :, 2] = 2.0
    mover.store([1], 0, [3])  # h = 3 holds page 1's K/V (1.0)
    mover.flush()
    mover.load(0, [3], [4])  # device page 4 <- h
    mover.store([2], 0, [3])  # h freed and reused by another store (2.0)
    mover.flush()
    mover.synchronize()
    assert torch.all(kv.kv[:, :, 4] == 1.0), "the load read the page the store overwrote"
    assert torch.all(host.data[3].view(torch.float32) == 2.0)


def test_window_one_insert_after_the_path_was_evicted_leaves_no_empty_leaf():
    """Window 1 and no full layer: a page-aligned hit needs no key, so the request references
    none of the path's pages and pins nothing. Evicted before the request's first insert,
    the path was rebuilt from the request's all-NULL table as a leaf with no page in any tier
    (issue 10, bug 4)."""
    sim = Sim([1], page_size=4, num_pages=40)
    tokens = list(range(50, 70))
    sim.finish(run_to_end(sim, tokens))
    req = Req("aligned", tokens[:8] + [5, 6, 7, 8, 9, 10])
    hit = sim.cache.match(req.all_tokens, req.num_tokens - 1)
    assert hit.num_tokens == 8 and hit.extra_pages == 0
    sim.cache.lock(hit)
    sim.cache.attach(req.request_id, hit, req.num_tokens)
    sim.cache.unlock(hit)
    assert sim.memory.page_table(req.request_id) == [[NULL_PAGE, NULL_PAGE]]
    req.num_computed_tokens = req.hit = 8
    assert sim.memory.allocate(req, 1)
    sim.running[req.request_id] = req
    sim.evict(10**6)  # another admission's room: the whole tree goes
    assert not sim.cache.nodes
    sim.compute(req, 1)  # its first insert covers [0, 8): nothing live to cache there
    while req.num_computed_tokens < req.num_tokens:
        sim.step(req, 1)
    sim.finish(req)
    again = sim.admit(req.all_tokens + [9], chunk=100)
    assert again.hit == 12  # what the request computed itself was cached
    sim.finish(again)


@pytest.mark.parametrize("host_pages", [0, 64])
@pytest.mark.parametrize("windows", [[None], [6, None]])
def test_eviction_frees_the_unshared_tail_of_a_node_in_use(windows, host_pages):
    """A running request that hit a long cached node mid-way shares only its first slots.
    Eviction needed every page of a node unshared, so the node's tail could not be freed:
    requests that fit were aborted as "cannot fit" (issue 10, bug 3). The tail is split off
    and evicted; no more than needed where a reuse point allows (full attention only: with
    SWA, the pages outside the node's tail window went first, leaving no reuse point inside
    it, so the whole unshared tail goes); the shared head stays."""
    sim = Sim(windows, page_size=4, num_pages=80, host_pages=host_pages)
    tokens = list(range(1000, 1100))
    sim.finish(run_to_end(sim, tokens))  # one node of 25 slots per group
    assert len(sim.cache.nodes) == 1 and sim.cache.num_dev == 25 * len(windows)
    # Shares slots 0..3 (and copies slot 4); it has not filled a page of its own yet, so its
    # insert has not split the node.
    user = sim.admit(tokens[:18] + [1], chunk=100)
    assert user.hit == 18 and len(sim.cache.nodes) == 1
    free = sim.memory.pool.num_free
    want = 6 if windows == [None] else 30  # with SWA: 22 pages outside the tail window first
    assert sim.evict(want) >= want  # before the fix: 0 (full only), 22 (SWA)
    assert sim.memory.pool.num_free >= free + want
    kept = max(n.end for n in sim.cache.nodes if n.num_dev)
    assert kept == (76 if windows == [None] else 16)
    if windows == [None]:
        assert sim.evict(10**6) > 0  # the rest of the unshared tail
    assert max(n.end for n in sim.cache.nodes if n.num_dev) == 16
    tables = sim.memory.page_table(user.request_id)
    assert all(sim.memory.pool.refcount(p) > 1 for t in tables for p in t[:4] if p != NULL_PAGE)
    sim.finish(user)
    again = sim.admit(tokens[:16] + [4], chunk=100)
    # With SWA the head's window before 16 (slot 2) was outside every tail window: dropped.
    assert again.hit == (16 if windows == [None] else 0)
    sim.finish(again)


@pytest.mark.parametrize("windows", [[None], [4, None]])
def test_evictions_go_in_lru_order_from_one_walk_of_the_tree(windows, monkeypatch):
    """Every admission into a full cache walked the whole tree to find what to evict: with
    ~50k cached prompts the target answered ~1.4 prompts a second (stop 29). The candidates
    are now queued once and popped across evictions (`LruQueue`): the tree is walked again
    only when the queue runs dry, and the order stays least recently used first, a hit since
    the walk included (its nodes go last)."""
    sim = Sim(windows, page_size=4, num_pages=400)
    prompts = [[1000 * k + i for i in range(13)] for k in range(1, 21)]  # 3 full pages each
    for p in prompts:
        sim.finish(run_to_end(sim, p))
    walks = {"leaves": 0, "swa": 0}
    leaves, swa_build = sim.cache._leaf_candidates, sim.cache._swa_lru.build

    def count_leaves():
        walks["leaves"] += 1
        return leaves()

    def count_swa(nodes):
        nodes = list(nodes)
        walks["swa"] += len(nodes)  # nodes looked at, not builds: a rebuild takes the touched
        return swa_build(nodes)

    monkeypatch.setattr(sim.cache, "_leaf_candidates", count_leaves)
    monkeypatch.setattr(sim.cache._swa_lru, "build", count_swa)

    def cached() -> list[int]:
        kids = sim.cache.root.children
        return [k for k, p in enumerate(prompts) if tuple(p[:4]) in kids]

    gone: list[int] = []

    def evict_one() -> None:
        before = cached()
        assert sim.evict(1) >= 1
        gone.extend(k for k in before if k not in cached())

    while len(gone) < 2:
        evict_one()  # the queues are built; prompts 0 and 1 go
    for k in (3, 2):  # hits after the walk: these two are now the most recently used
        sim.finish(sim.admit(prompts[k][:12] + [7], chunk=100))
    while cached():
        evict_one()
    assert gone == [0, 1, *range(4, 20), 3, 2]
    # One walk for the queue, one more each time it ran dry (the hits' nodes were stale in it)
    assert walks["leaves"] <= 3
    # The SWA queue: every node once, then the nodes stamped since (the two hits' paths); a
    # walk per eviction would have looked at ~20 nodes 20 times
    assert walks["swa"] <= (2 * len(prompts) if windows[0] else 0)
    assert not sim.cache.nodes and sim.memory.pool.num_free == sim.memory.pool.capacity


@pytest.mark.parametrize("windows", [[None], [8, None]], ids=["full", "swa"])
def test_a_short_eviction_looks_at_device_nodes_only(windows, monkeypatch):
    """An eviction that cannot reach its goal runs the device-leaf queue dry, and its rebuild
    walked every node; with SWA groups the last resorts (levels 1 and 2) sorted every node,
    walked the tree for the leaves' reach and tidied every leaf. With a host tier keeping
    thousands of nodes, each step that asked paid that (stop 30, benchmarks/cache_pressure.py:
    3.7 ms a short eviction at 1.3k nodes, 15.6 ms at 4.3k). They take the nodes with device
    pages now (each node counts its children with device pages below), and still free all
    that can go."""
    sim = Sim(windows, page_size=4, num_pages=40 * len(windows), host_pages=400 * len(windows))
    prompts = [[1000 * k + i for i in range(13)] for k in range(1, 61)]  # 3 full pages each
    for p in prompts:
        sim.finish(run_to_end(sim, p))
    running = run_to_end(sim, [7] * 13)  # its pages cannot go
    cache = sim.cache
    on_device = [n for n in cache.nodes if n.num_dev]
    assert len(cache.nodes) == 61 and 0 < len(on_device) <= 15  # most prompts live on host
    walks, looked, inside = [], [], []
    postorder, candidates, evict = cache._postorder, cache._leaf_candidates, cache.evict

    def count_walk(top=None):
        if inside:  # not the integrity checks' walks
            walks.append(top)
        return postorder(top)

    def evict_marked(n, swa_only=False):
        inside.append(True)
        try:
            return evict(n, swa_only)
        finally:
            inside.clear()

    def count_candidates():
        found = candidates()
        looked.append(len(found))
        return found

    monkeypatch.setattr(cache, "_postorder", count_walk)
    monkeypatch.setattr(cache, "_leaf_candidates", count_candidates)
    monkeypatch.setattr(cache, "evict", evict_marked)
    for _ in range(3):
        sim.evict(10_000)  # short: everything that can go goes, on the first call
        sim.check()
    assert None not in walks  # no walk of the whole tree
    assert looked and max(looked) <= len(on_device)
    left = [p for n in cache.nodes for row in n.dev for p in row if p != NULL_PAGE]
    assert left and all(sim.memory.pool.refcount(p) > 1 for p in left)  # the request's only
    sim.finish(running)


def test_a_full_host_tier_makes_room_in_lru_order_without_sorting_the_tree(monkeypatch):
    """With the host tier full, every leaf stored there made room by sorting every node of
    the tree (stop 29: a third of a CPU run through a full two-tier cache). The tier now
    keeps its own queue: what stays cached is the most recent prompts, on device then host."""
    sim = Sim([None], page_size=4, num_pages=40, host_pages=24)
    seen = {"nodes": 0}
    build = sim.cache._tier_lru[0].build

    def count(nodes):
        nodes = list(nodes)
        seen["nodes"] += len(nodes)
        return build(nodes)

    monkeypatch.setattr(sim.cache._tier_lru[0], "build", count)
    prompts = [[1000 * k + i for i in range(13)] for k in range(1, 41)]  # 3 full pages each
    for p in prompts:
        sim.finish(run_to_end(sim, p))
    kids = sim.cache.root.children
    cached = [k for k, p in enumerate(prompts) if tuple(p[:4]) in kids]
    on_host = [k for k in cached if kids[tuple(prompts[k][:4])].num_dev == 0]
    assert on_host and cached == list(range(cached[0], len(prompts)))  # the newest survive
    assert on_host == list(range(cached[0], cached[0] + len(on_host)))  # older ones on host
    assert seen["nodes"] <= 2 * len(prompts)  # a sort per store: ~20 nodes, ~60 times
