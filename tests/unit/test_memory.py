"""Attention groups, page pool and MemoryManager: window arithmetic, joint fit, refcounts.

`check_integrity()` runs after every operation of the property tests. Expected window
retirement is recomputed by brute force from the window semantics (query q sees key k iff
q - window < k <= q), never from the manager's own formula.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.bench.memory import layer_windows_from_config, main_from_config, run_memory_bench
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import MemoryManager, num_pages_for_bytes, page_bytes
from swaserve.memory.pool import NULL_PAGE, PagePool, PageRefError

GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


@dataclass
class Req:
    request_id: str
    num_computed_tokens: int = 0


# ---- brute-force oracles ---------------------------------------------------------------


def key_visible(k: int, next_query_pos: int, window: int | None) -> bool:
    """Some query q >= next_query_pos sees key k (enumerates the candidate queries)."""
    if window is None:
        return True
    for q in range(max(next_query_pos, k), k + window):
        if q - window < k <= q:
            return True
    return False


def needed_slots(length: int, page_size: int, next_query_pos: int, window: int | None) -> set:
    """Slots of a table of `length` entries holding at least one key still visible."""
    return {
        i
        for i in range(length)
        if any(
            key_visible(k, next_query_pos, window)
            for k in range(i * page_size, (i + 1) * page_size)
        )
    }


def needed_slots_fast(length: int, page_size: int, next_query_pos: int, window: int | None):
    # A key k is visible to some query q >= c iff k > c - window (take q = max(c, k)).
    if window is None:
        return set(range(length))
    return {i for i in range(length) if (i + 1) * page_size - 1 > next_query_pos - window}


def live_slots(table: list[int]) -> set:
    return {i for i, p in enumerate(table) if p != NULL_PAGE}


def snapshot(mgr: MemoryManager, ids) -> tuple:
    pool = mgr.pool
    return (
        {rid: mgr.page_table(rid) for rid in ids if rid in mgr},
        {rid: mgr.num_tokens_allocated(rid) for rid in ids},
        [pool.refcount(p) for p in range(pool.num_pages)],
        pool.free_pages(),
        mgr.stats(),
    )


# ---- groups ----------------------------------------------------------------------------


def check_layout(windows, layout):
    seen = []
    for g in layout.groups:
        assert 1 <= len(g.layers) <= layout.slots_per_page
        kinds = {windows[layer] for layer in g.layers}
        assert len(kinds) == 1
        w = kinds.pop()
        assert (g.kind, g.window) == (("full", None) if w is None else ("swa", w))
        for slot, layer in enumerate(g.layers):
            assert layout.layer_to_group[layer] == g.index
            assert layout.layer_to_slot[layer] == slot
        seen += g.layers
    assert sorted(seen) == list(range(len(windows)))
    assert [g.index for g in layout.groups] == list(range(len(layout.groups)))
    # Only the last group of each kind is padded.
    by_kind = {}
    for g in layout.groups:
        by_kind.setdefault(g.window, []).append(len(g.layers))
    for sizes in by_kind.values():
        assert all(s == layout.slots_per_page for s in sizes[:-1])


def test_layout_gemma3_270m():
    layout = build_layout(GEMMA3_270M)
    check_layout(GEMMA3_270M, layout)
    assert layout.slots_per_page == 3
    swa = [g for g in layout.groups if g.kind == "swa"]
    full = [g for g in layout.groups if g.kind == "full"]
    assert len(swa) == 5 and all(g.window == 512 for g in swa)
    assert [g.layers for g in full] == [(5, 11, 17)]
    assert layout.num_padded_slots == 0


def test_layout_all_full_and_one_kind():
    layout = build_layout([None] * 30)
    assert layout.slots_per_page == 30 and len(layout.groups) == 1
    assert layout.groups[0].layers == tuple(range(30))
    mistral = build_layout([4096] * 32)
    assert len(mistral.groups) == 1 and mistral.groups[0].window == 4096
    forced = build_layout(GEMMA3_270M, all_full=True)
    assert forced.slots_per_page == 18 and len(forced.groups) == 1
    assert forced.groups[0].kind == "full" and forced.groups[0].window is None


def test_layout_gemma3_27b_little_padding():
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]  # 52 swa + 10 full
    layout = build_layout(windows)
    check_layout(windows, layout)
    assert layout.slots_per_page == 10
    assert len(layout.groups) == 7
    full = [g for g in layout.groups if g.kind == "full"]
    assert len(full) == 1 and len(full[0].layers) == 10  # full pages carry no padding
    assert layout.num_padded_slots == 8


def test_layout_two_windows_and_errors():
    windows = [128, None, 4096, 128, None, 4096]
    layout = build_layout(windows)
    check_layout(windows, layout)
    assert {(g.kind, g.window) for g in layout.groups} == {
        ("swa", 128),
        ("full", None),
        ("swa", 4096),
    }
    with pytest.raises(ValueError):
        build_layout([])
    with pytest.raises(ValueError):
        build_layout([0, None])


@given(st.lists(st.sampled_from([None, 1, 7, 512, 1024]), min_size=1, max_size=70))
def test_layout_property(windows):
    check_layout(windows, build_layout(windows))
    check_layout([None] * len(windows), build_layout(windows, all_full=True))


def _layer_bytes(kv, layer: int) -> set[int]:
    """Element offsets (within one page) of layer `layer`'s K and V rows."""
    import torch

    out = set()
    base = kv.pages.data_ptr()
    for t in kv.layer_cache(layer):
        page0 = t[0]
        idx = torch.arange(page0.numel()).view(page0.shape)
        off = (page0.data_ptr() - base) // t.element_size()
        strides = page0.stride()
        for i in idx.flatten().tolist():
            pos, rem = [], i
            for n in reversed(page0.shape):
                pos.append(rem % n)
                rem //= n
            pos.reverse()
            out.add(off + sum(p * s for p, s in zip(pos, strides, strict=True)))
    return out


@pytest.mark.parametrize("sharing", [False, True])
def test_mixed_kv_shapes_pool_views_disjoint(sharing):
    """Layers of two K/V widths (Gemma 4-like: sliding layers of 2 x 4 elements a row, width 8,
    beside full ones of 1 x 16, width 16) in one pool: every owning layer's K and V rows are
    disjoint from those of the other layers of its group and inside
    the page; what a layer stores in its group's pages it reads back, whatever the other layers
    of the group stored; a sharing layer reads its source's rows."""
    import torch

    from swaserve.memory.kv_pool import KVPool

    windows = [4, 4, None, 4, 4, None, 4, None]
    shapes = [(2, 4) if w else (1, 16) for w in windows]
    sources = [0, 1, 2, 3, 4, 5, 4, 5] if sharing else None
    layout = build_layout(windows, kv_shapes=shapes, kv_sources=sources)
    assert layout.unit_width == 8 and layout.slots_per_page % 2 == 0
    kv = KVPool(layout, 1 + 2 * layout.num_groups, 4, 99, 99, torch.float32,
                torch.device("cpu"))  # fmt: skip
    page = kv.pages[0].numel()
    owners = [i for i in range(len(windows)) if layout.kv_source(i) == i]
    for g in layout.groups:
        seen: set[int] = set()
        for layer in g.layers:
            b = _layer_bytes(kv, layer)
            assert len(b) == 2 * 4 * shapes[layer][0] * shapes[layer][1]
            assert not (b & seen) and max(b) < page and min(b) >= 0
            seen |= b
    def slots(layer: int) -> torch.Tensor:  # two pages of the layer's group (page = 4 slots)
        p = 1 + 2 * layout.layer_to_group[layer]
        return torch.tensor([4 * p, 4 * p + 3, 4 * (p + 1) + 1])

    for layer in owners:
        h, d = shapes[layer]
        k = torch.full((3, h, d), float(layer + 1))
        kv.store(layer, k, -k, slots(layer))
    for layer in range(len(windows)):
        src = layout.kv_source(layer)
        k, v = kv.read(layer, slots(layer))
        assert bool((k == src + 1).all()) and bool((v == -(src + 1)).all()), layer
        assert kv.row_addressing(layer)[0].shape[1:] == shapes[src]


def test_layout_sharing_errors():
    """A layer may only read an earlier layer's K/V, one that has its own, of its window and
    shape."""
    w = [4, None, 4, None]
    for sources, message in [([0, 1, 3, 3], "earlier"), ([0, 1, 1, 3], "windows differ"),
                             ([0, 0, 2, 3], "windows differ")]:
        with pytest.raises(ValueError, match=message):
            build_layout(w, kv_sources=sources)
    with pytest.raises(ValueError, match="K/V shapes differ"):
        build_layout(w, kv_shapes=[(1, 8), (1, 16), (2, 8), (1, 16)], kv_sources=[0, 1, 0, 1])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([None, 3, 512]), st.sampled_from([(1, 8), (2, 8),
                                                                          (1, 24), (4, 16)])),
             min_size=1, max_size=24),
    st.integers(0, 6),
)
def test_layout_property_mixed_shapes_and_sharing(layers, shared):
    """Any windows, K/V shapes and a tail of sharing layers: every owning layer is in exactly
    one group of its window; a group's layers all have one width, sit at consecutive,
    non-overlapping unit slots inside the page; the page is a multiple of every width; a
    sharing layer maps to its source's group and slot."""
    windows = [w for w, _ in layers]
    shapes = [shape for _, shape in layers]
    n, first = len(layers), max(1, len(layers) - shared)
    sources = list(range(n))
    for i in range(first, n):  # the last earlier owner of the same window and shape, if any
        same = [j for j in range(first) if (windows[j], shapes[j]) == (windows[i], shapes[i])]
        if same:
            sources[i] = same[-1]
    layout = build_layout(windows, kv_shapes=shapes, kv_sources=sources)
    unit = math.gcd(*(h * d for h, d in shapes))
    widths = {i: shapes[i][0] * shapes[i][1] // unit for i in range(n)}
    if len(set(shapes)) == 1:
        widths = dict.fromkeys(range(n), 1)
    owners = [i for i in range(n) if sources[i] == i]
    assert all(layout.slots_per_page % widths[i] == 0 for i in owners)
    seen = []
    for g in layout.groups:
        assert len({widths[layer] for layer in g.layers}) == 1
        assert {windows[layer] for layer in g.layers} == {g.window}
        end = 0
        for layer in g.layers:
            assert layout.layer_to_group[layer] == g.index
            assert layout.layer_to_slot[layer] == end  # packed from slot 0, no overlap
            end += widths[layer]
        assert end <= layout.slots_per_page
        seen += g.layers
    assert sorted(seen) == owners
    for i in range(n):
        src = sources[i]
        assert (layout.layer_to_group[i], layout.layer_to_slot[i]) == (
            layout.layer_to_group[src], layout.layer_to_slot[src])
        assert layout.kv_source(i) == src


# ---- pool ------------------------------------------------------------------------------


def test_pool_basics():
    pool = PagePool(5)
    assert pool.capacity == 4 and pool.num_free == 4
    assert pool.alloc(5) is None and pool.num_free == 4  # all or nothing
    pages = pool.alloc(3)
    assert len(set(pages)) == 3 and NULL_PAGE not in pages
    assert all(pool.refcount(p) == 1 for p in pages)
    pool.incref([pages[0]])
    assert pool.decref([pages[0]]) == []
    assert pool.decref(pages) == pages
    assert pool.num_free == 4
    with pytest.raises(PageRefError):
        pool.decref([pages[0]])  # double free
    with pytest.raises(PageRefError):
        pool.incref([pages[0]])  # incref of a free page
    with pytest.raises(PageRefError):
        pool.decref([NULL_PAGE])
    assert pool.alloc(0) == []
    assert sorted(pool.alloc(4)) == [1, 2, 3, 4]  # NULL is never handed out


def test_pool_decref_is_atomic():
    pool = PagePool(4)
    a, b = pool.alloc(2)
    with pytest.raises(PageRefError):
        pool.decref([a, b, b])
    assert pool.refcount(a) == 1 and pool.refcount(b) == 1 and pool.num_free == 1


# ---- manager: window arithmetic ---------------------------------------------------------


@pytest.mark.parametrize(
    "window,page_size",
    [(4, 16), (5, 16), (16, 16), (17, 16), (40, 16), (1, 1), (3, 1), (1, 8), (100, 7)],
)
def test_retirement_matches_brute_force(window, page_size):
    # window smaller than a page, equal, larger; one swa group + one full group
    layout = build_layout([window, None])
    mgr = MemoryManager(layout, page_size, num_pages=400)
    req = Req("a")
    swa = next(g.index for g in layout.groups if g.kind == "swa")
    full = next(g.index for g in layout.groups if g.kind == "full")
    for chunk in [1, 3, page_size, 2 * window + 5, 1, 1, page_size + 1, 9, 1, 50]:
        assert mgr.allocate(req, chunk)
        mgr.check_integrity()
        req.num_computed_tokens += chunk
        before = mgr.page_table("a")[swa]
        refs = [p for p in before if p != NULL_PAGE]
        dropped = mgr.retire_out_of_window([req])
        mgr.check_integrity()
        tables = mgr.page_table("a")
        expect = needed_slots(len(before), page_size, req.num_computed_tokens, window)
        assert live_slots(tables[swa]) == expect
        assert dropped == len(refs) - len(expect)
        assert live_slots(tables[full]) == set(range(len(tables[full])))
        assert mgr.num_tokens_allocated("a") == req.num_computed_tokens
    # Settled SWA footprint: at most window + one page of tokens, page-floored.
    assert len(live_slots(mgr.page_table("a")[swa])) <= math.ceil(window / page_size) + 1
    assert sorted(mgr.free(req)) and mgr.pool.num_free == mgr.pool.capacity
    mgr.check_integrity()


def test_window_smaller_than_page_numbers():
    layout = build_layout([4])
    mgr = MemoryManager(layout, page_size=16, num_pages=10)
    req = Req("a")
    assert mgr.allocate(req, 40)  # slots 0, 1, 2
    req.num_computed_tokens = 40  # next query 40 sees keys 37..40: slot 2 only
    assert mgr.retire_out_of_window([req]) == 2
    assert live_slots(mgr.page_table("a")[0]) == {2}
    assert mgr.retire_out_of_window([req]) == 0  # the cursor makes it idempotent
    req.num_computed_tokens = 48  # keys 45..48: slot 2 (45..47) and slot 3 (not yet allocated)
    assert mgr.retire_out_of_window([req]) == 0
    mgr.check_integrity()


def test_chunk_longer_than_window_needs_all_its_keys():
    layout = build_layout([4, None])
    mgr = MemoryManager(layout, page_size=4, num_pages=100)
    req = Req("a")
    # Query 0..19 of the chunk see keys 0..19 between them: every page is needed.
    assert mgr.pages_needed(req, 20) == 2 * 5
    assert mgr.allocate(req, 20)
    req.num_computed_tokens = 20
    # Next chunk [20, 40): keys below 17 are dead -> slots 0..3 retire before extending.
    assert mgr.pages_needed(req, 20) == 2 * 5
    free_before = mgr.pool.num_free
    assert mgr.allocate(req, 20)
    assert mgr.pool.num_free == free_before + 4 - 10
    assert live_slots(mgr.page_table("a")[0]) == set(range(4, 10))
    mgr.check_integrity()


def test_computed_beyond_allocated_is_an_error():
    mgr = MemoryManager(build_layout([8]), 4, 10)
    with pytest.raises(ValueError):
        mgr.allocate(Req("a", 3), 1)
    with pytest.raises(ValueError):
        mgr.pages_needed(Req("a"), -1)


# ---- manager: joint fit, watermark, refs -----------------------------------------------


def test_joint_fit_all_or_nothing():
    layout = build_layout([8, None, 8, None])  # S=2: one swa group, one full group
    assert len(layout.groups) == 2
    mgr = MemoryManager(layout, page_size=4, num_pages=8)  # capacity 7
    a, b = Req("a"), Req("b")
    assert mgr.allocate(a, 12)  # 3 pages per group
    assert mgr.pool.num_free == 1
    # b needs one page in each group: the swa group alone would fit, jointly not.
    ids = ["a", "b"]
    before = snapshot(mgr, ids)
    assert mgr.pages_needed(b, 1) == 2
    assert not mgr.can_admit(b, 1)
    assert not mgr.allocate(b, 1)
    assert snapshot(mgr, ids) == before and "b" not in mgr
    mgr.check_integrity()
    # a running request whose retirement would free enough is also all-or-nothing:
    a.num_computed_tokens = 12  # keys < 5 dead -> slot 0 of the swa group retirable
    assert mgr.pages_needed(a, 8) == 4  # 2 slots per group; 1 free + 1 retirable < 4
    before = snapshot(mgr, ids)
    assert not mgr.allocate(a, 8)
    assert snapshot(mgr, ids) == before  # not even retired
    assert mgr.allocate(a, 4)  # 2 pages: 1 free + 1 from retirement
    assert mgr.pool.num_free == 0
    assert live_slots(mgr.page_table("a")[0]) == {1, 2, 3}
    mgr.check_integrity()


def test_watermark_applies_to_admission_only():
    mgr = MemoryManager(build_layout([None]), 4, num_pages=5, watermark_pages=2)  # capacity 4
    a = Req("a")
    assert mgr.can_admit(a, 8)  # 2 pages + 2 margin
    assert not mgr.can_admit(a, 9)
    assert mgr.allocate(a, 16)  # running requests may eat the margin
    assert mgr.pool.num_free == 0
    mgr.check_integrity()


def test_external_ref_survives_retirement():
    layout = build_layout([4])
    mgr = MemoryManager(layout, page_size=4, num_pages=10)
    cache: Counter = Counter()
    mgr.register_external_holder(lambda: cache)
    req = Req("a")
    assert mgr.allocate(req, 12)
    kept = mgr.page_table("a")[0][0]
    mgr.pool.incref([kept])  # the prefix cache takes its own reference
    cache[kept] += 1
    mgr.check_integrity()
    req.num_computed_tokens = 12  # keys < 9 dead: slots 0 and 1
    free_before = mgr.pool.num_free
    assert mgr.retire_out_of_window([req]) == 2
    assert mgr.pool.num_free == free_before + 1  # only the unshared page came back
    assert mgr.pool.refcount(kept) == 1 and kept not in mgr.pool.free_pages()
    assert mgr.page_table("a")[0][0] == NULL_PAGE
    stats = mgr.stats()
    assert stats["pages_held_by_requests"] == 1 and stats["pages_held_by_others"] == 1
    mgr.check_integrity()
    mgr.free(req)
    mgr.check_integrity()
    assert mgr.pool.decref([kept]) == [kept]  # the holder lets go: now it is free
    cache[kept] -= 1
    mgr.check_integrity()
    assert mgr.pool.num_free == mgr.pool.capacity


def test_integrity_catches_unaccounted_refs():
    mgr = MemoryManager(build_layout([None]), 4, 10)
    assert mgr.allocate(Req("a"), 8)
    mgr.pool.incref([mgr.page_table("a")[0][0]])  # a holder nobody registered
    with pytest.raises(AssertionError, match="refcount"):
        mgr.check_integrity()


def test_free_is_idempotent_and_accepts_ids():
    mgr = MemoryManager(build_layout([2, None]), 2, 20)
    a = Req("a")
    assert mgr.allocate(a, 5)
    assert len(mgr.free("a")) == 6
    assert mgr.free(a) == [] and mgr.free("never") == []
    assert mgr.num_tokens_allocated("a") == 0
    with pytest.raises(KeyError):
        mgr.page_table("a")
    mgr.check_integrity()


def test_attach_prefix_shares_pages():
    layout = build_layout([4, None])
    swa = next(g.index for g in layout.groups if g.kind == "swa")
    mgr = MemoryManager(layout, page_size=4, num_pages=30)
    a = Req("a")
    assert mgr.allocate(a, 16)
    a.num_computed_tokens = 16
    tables = mgr.page_table("a")
    tables[swa][:3] = [NULL_PAGE] * 3  # a hit at p=16 needs keys 13..15 only
    mgr.attach_prefix("b", tables, 16)
    mgr.check_integrity()
    shared = [p for t in tables for p in t if p != NULL_PAGE]
    assert all(mgr.pool.refcount(p) == 2 for p in shared)
    assert mgr.stats()["pages_held_by_requests"] == 8
    b = Req("b", 16)
    assert mgr.allocate(b, 4)
    mgr.free(a)
    mgr.check_integrity()
    held_by_b = {p for t in mgr.page_table("b") for p in t if p != NULL_PAGE}
    assert all(mgr.pool.refcount(p) == (1 if p in held_by_b else 0) for p in shared)
    with pytest.raises(ValueError):
        mgr.attach_prefix("c", [[NULL_PAGE, 1, 2, 3], [NULL_PAGE, 5, 6, 7]], 16)  # full NULL
    mgr.free(b)
    assert mgr.pool.num_free == mgr.pool.capacity
    mgr.check_integrity()


def test_copy_pages_records_pairs():
    mgr = MemoryManager(build_layout([None]), 4, 10)
    assert mgr.allocate(Req("a"), 8)
    p, q = mgr.page_table("a")[0]
    assert mgr.copy_pages([p], [q]) == [(p, q)]
    assert mgr.take_copies() == [(p, q)] and mgr.take_copies() == []
    with pytest.raises(ValueError):
        mgr.copy_pages([p], [9])  # destination not held
    with pytest.raises(ValueError):
        mgr.copy_pages([p, q], [q])


def test_stats_and_sizing():
    layout = build_layout(GEMMA3_270M)
    assert page_bytes(layout, 16, 1, 256, 2) == 3 * 2 * 16 * 256 * 2
    assert num_pages_for_bytes(layout, 16, 1, 256, 2, 2 << 30) == (2 << 30) // 49152
    mgr = MemoryManager(layout, 16, 100)
    assert mgr.allocate(Req("a"), 17)
    s = mgr.stats()
    assert s["page_size"] == 16 and s["pages_total"] == 99 and s["pages_free"] == 99 - 12
    assert [g["pages_used"] for g in s["groups"]] == [2] * 6
    assert s["groups"][0] == {
        "index": 0,
        "kind": "swa",
        "window": 512,
        "layers": [0, 1, 2],
        "pages_used": 2,
    }


# ---- manager: property test --------------------------------------------------------------

# weights by repetition: steps dominate, as in a serving loop
OPS = ["admit", "admit", "step", "step", "step", "step", "retire", "retire", "free"]
OPS += ["abort_unknown", "cache_ref", "cache_drop", "attach"]
WINDOWS = st.one_of(st.none(), st.integers(1, 1024), st.integers(1, 8))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    kinds=st.lists(WINDOWS, min_size=1, max_size=4),
    layers_per_kind=st.integers(1, 3),
    page_size=st.integers(1, 64),
    num_pages=st.integers(1, 160),
    watermark=st.integers(0, 3),
)
def test_manager_random_operations(data, kinds, layers_per_kind, page_size, num_pages, watermark):
    windows = [w for w in kinds for _ in range(layers_per_kind)]
    layout = build_layout(windows)
    mgr = MemoryManager(layout, page_size, num_pages, watermark)
    pool = mgr.pool
    cache: Counter = Counter()
    mgr.register_external_holder(lambda: +cache)
    reqs: dict[str, Req] = {}
    allocated: dict[str, int] = {}
    next_id = 0
    max_chunk = data.draw(st.sampled_from([4, 40, 400]))

    def expected_pages(req: Req, n: int) -> int:
        old = allocated.get(req.request_id, 0)
        new = max(old, req.num_computed_tokens + n)
        return len(layout.groups) * (math.ceil(new / page_size) - math.ceil(old / page_size))

    def retirable(req: Req) -> list[int]:
        if req.request_id not in mgr:
            return []
        out = []
        for g, table in zip(layout.groups, mgr.page_table(req.request_id)):
            keep = needed_slots_fast(len(table), page_size, req.num_computed_tokens, g.window)
            out += [p for i, p in enumerate(table) if p != NULL_PAGE and i not in keep]
        return out

    def check_all() -> None:
        mgr.check_integrity()
        assert set(allocated) == {rid for rid in reqs if rid in mgr}
        for rid, req in reqs.items():
            assert mgr.num_tokens_allocated(rid) == allocated.get(rid, 0)
            if rid not in mgr:
                continue
            for g, table in zip(layout.groups, mgr.page_table(rid)):
                assert len(table) == math.ceil(allocated[rid] / page_size)
                need = needed_slots_fast(len(table), page_size, req.num_computed_tokens, g.window)
                live = live_slots(table)
                assert need <= live, "a page still visible was retired"

    def try_allocate(req: Req, n: int, admission: bool) -> bool:
        needed = expected_pages(req, n)
        assert mgr.pages_needed(req, n) == needed
        reclaim = sum(1 for p in retirable(req) if pool.refcount(p) == 1)
        fits = needed <= pool.num_free + reclaim
        assert mgr.can_admit(req, n) == (needed + watermark <= pool.num_free + reclaim)
        if admission and not mgr.can_admit(req, n):
            return False
        ids = list(reqs) + [req.request_id]
        before = snapshot(mgr, ids)
        ok = mgr.allocate(req, n)
        assert ok == fits
        if ok:
            allocated[req.request_id] = max(
                allocated.get(req.request_id, 0), req.num_computed_tokens + n
            )
        else:
            assert snapshot(mgr, ids) == before
        return ok

    ops = data.draw(st.lists(st.sampled_from(OPS), min_size=20, max_size=80))
    for op in ops:
        running = sorted(reqs)
        if op == "admit":
            req = Req(f"r{next_id}")
            next_id += 1
            reqs[req.request_id] = req
            if not try_allocate(req, data.draw(st.integers(1, max_chunk)), admission=True):
                del reqs[req.request_id]
        elif op == "step" and running:
            req = reqs[data.draw(st.sampled_from(running))]
            n = data.draw(st.integers(0, max_chunk))
            if try_allocate(req, n, admission=False):
                # advance by what was computed: all, or less (rejected speculative tokens)
                pending = allocated[req.request_id] - req.num_computed_tokens
                req.num_computed_tokens += data.draw(st.sampled_from([pending, pending, 0, 1]))
                req.num_computed_tokens = min(req.num_computed_tokens, allocated[req.request_id])
        elif op == "retire" and running:
            chosen = data.draw(st.lists(st.sampled_from(running), unique=True))
            drop = [p for rid in chosen for p in retirable(reqs[rid])]
            free_before = pool.num_free
            # a page shared by two chosen requests is dropped twice and may come back
            freed_expected = sum(1 for p, c in Counter(drop).items() if pool.refcount(p) == c)
            assert mgr.retire_out_of_window([reqs[rid] for rid in chosen]) == len(drop)
            assert pool.num_free == free_before + freed_expected
            for rid in chosen:  # chosen requests are now exactly at their window
                for g, table in zip(layout.groups, mgr.page_table(rid)):
                    need = needed_slots_fast(
                        len(table), page_size, reqs[rid].num_computed_tokens, g.window
                    )
                    assert live_slots(table) == need
        elif op == "free" and running:
            rid = data.draw(st.sampled_from(running))
            pages = [p for t in mgr.page_table(rid) for p in t if p != NULL_PAGE]
            expect = sorted(p for p in pages if pool.refcount(p) == 1)
            assert sorted(mgr.free(reqs.pop(rid))) == expect
            allocated.pop(rid)
            assert mgr.free(rid) == []
        elif op == "abort_unknown":
            assert mgr.free(f"unknown{next_id}") == []
        elif op == "cache_ref" and running:
            rid = data.draw(st.sampled_from(running))
            pages = [p for t in mgr.page_table(rid) for p in t if p != NULL_PAGE]
            if pages:
                p = data.draw(st.sampled_from(pages))
                pool.incref([p])
                cache[p] += 1
        elif op == "cache_drop" and +cache:
            p = data.draw(st.sampled_from(sorted(+cache)))
            pool.decref([p])
            cache[p] -= 1
        elif op == "attach" and running:
            # a prefix hit at p on a source request's pages (as the prefix cache would give)
            src = reqs[data.draw(st.sampled_from(running))]
            p = data.draw(st.integers(0, src.num_computed_tokens))
            length = math.ceil(p / page_size)
            tables = []
            for g, table in zip(layout.groups, mgr.page_table(src.request_id)):
                need = needed_slots_fast(length, page_size, p, g.window)
                tables.append([table[i] if i in need else NULL_PAGE for i in range(length)])
            if all(
                t[i] != NULL_PAGE
                for t, g in zip(tables, layout.groups)
                for i in needed_slots_fast(length, page_size, p, g.window)
            ):
                req = Req(f"r{next_id}", p)
                next_id += 1
                mgr.attach_prefix(req.request_id, tables, p)
                reqs[req.request_id] = req
                allocated[req.request_id] = p
        check_all()

    for rid in list(reqs):
        mgr.free(reqs.pop(rid))
        mgr.check_integrity()
    for p in sorted(+cache):
        pool.decref([p] * cache.pop(p))
        mgr.check_integrity()
    assert pool.num_free == pool.capacity
    stats = mgr.stats()
    assert stats["pages_held_by_requests"] == 0 and stats["pages_held_by_others"] == 0
    assert all(g["pages_used"] == 0 for g in stats["groups"])


# ---- benchmark -----------------------------------------------------------------------------


def test_memory_bench_gemma3_270m():
    result = run_memory_bench(
        GEMMA3_270M, page_size=16, kv_heads=1, head_dim=256, context=8192, kv_cache_gb=2
    )
    ceiling = 18 * 8192 / (3 * 8192 + 15 * 512)
    assert result["ratio"] >= 4
    assert result["ratio"] <= ceiling + 1e-9
    # per request at 8192: full 512 pages + 5 swa groups x 32 pages, 3 layer slots each
    assert result["bytes_per_request"] == (512 + 5 * 32) * 3 * 2 * 16 * 256 * 2
    assert result["bytes_per_request_all_full"] == 512 * 18 * 2 * 16 * 256 * 2
    assert result["max_concurrent"] == 64 and result["max_concurrent_all_full"] == 14


def test_bench_from_hf_config():
    gemma = {
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 640,
        "sliding_window": 512,
        "layer_types": [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
        ],
    }
    assert layer_windows_from_config(gemma) == GEMMA3_270M
    assert main_from_config(gemma, 8192, 2, 16)["ratio"] >= 4
    mistral = {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "hidden_size": 512,
        "sliding_window": 64,
    }
    assert layer_windows_from_config(mistral) == [64] * 4
    llama = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512}
    assert layer_windows_from_config(llama) == [None] * 4
    r = main_from_config(llama, 1024, 0.01, 16)
    assert r["ratio"] == 1.0 and r["bytes_per_request"] == r["bytes_per_request_all_full"]
