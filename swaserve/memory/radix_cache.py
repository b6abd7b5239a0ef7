"""SWA-aware radix prefix cache over token ids, at page granularity (docs/architecture.md §5, §6).

Tree. A node covers whole pages of tokens [start, end), start = its parent's end, both
multiples of page_size (ps); the root covers nothing. Siblings differ in their first page, so
children are keyed by the tokens of that page. Per attention group g and slot i (the node's
page i, absolute slot start/ps + i):

    dev[g][i]      device page with the K/V of tokens [start + i*ps, start + (i+1)*ps), or NULL
    off[t][g][i]   copy of it in offload tier t (0 = host, 1 = disk, see host_cache.py), or NULL

A slot is *present* if it has a device page or an offload copy; an SWA slot present nowhere
is a tombstone. Full-group slots are always present (a full page is never dropped while its
node stays).

References and locks. The tree holds one pool reference per device page it lists; a request
using a page holds its own (its page table, through MemoryManager.attach_prefix). So

    a tree page is locked  <=>  pool.refcount(page) > 1, or its node is pinned.

A running request's table holds full pages back to the root and SWA pages for one window only
(the manager retires the rest), which is the lock rule of the design, kept by reference counts with
no bookkeeping of its own; eviction only drops pages of refcount 1, so it always frees them.
Pins are per node and short-lived: the scheduler pins a hit while it evicts to make room for
it, and a copy-on-write source stays pinned until the step's copies have run.

Match rule. With lo_g(p) = 0 for full groups and max(0, p - w + 1) for an SWA group of window
w, a reuse point p is valid iff every slot holding a key of [lo_g(p), p) is present, for every
group (the first new query, at p, sees keys p - w < k <= p; key p is its own). The tokens are
matched page by page and then into one more page; the longest valid p wins (below one page:
a miss, not worth a page copy):

    tokens    |== page ==|== page ==|== page ==|=== p            (p may end mid-page)
    full      [ present  | present  | present  | present ]
    swa       [ NULL     | present  | present  | present ]       slots of keys [p - w + 1, p)
    request   [ NULL     | shared   | shared   | own copy]       the page holding p is copied:
                                                                 the request writes it from p on

Insertion. After every step, each request's computed full pages enter the tree (prompt and
generated tokens alike); the tree takes its own references, so pages the request retires or
frees stay cached. Slots the request already retired enter as tombstones, never as NULL page
ids; tombstones on the path are revived from the request's live pages. A leaf that the
request extends grows in place; a divergence splits a node at a page boundary.

Eviction, only under pressure (`evict(n)`, bounded by n):
  1. SWA pages outside the *tail window* of their node (the slots of keys [end - w + 1, end)
     inside the node), least recently used node first. They become tombstones.
  2. Device leaves (nodes with device pages, none below them), LRU, with all their pages:
     written to the first offload tier (full pages, and the SWA tail window only) if there is
     one, else the node is removed. Tail windows therefore go last, with their node, and
     every branch end stays a valid reuse point. A node made by a split may lack its tail
     window; if it becomes a leaf with an unusable end it is removed (or, while a request
     still uses its pages, kept as a suspect and removed once that request lets go).
     A leaf that running requests share only up to some slot (they hit it mid-way) has its
     unshared tail split off and evicted the same way.
  3. Last resort, still short: the tail windows of internal nodes (their ends stop being
     reuse points). With 2 and 3, a request running alone can always get every page the
     tree holds that it does not use itself: it is never aborted for the cache's sake.
Offload tiers make room the same way: redundant copies first, then demotion to the next tier
(host -> disk), then leaves that live only there.
Steps 1 and 2 take their nodes from queues kept across evictions (`lru_queue.py`), so an
admission into a full cache costs what it evicts, not a walk of the whole tree.

Loads. A hit on offloaded slots loads them back into fresh device pages of the tree (in-window
slots only for SWA groups); `attach` queues the loads and `move_pages` flushes them, on their
own stream on CUDA (host_cache.py), so they overlap the forwards of other requests:

    - each device page a load (or a copy-on-write after it) writes is *in flight* until its
      flush has landed: the cache holds one more pool reference to it (`_inflight`), so it
      is never evicted, dropped or handed out again meanwhile, whoever lets go of it
      (a request aborted, finished or preempted with loads in flight just drops its own
      references; nothing waits);
    - the offload copies of a node with a page in flight stay where they are until it landed
      (not dropped as redundant, not demoted): the load may be reading them, and a freed
      offload page can take another node's store in the same flush;
    - a request whose table holds an in-flight page (its own loads, or another request's
      that bring in pages it shares) records the flush it needs (`_waits`);
      `loads_pending(id)` stays true until that flush landed, and the scheduler keeps the
      request out of the forward meanwhile (counted in `host_load_waits`); the first false
      orders the compute stream after the flush. On CPU copies are synchronous: never true;
    - `evict` that falls short while pages are in flight waits for the loads and tries again
      (rather than preempting); `wait_loads` blocks when nothing else can run.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swaserve.memory.host_cache import OffloadPool, PageMover, config_tiers
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.lru_queue import LruQueue
from swaserve.memory.manager import MemoryManager
from swaserve.memory.pool import NULL_PAGE

NULL = NULL_PAGE
_serials = itertools.count()


class ComputedRequest(Protocol):
    request_id: str
    num_computed_tokens: int  # tokens whose K/V are in its page tables

    def tokens(self, start: int, end: int) -> list[int]: ...


class Node:
    __slots__ = (
        "parent",
        "key",
        "start",
        "n_slots",
        "children",
        "child_keys",
        "dev",
        "off",
        "last_access",
        "pins",
        "num_dev",
        "dev_kids",
        "num_off",
        "serial",
    )

    def __init__(
        self,
        parent: Node | None,
        key: list[int],
        start: int,
        n_slots: int,
        num_groups: int,
        num_tiers: int,
    ) -> None:
        self.parent = parent
        self.key = key
        self.start = start
        self.n_slots = n_slots
        self.children: dict[tuple[int, ...], Node] = {}
        # the children's keys, sorted: a partial page's best match is a neighbour (match)
        self.child_keys: list[tuple[int, ...]] = []
        self.dev = [[NULL] * n_slots for _ in range(num_groups)]
        self.off = [[[NULL] * n_slots for _ in range(num_groups)] for _ in range(num_tiers)]
        self.last_access = 0
        self.pins = 0
        self.num_dev = 0  # non-NULL entries of dev
        # children whose subtree holds a device page: a device leaf is num_dev > 0 and
        # dev_kids == 0 (kept by RadixCache._set_dev and _split)
        self.dev_kids = 0
        self.num_off = [0] * num_tiers  # non-NULL entries of off[t]
        self.serial = next(_serials)  # ties of last_access: oldest node first (deterministic)

    def dev_below(self) -> bool:
        """Some node of this subtree (this one included) holds a device page."""
        return self.num_dev > 0 or self.dev_kids > 0

    def lru_key(self) -> tuple[int, int]:
        return (self.last_access, self.serial)

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def __repr__(self) -> str:
        return f"Node[{self.start}, {self.end}) dev={self.num_dev} off={self.num_off}"


@dataclass
class PrefixHit:
    """The longest valid reuse point of a token sequence. Valid until the tree changes."""

    num_tokens: int = 0  # p: tokens reused (0: a miss)
    slots: list[tuple[Node, int]] = field(default_factory=list)  # slots [0, ceil(p / ps))
    live_from: list[int] = field(default_factory=list)  # per group: first slot referenced
    extra_pages: int = 0  # device pages `attach` allocates: loads and copy-on-write

    @property
    def nodes(self) -> list[Node]:
        out: list[Node] = []
        for node, _ in self.slots:
            if not out or out[-1] is not node:
                out.append(node)
        return out


def _common(a: Sequence[int], a0: int, b: Sequence[int], b0: int, m: int) -> int:
    """Length of the common prefix of a[a0:a0+m] and b[b0:b0+m] (both long enough)."""
    if a[a0 : a0 + m] == b[b0 : b0 + m]:
        return m
    k = 0
    while a[a0 + k] == b[b0 + k]:
        k += 1
    return k


def _add_child(parent: Node, node: Node, ps: int) -> None:
    key = tuple(node.key[:ps])
    assert key not in parent.children
    parent.children[key] = node
    bisect.insort(parent.child_keys, key)


def _drop_child(parent: Node, node: Node, ps: int) -> None:
    key = tuple(node.key[:ps])
    del parent.children[key]
    keys = parent.child_keys
    del keys[bisect.bisect_left(keys, key)]


def _closest_children(node: Node, query: Sequence[int]) -> list[Node]:
    """The children that may share the most leading tokens with `query` (at most a page):
    in sorted order, the longest common prefix with a query is found next to where the
    query would go, so two comparisons instead of one per child (a node under a shared chat
    template has a child per distinct user message)."""
    keys = node.child_keys
    i = bisect.bisect_left(keys, tuple(query))
    return [node.children[keys[j]] for j in (i - 1, i) if 0 <= j < len(keys)]


class RadixCache:
    def __init__(
        self,
        memory: MemoryManager,
        kv: KVPool | None = None,
        tiers: Sequence[OffloadPool] = (),
        write_through: bool = False,
    ) -> None:
        if tiers and kv is None:
            raise ValueError("offload tiers need the device KV pool")
        self.memory = memory
        self.pool = memory.pool
        self.ps = memory.page_size
        self.groups = memory.layout.groups
        self.windows = [g.window if g.is_swa else None for g in self.groups]
        self.swa = [g.index for g in self.groups if g.is_swa]
        self.kv = kv
        self.tiers = list(tiers)
        self.mover = PageMover(kv, self.tiers) if kv is not None else None
        self.write_through = write_through
        self.root = Node(None, [], 0, 0, len(self.groups), len(self.tiers))
        self.nodes: set[Node] = set()  # every node but the root
        self._clock = itertools.count(1)
        self._lru: LruQueue[Node] = LruQueue()  # device leaves to evict, LRU first
        self._swa_lru: LruQueue[Node] = LruQueue()  # nodes whose out-of-window SWA pages may go
        # Nodes stamped since the SWA queue was last built (with an SWA group only): no other
        # node can have gained droppable pages since, so a rebuild takes these alone.
        self._touched: set[Node] | None = set() if self.swa else None
        self._swa_built = False
        self._tier_lru: list[LruQueue[Node]] = [LruQueue() for _ in self.tiers]  # _make_room
        self._inserted: dict[str, int] = {}  # request -> tokens of it already inserted
        self._suspects: set[Node] = set()  # leaves with an unusable end, kept while in use
        self._step_pins: list[Node] = []  # copy-on-write sources, until move_pages
        self._busy: set[Node] = set()  # nodes an eviction is working on: not to be removed
        self._num_pins = 0
        self._inflight: dict[int, int] = {}  # device page -> flush of the copy into/from it
        self._waits: dict[str, int] = {}  # request -> flush its hit needs landed
        # Counters (memory_stats): device pages held, tokens looked up / reused, pages moved.
        self.num_dev = 0
        # the nodes with num_dev > 0: the device-leaf queue's rebuild looks at these only,
        # not at every node (a host tier keeps many nodes with no device page)
        self._dev_nodes: set[Node] = set()
        self.query_tokens = 0
        self.hit_tokens = 0
        self.num_hits = 0
        self.evicted_pages = 0
        self.loaded_pages = 0
        self.stored_pages = 0
        self.load_waits = 0  # steps a request was held out of the forward for its loads
        memory.register_external_holder(self.refs)
        memory.register_integrity_check(self.check_integrity)

    # ---- match and attach -----------------------------------------------------------------

    def match(self, tokens: Sequence[int], limit: int | None = None) -> PrefixHit:
        """The longest valid reuse point p <= limit (default len(tokens)) of `tokens`. Pure."""
        ps = self.ps
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        slots: list[tuple[Node, int]] = []
        node, pos, matched = self.root, 0, 0
        while pos < limit:
            m = min(ps, limit - pos)
            child = node.children.get(tuple(tokens[pos : pos + ps])) if m == ps else None
            if child is None:  # into one more page: the child sharing the most tokens
                best, r = None, 0
                for c in _closest_children(node, tokens[pos : pos + m]):
                    k = _common(c.key, 0, tokens, pos, m)
                    if k > r:
                        best, r = c, k
                if best is not None:
                    slots.append((best, 0))
                matched = pos + r
                break
            k = 1
            while (
                k < child.n_slots
                and pos + (k + 1) * ps <= limit
                and (child.key[k * ps : (k + 1) * ps] == tokens[pos + k * ps : pos + (k + 1) * ps])
            ):
                k += 1
            slots.extend((child, i) for i in range(k))
            pos += k * ps
            matched = pos
            if k < child.n_slots:
                m = min(ps, limit - pos)
                r = _common(child.key, k * ps, tokens, pos, m) if m > 0 else 0
                if r:
                    slots.append((child, k))
                matched = pos + r
                break
            node = child
        p = self._valid_len(slots, matched)
        if p < ps:
            p = 0  # less than a page (often just BOS): a page copy to save < ps tokens
        return self._hit(slots, p)

    def _present(self, node: Node, g: int, i: int) -> bool:
        return node.dev[g][i] != NULL or any(t[g][i] != NULL for t in node.off)

    def _lo(self, g: int, p: int) -> int:
        w = self.windows[g]
        return 0 if w is None else max(0, p - w + 1)

    def _valid_len(self, slots: list[tuple[Node, int]], p: int) -> int:
        """The longest valid reuse point <= p along `slots` (see the module docstring)."""
        if p == 0:
            return 0
        ps = self.ps
        # last_absent[g][s]: the highest slot <= s not present in group g, or -1.
        last_absent = []
        for g in range(len(self.groups)):
            row, la = [], -1
            for s, (node, i) in enumerate(slots):
                if not self._present(node, g, i):
                    la = s
                row.append(la)
            last_absent.append(row)
        while p > 0:
            new_p = p
            for g in range(len(self.groups)):
                lo = self._lo(g, p)
                if lo >= p:
                    continue
                t = last_absent[g][(p - 1) // ps]
                if t >= lo // ps:
                    new_p = min(new_p, t * ps)
            if new_p == p:
                return p
            p = new_p
        return 0

    def _hit(self, slots: list[tuple[Node, int]], p: int) -> PrefixHit:
        ps = self.ps
        length = -(-p // ps)
        live_from, extra = [], 0
        for g in range(len(self.groups)):
            lo = self._lo(g, p)
            live_from.append(min(lo // ps, length))
            for s in range(live_from[g], length):
                node, i = slots[s]
                partial = p % ps != 0 and s == length - 1
                needs_data = not (partial and lo >= p)
                if needs_data and node.dev[g][i] == NULL:
                    extra += 1  # loaded from an offload tier
                if partial:
                    extra += 1  # the request's own copy
        return PrefixHit(p, slots[:length], live_from, extra)

    def lock(self, hit: PrefixHit) -> None:
        """Pin the hit's nodes: no eviction touches them until `unlock`."""
        for node in hit.nodes:
            node.pins += 1
            self._num_pins += 1

    def unlock(self, hit: PrefixHit) -> None:
        for node in hit.nodes:
            assert node.pins > 0, "unlock without lock"
            node.pins -= 1
            self._num_pins -= 1
        self.tidy()

    def attach(self, request_id: str, hit: PrefixHit, num_prompt_tokens: int) -> None:
        """Give a fresh request the hit's pages: its page tables cover [0, p) (the caller then
        sets its num_computed_tokens to p). Loads offloaded slots back to the device and
        copies the page holding p. Needs `hit.extra_pages` free device pages."""
        self.query_tokens += num_prompt_tokens
        p = hit.num_tokens
        if p == 0:
            return
        ps = self.ps
        length = -(-p // ps)
        self._reap()  # pages whose loads landed are no longer in flight: nothing to wait for
        tables, own, src, dst = [], [], [], []
        for g in range(len(self.groups)):
            table = [NULL] * hit.live_from[g]
            for s in range(hit.live_from[g], length):
                node, i = hit.slots[s]
                if p % ps and s == length - 1:  # the page holding p: the request's own copy
                    page = self._alloc(1)[0]
                    own.append(page)
                    if self._lo(g, p) < p:
                        source = self._ensure_dev(node, g, i)
                        if source in self._inflight:  # being loaded: copy after the load
                            self.mover.copy([source], [page])
                            self._hold(source)
                            self._hold(page)
                        else:  # on the compute stream, in move_pages
                            src.append(source)
                            dst.append(page)
                            if node not in self._step_pins:
                                node.pins += 1
                                self._num_pins += 1
                                self._step_pins.append(node)
                    table.append(page)
                else:
                    table.append(self._ensure_dev(node, g, i))
            tables.append(table)
        self.memory.attach_prefix(request_id, tables, p)
        self.pool.decref(own)  # the request is now their only holder
        if src:
            self.memory.copy_pages(src, dst)
        if self._inflight:
            after = [self._inflight[q] for t in tables for q in t if q in self._inflight]
            if after:
                self._waits[request_id] = max(after)
        stamp = next(self._clock)
        for node in hit.nodes:
            self._touch(node, stamp)
        self.hit_tokens += p
        self.num_hits += 1

    def _ensure_dev(self, node: Node, g: int, i: int) -> int:
        """The slot's device page, loaded from the nearest offload tier if it has none."""
        page = node.dev[g][i]
        if page != NULL:
            return page
        t = next(t for t in range(len(self.tiers)) if node.off[t][g][i] != NULL)
        page = self._alloc(1)[0]
        self._set_dev(node, g, i, page)
        self.mover.load(t, [node.off[t][g][i]], [page])
        self._hold(page)
        self.loaded_pages += 1
        return page

    def _hold(self, page: int) -> None:
        """Keep a device page out of reach until the next flush has landed (see Loads)."""
        if page not in self._inflight:
            self.pool.incref([page])
        self._inflight[page] = self.mover.next_flush

    def _reap(self) -> int:
        """Let go of the in-flight pages whose copies landed; returns pages that became free
        (a page the tree and every request had already dropped)."""
        if not self._inflight:
            return 0
        landed: dict[int, bool] = {}
        done = []
        for page, n in self._inflight.items():
            if n not in landed:
                landed[n] = self.mover.landed(n)
            if landed[n]:
                done.append(page)
        for page in done:
            del self._inflight[page]
        return len(self.pool.decref(done))

    def _drain(self) -> int:
        """Issue the queued copies and wait for every load; returns pages that became free."""
        self.mover.flush()
        self.mover.synchronize()
        return self._reap()

    def has_pending_loads(self) -> bool:
        """Some request's hit waits for loads (`loads_pending` can be true for someone)."""
        return bool(self._waits)

    def loads_pending(self, request_id: str) -> bool:
        """True while a load the request's hit needs has not landed: keep it out of the
        forward. The scheduler asks once per request and step; each true counts a held step
        (`host_load_waits`). The first false orders the compute stream after those loads.
        Always false on CPU (copies there are synchronous) and without pending loads."""
        n = self._waits.get(request_id)
        if n is None:
            return False
        if not self.mover.ready(n):
            self.load_waits += 1
            return True
        del self._waits[request_id]
        self.mover.wait(n)
        return False

    def wait_loads(self) -> None:
        """Block until every queued or in-flight load has landed (when nothing else can run:
        better than polling in a loop)."""
        if self.mover is not None and (self._inflight or self._waits or len(self.mover)):
            self._drain()

    def reset(self) -> int:
        """Drop every cached page, on the device and in the offload tiers (vLLM's
        reset_prefix_cache). Only while no request uses the tree: the caller checks that the
        engine is idle (no request, no step in flight). Returns the device pages freed."""
        assert not self._inserted and not self._num_pins and not self._step_pins, \
            "the prefix cache is reset only while no request uses it"
        self.wait_loads()
        self.move_pages()  # queued stores land (their slots are freed below) and pins drop
        freed, evicted = 0, self.evicted_pages
        for child in list(self.root.children.values()):
            for node in self._postorder(child):
                freed += self._remove_node(node)
        self._reap()
        self.evicted_pages = evicted  # a reset is no eviction under pressure (/metrics' count)
        # the queues' entries are all stale now: start them empty
        self._lru, self._swa_lru = LruQueue(), LruQueue()
        self._tier_lru = [LruQueue() for _ in self.tiers]
        self._suspects.clear()
        self._touched = set() if self.swa else None
        self._swa_built = False
        return freed

    def _alloc(self, n: int) -> list[int]:
        pages = self.pool.alloc(n)
        if pages is None:
            raise RuntimeError("prefix cache: no free device page (the caller reserves them)")
        return pages

    # ---- insert and release ---------------------------------------------------------------

    def insert(self, request: ComputedRequest) -> None:
        """Enter the request's computed full pages into the tree (idempotent, cheap when there
        is nothing new). Call it before the request retires or frees pages."""
        rid = request.request_id
        end = request.num_computed_tokens // self.ps * self.ps
        if end <= self._inserted.get(rid, 0) or rid not in self.memory:
            return
        swaps: list[tuple[int, int, int]] = []
        self._insert(request.tokens(0, end), self.memory.page_table(rid), swaps)
        if swaps:
            self.memory.share_pages(rid, swaps)
        self._inserted[rid] = end

    def release(self, request_id: str) -> None:
        """The request let go of its pages (finish, abort, preempt): forget it, and remove the
        suspects it was keeping alive."""
        self._inserted.pop(request_id, None)
        self._waits.pop(request_id, None)  # its in-flight pages stay held until they land
        self.tidy()

    def tidy(self) -> int:
        """Remove the suspects nobody uses any more (after pages were let go: free, retire,
        unpin). Returns device pages freed; cheap when there are none."""
        freed = 0
        for node in sorted(self._suspects, key=Node.lru_key):
            self._suspects.discard(node)
            if node in self.nodes:
                freed += self._tidy(node)
        return freed

    def _insert(self, tokens: list[int], tables: list[list[int]], swaps: list) -> None:
        ps, end = self.ps, len(tokens)
        # Below first_live[g] the request's table is NULL (retired): nothing to adopt there.
        first_live = [next((s for s, p in enumerate(t) if p != NULL), len(t)) for t in tables]
        node, pos = self.root, 0
        stamp = next(self._clock)
        while pos < end:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                if node is not self.root and not node.children:
                    self._extend(node, tokens[pos:end], tables)
                else:
                    node = self._new_node(node, tokens[pos:end], tables)
                self._touch(node, stamp)
                break
            n = min(len(child.key), end - pos) // ps
            k = n if child.key[: n * ps] == tokens[pos : pos + n * ps] else 1
            while (
                k < n
                and child.key[k * ps : (k + 1) * ps] == tokens[pos + k * ps : pos + (k + 1) * ps]
            ):
                k += 1
            if k < child.n_slots and pos + k * ps < end:
                child = self._split(child, k)  # the request diverges after page k
            self._adopt(child, min(k, child.n_slots), tables, first_live, swaps)
            self._touch(child, stamp)
            pos += k * ps
            node = child
        # The table may hold nothing live for the new slots (window 1 and no full group: a
        # page-aligned hit references no page, and its path may have been evicted since):
        # a leaf that cannot be reused at its end goes now, or once the request lets go.
        self._tidy(node)

    def _adopt(self, node: Node, upto: int, tables: list[list[int]], first_live, swaps) -> None:
        """Node slots [0, upto) hold the request's tokens at the same positions, so the same
        K/V: revive tombstones (and offload-only slots) with the request's live pages, and
        where both have a device page (the request computed it while another did the same),
        the request shares the tree's and lets go of its own (`swaps`: group, slot, page), so
        its table holds the tree's pages of its path, which its references lock, and its
        duplicates go back to the pool. Not a page still being loaded (the request would
        have to wait for it)."""
        s0 = node.start // self.ps
        for g, table in enumerate(tables):
            row = node.dev[g]
            lo, hi = max(0, first_live[g] - s0), min(upto, len(table) - s0)
            if row[lo:hi] == table[s0 + lo : s0 + hi]:
                continue  # the usual case, compared at C speed: the same pages
            for i in range(lo, hi):
                page = table[s0 + i]
                if page == NULL or row[i] == page:
                    continue
                if row[i] == NULL:
                    self.pool.incref([page])
                    self._set_dev(node, g, i, page)
                elif row[i] not in self._inflight:
                    swaps.append((g, s0 + i, row[i]))

    def _new_node(self, parent: Node, key: list[int], tables: list[list[int]]) -> Node:
        node = Node(parent, key, parent.end, len(key) // self.ps, len(self.groups), len(self.tiers))
        _add_child(parent, node, self.ps)
        self.nodes.add(node)
        self._fill(node, 0, tables)
        return node

    def _extend(self, node: Node, key: list[int], tables: list[list[int]]) -> None:
        """Grow a leaf in place (its end, hence its tail window, moves forward)."""
        old = node.n_slots
        node.key = node.key + key
        node.n_slots += len(key) // self.ps
        extra = node.n_slots - old
        for g in range(len(self.groups)):
            node.dev[g].extend([NULL] * extra)
            for t in node.off:
                t[g].extend([NULL] * extra)
        self._fill(node, old, tables)

    def _fill(self, node: Node, first: int, tables: list[list[int]]) -> None:
        """Take references to the request's pages for node slots [first, n_slots)."""
        s0 = node.start // self.ps
        for g, table in enumerate(tables):
            for i in range(first, node.n_slots):
                page = table[s0 + i]
                if page != NULL:
                    self.pool.incref([page])
                    self._set_dev(node, g, i, page)
                else:
                    assert self.windows[g] is not None, "a full-group page table has a hole"
        if self.write_through and self.tiers:
            keep = [
                (g, i)
                for g in range(len(self.groups))
                if self.windows[g] is None
                for i in range(first, node.n_slots)
            ]
            self._busy.add(node)
            try:
                self._store(node, keep)  # best effort: skipped when no tier has room
            finally:
                self._busy.discard(node)

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node` after k slots; returns the new upper node (`node` keeps the rest, so
        references to it stay valid)."""
        assert 0 < k < node.n_slots and not node.pins
        ps, parent = self.ps, node.parent
        top = Node(parent, node.key[: k * ps], node.start, k, len(self.groups), len(self.tiers))
        top.dev = [row[:k] for row in node.dev]
        top.off = [[row[:k] for row in t] for t in node.off]
        node.dev = [row[k:] for row in node.dev]
        node.off = [[row[k:] for row in t] for t in node.off]
        node.key = node.key[k * ps :]
        node.start += k * ps
        node.n_slots -= k
        for n in (top, node):
            n.num_dev = sum(p != NULL for row in n.dev for p in row)
            n.num_off = [sum(p != NULL for row in t for p in row) for t in n.off]
            if n.num_dev:
                self._dev_nodes.add(n)
            else:
                self._dev_nodes.discard(n)
        # `top` holds a device page below it iff the old node did: the parent's count stands
        top.dev_kids = int(node.dev_below())
        parent.children[tuple(top.key[:ps])] = top  # same first page as `node`: same key
        _add_child(top, node, ps)
        node.parent = top
        self.nodes.add(top)
        self._touch(top, node.last_access)  # holds out-of-window pages `node` had
        for t, q in enumerate(self._tier_lru):
            if top.num_off[t]:
                q.push(top)  # and copies `node` had in the tiers
        return top

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_pages: int, swa_only: bool = False) -> int:
        """Free at least `num_pages` device pages if the unlocked cache holds that many (bounded
        joint reclaim, called before preempting). Returns the pages freed."""
        if num_pages <= 0:
            return 0
        start = self.evicted_pages  # counts every device page the tree's drops free
        freed = self._reap()  # in-flight pages nobody else holds any more
        goal = start + num_pages - freed
        while True:
            self.tidy()
            self._evict_swa(goal)
            # A pass sees the device leaves of its start; evictions can make more (an
            # offloaded leaf removed to make room leaves its parent a device leaf): pass again
            # until none.
            while not swa_only and self.evicted_pages < goal and self._evict_leaves(goal):
                pass
            for level in (1, 2):
                # Last resort, before a request is preempted or found not to fit: the tail
                # windows of internal nodes (their ends stop being reuse points).
                if not swa_only and self.evicted_pages < goal:
                    self._evict_swa(goal, level)
            if self.evicted_pages >= goal or not self._inflight:
                break
            # Short, and copies in flight hold pages: wait for them (better than preempting).
            n = self._drain()
            freed += n
            goal -= n
        return self.evicted_pages - start + freed

    def _tail(self, node: Node, g: int) -> int:
        """Index in the node of its first tail-window slot for SWA group g."""
        lo = max(0, node.end - self.windows[g] + 1)
        if lo >= node.end:
            return node.n_slots  # window 1: a page-aligned end needs no key
        return max(0, lo // self.ps - node.start // self.ps)

    def _touch(self, node: Node, stamp: int) -> None:
        node.last_access = stamp
        if self._touched is not None:
            self._touched.add(node)

    def _evict_swa(self, goal: int, level: int = 0) -> None:
        """Drop SWA device pages nobody else holds, LRU node first.

        level 0: outside each node's tail window (they become tombstones). The nodes come
                 from a queue kept across evictions (`LruQueue`, rebuilt when it runs dry),
                 not from a sort of the whole tree on every call.
        level 1, last resort: inside the tail windows of internal nodes too, where no leaf
                 below reads them at its end (a leaf shorter than the window reaches up) or
                 where an offload copy keeps the slot present.
        level 2, still short: every SWA page of internal nodes; the leaves whose end needed
                 one are removed after (`_tidy`).
        A leaf's own tail window goes only with the leaf (`_evict_leaves`)."""
        if not self.swa:
            return  # no SWA group: nothing to drop here (and no walk of every node)
        if level == 0:
            self._evict_swa_queued(goal)
            return
        # Internal nodes with device pages, not every node: an eviction that falls short runs
        # these last resorts each time, and a host tier keeps thousands of host-only nodes.
        nodes = sorted((n for n in self._dev_nodes if n.children), key=Node.lru_key)
        reach = self._leaf_reach(nodes) if level == 1 else {}
        dropped: list[Node] = []
        for node in nodes:
            if self.evicted_pages >= goal:
                break
            if node.pins or node.num_dev == 0 or node not in self.nodes or not node.children:
                continue
            before = self.evicted_pages
            self._drop_swa(node, goal, level, reach)
            if self.evicted_pages > before:
                dropped.append(node)
        if level == 2:
            # The ends that read a dropped page lie below the node that had it: they go (or
            # wait as suspects). Every other leaf's end was valid or a suspect already.
            # (dropped nodes may nest: each leaf once)
            leaves = dict.fromkeys(n for top in dropped if top in self.nodes
                                   for n in self._postorder(top) if not n.children)
            for leaf in leaves:
                self._tidy(leaf)

    def _evict_swa_queued(self, goal: int) -> None:
        """Level 0 of `_evict_swa` over the kept queue: a node leaves it once nothing it
        holds outside its tail window can go; one cut short by `goal`, pinned, or with such
        pages a request still holds goes back for the next eviction."""
        q = self._swa_lru
        retry: list[Node] = []
        for node in q.drain(self._swa_candidates, lambda: self.evicted_pages >= goal):
            if node not in self.nodes or node.num_dev == 0:
                continue
            if node.pins:
                retry.append(node)
                continue
            if self._drop_swa(node, goal, 0, {}):
                retry.append(node)
            if not node.children:
                self._tidy(node)  # window 1 and no full group: a leaf may be left empty
        for node in retry:
            if node in self.nodes:
                q.push(node)

    def _swa_candidates(self) -> list[Node]:
        """The SWA queue's nodes: every node once, then only those stamped since (a node left
        out has had its droppable pages dropped, or waits in the queue for a request to let
        go)."""
        fresh = self._touched if self._swa_built else self.nodes
        out = [n for n in fresh if n in self.nodes and n.num_dev > 0]
        self._touched.clear()
        self._swa_built = True
        return out

    def _drop_swa(self, node: Node, goal: int, level: int, reach: dict[Node, list[int]]) -> bool:
        """Drop the node's SWA device pages that `level` allows and nobody else holds, until
        `goal`. True if some such page stayed: held by a request, or left for `goal`."""
        left = False
        for g in self.swa:
            row = node.dev[g]
            if level == 0:
                stop = self._tail(node, g)
            elif level == 1:  # the slots whose keys all lie before every leaf window below
                stop = min(node.n_slots, max(0, (reach[node][g] - node.start) // self.ps))
            else:
                stop = node.n_slots
            for i in range(node.n_slots if level == 1 else stop):
                if row[i] == NULL:
                    continue
                if i >= stop and not any(t[g][i] != NULL for t in node.off):
                    continue
                if self.evicted_pages >= goal or self.pool.refcount(row[i]) != 1:
                    left = True
                    continue
                self._drop_dev(node, g, i)
        return left

    def _leaf_reach(self, tops: Iterable[Node]) -> dict[Node, list[int]]:
        """Per node at or below `tops`, per group: the first key some leaf at or below it
        reads at its end (the smallest lo_g(leaf end)); large for full groups, which never
        drop pages here. Each subtree is walked once, children before parents."""
        reach: dict[Node, list[int]] = {}
        for top in tops:
            stack = [(top, False)]
            while stack:
                n, seen = stack.pop()
                if n in reach:
                    continue
                if not seen:
                    stack.append((n, True))
                    stack.extend((c, False) for c in n.children.values() if c not in reach)
                elif n.children:
                    kids = [reach[c] for c in n.children.values()]
                    reach[n] = [min(k[g] for k in kids) for g in range(len(self.groups))]
                else:
                    reach[n] = [
                        n.end if w is None else self._lo(g, n.end)
                        for g, w in enumerate(self.windows)
                    ]
        return reach

    def _evictable(self, node: Node) -> bool:
        if node.pins:
            return False
        return all(p == NULL or self.pool.refcount(p) == 1 for row in node.dev for p in row)

    def _leaf_candidates(self) -> list[Node]:
        """Device leaves (device pages, none below them) whose last slot no request holds.

        A leaf whose last slot a request still holds can give nothing (`_evictable` and
        `_evict_tail` both refuse it): every running request's own leaf is one, so it is left
        out rather than popped and dropped again on every admission that evicts."""
        return [n for n in self._dev_nodes if not n.dev_kids and not self._held_to_end(n)]

    def _evict_leaves(self, goal: int) -> bool:
        """Device leaves, LRU first, from the queue kept across evictions (`LruQueue`: built
        from the nodes with device pages only when it has run dry, at most once a call). True
        if it evicted any."""
        q = self._lru
        retry: list[Node] = []  # pinned or busy now: candidates again next time
        progress = False
        for node in q.drain(self._leaf_candidates, lambda: self.evicted_pages >= goal):
            if node not in self.nodes or node.num_dev == 0:
                continue
            if node.dev_kids:
                continue  # no longer a leaf (a node stamped on the way would be stale)
            if not self._evictable(node):
                if self._evict_tail(node, goal):
                    progress = True
                elif node.pins or node in self._busy:
                    retry.append(node)
                continue
            parent = node.parent
            self._evict_node(node)
            progress = True
            a = parent
            while a is not self.root and a not in self.nodes:
                a = a.parent  # removed by _tidy along with the node: its parent still links up
            while a is not self.root and not a.dev_kids:  # the first with device pages above
                if a.num_dev > 0:
                    q.push(a)  # a device leaf now
                    break
                a = a.parent
        for node in retry:
            q.push(node)
        return progress

    def _slot_held(self, node: Node, i: int) -> bool:
        """Some request holds slot i of the node (a page there shared beyond the tree)."""
        return any(row[i] != NULL and self.pool.refcount(row[i]) > 1 for row in node.dev)

    def _held_to_end(self, node: Node) -> bool:
        return node.n_slots > 0 and self._slot_held(node, node.n_slots - 1)

    def _evict_tail(self, node: Node, goal: int) -> bool:
        """A device leaf that running requests use only up to some slot (they hit it mid-way):
        split the unshared tail off and evict it like a leaf. Bounded: the tail holds the
        pages `goal` still needs, cut further up where the part kept then ends at a valid
        reuse point; with none before the shared slots, the whole unshared tail goes. True if
        it evicted anything."""
        if node.pins or node in self._busy:
            return False
        # The first slot past the last one a request still holds, found from the end: a
        # running request's own leaf (shared to its last slot) costs one slot's look, not a
        # walk of its pages (every admission that evicts passes each running leaf here).
        shared = node.n_slots
        while shared > 0 and not self._slot_held(node, shared - 1):
            shared -= 1
        if shared == 0 or shared >= node.n_slots:
            return False
        cut, freed = node.n_slots, 0
        while cut > shared and self.evicted_pages + freed < goal:
            cut -= 1
            freed += sum(row[cut] != NULL for row in node.dev)
        while cut > shared and not self._end_valid(node, cut):
            cut -= 1
        if not self._end_valid(node, cut):
            cut = shared  # the upper part cannot be reused at its end anyway: take it all
        self._split(node, cut)  # `node` keeps the tail
        self._evict_node(node)
        return True

    def _evict_node(self, node: Node) -> int:
        """A device leaf leaves the device: to the first offload tier (full pages and the SWA
        tail window), or out of the tree with what hangs below it (nothing on device)."""
        if self.tiers:
            keep = [
                (g, i)
                for g in range(len(self.groups))
                for i in range(self._tail(node, g) if self.windows[g] else 0, node.n_slots)
            ]
            self._busy.add(node)
            try:
                stored = self._store(node, keep)
            finally:
                self._busy.discard(node)
            if stored:
                freed = 0
                for g in range(len(self.groups)):
                    for i in range(node.n_slots):
                        if node.dev[g][i] != NULL:
                            self._drop_dev(node, g, i)
                            freed += 1
                return freed
        return self._remove_subtree(node)

    def _store(self, node: Node, slots: list[tuple[int, int]]) -> bool:
        """Copy the node's device pages at `slots` to the first offload tier with room for
        them all (making room, LRU), unless some tier already has them. False (nothing done)
        when no tier can take them."""
        todo = [
            (g, i)
            for g, i in slots
            if node.dev[g][i] != NULL and not any(t[g][i] != NULL for t in node.off)
        ]
        if not todo:
            return True
        for t, tier in enumerate(self.tiers):
            if len(todo) <= tier.capacity and self._make_room(t, len(todo)):
                pages = tier.alloc(len(todo))
                for (g, i), h in zip(todo, pages):
                    self._set_off(node, t, g, i, h)
                self.mover.store([node.dev[g][i] for g, i in todo], t, pages)
                self.stored_pages += len(todo)
                return True
        return False

    def _make_room(self, t: int, n: int) -> bool:
        """Free n pages of offload tier t: drop redundant copies, demote to tier t + 1, remove
        leaves living only in the offload tiers; least recently used first. The nodes come
        from the tier's queue (`LruQueue`: a node is pushed when it gets its first copy
        there, all of them again when the queue runs dry), not from a sort of the tree on
        every store."""
        pool = self.tiers[t]
        q = self._tier_lru[t]
        retry: list[Node] = []  # pinned, busy or loading now: candidates again next time

        def in_tier() -> list[Node]:
            return [x for x in self.nodes if x.num_off[t]]

        for node in q.drain(in_tier, lambda: pool.num_free >= n):
            if node not in self.nodes or node.num_off[t] == 0:
                continue
            if node.pins or node in self._busy or self._loading(node):
                retry.append(node)
                continue
            for g in range(len(self.groups)):
                for i in range(node.n_slots):
                    h = node.off[t][g][i]
                    deeper = any(x[g][i] != NULL for x in node.off[t + 1 :])
                    if h != NULL and (node.dev[g][i] != NULL or deeper):
                        self._set_off(node, t, g, i, NULL)
                        pool.free([h])
            if node.num_off[t] and t + 1 < len(self.tiers):
                self._busy.add(node)
                try:
                    self._demote(node, t)
                finally:
                    self._busy.discard(node)
            if node.num_off[t] and node.num_dev == 0 and not node.children:
                parent = node.parent
                self._remove_node(node)
                self._tidy(parent)
                if parent in self.nodes and parent.num_off[t]:
                    q.push(parent)  # a leaf living in the tiers now, perhaps
            # A node that keeps copies here is an internal one (or its demotion found no
            # room): it comes back when a child's removal pushes it, or at the next build.
        for node in retry:
            q.push(node)
        return pool.num_free >= n

    def _loading(self, node: Node) -> bool:
        """A device page of the node is still being written by a load (or a copy): its offload
        copies may be the load's source, so none of them is dropped, moved or reused until
        the load landed (a store into a reused host page would overwrite what the load
        reads). Loaded nodes are the most recently used: skipping them costs little."""
        return bool(self._inflight) and any(
            p in self._inflight for row in node.dev for p in row if p != NULL
        )

    def _demote(self, node: Node, t: int) -> None:
        slots = [
            (g, i)
            for g in range(len(self.groups))
            for i in range(node.n_slots)
            if node.off[t][g][i] != NULL
        ]
        if not self._make_room(t + 1, len(slots)):
            return
        pages = self.tiers[t + 1].alloc(len(slots))
        src = [node.off[t][g][i] for g, i in slots]
        self.mover.move(t, src, t + 1, pages)
        for (g, i), d in zip(slots, pages):
            self._set_off(node, t + 1, g, i, d)
            self._set_off(node, t, g, i, NULL)
        self.tiers[t].free(src)

    def _remove_subtree(self, node: Node) -> int:
        """Remove a node and everything below it (nothing below may be on device)."""
        parent = node.parent
        freed = 0
        for n in self._postorder(node):
            freed += self._remove_node(n)
        return freed + self._tidy(parent)

    def _remove_node(self, node: Node) -> int:
        """Take a node out of the tree (its children must be gone); returns device pages freed."""
        assert not node.pins and node in self.nodes
        for c in node.children.values():
            assert c not in self.nodes, "removing a node that still has children"
        freed = 0
        for g in range(len(self.groups)):
            for i in range(node.n_slots):
                if node.dev[g][i] != NULL:
                    freed += self._drop_dev(node, g, i)
                for t, tier in enumerate(node.off):
                    if tier[g][i] != NULL:
                        self.tiers[t].free([tier[g][i]])
                        self._set_off(node, t, g, i, NULL)
        _drop_child(node.parent, node, self.ps)
        self.nodes.discard(node)
        self._suspects.discard(node)
        if self._touched is not None:
            self._touched.discard(node)
        return freed

    def _tidy(self, node: Node) -> int:
        """Remove leaves that can never be reused at their end (nothing present, or a tail
        window with a tombstone), upwards; a leaf still in use stays a suspect (see `tidy`).
        Returns device pages freed."""
        freed = 0
        while node is not self.root and node in self.nodes and not node.children:
            has_pages = node.num_dev > 0 or any(node.num_off)
            if has_pages and self._end_valid(node):
                break
            if node in self._busy or not self._evictable(node):
                self._suspects.add(node)
                break
            parent = node.parent
            freed += self._remove_node(node)
            node = parent
        return freed

    def _end_valid(self, node: Node, upto: int | None = None) -> bool:
        """The node's end (or the end of its first `upto` slots) is a valid reuse point (SWA
        windows; full slots are always present)."""
        upto = node.n_slots if upto is None else upto
        end = node.start + upto * self.ps
        for g in self.swa:
            first = self._lo(g, end) // self.ps
            n, last = node, upto
            while n is not self.root:
                s0 = n.start // self.ps
                for i in range(last - 1, max(first - s0, 0) - 1, -1):
                    if not self._present(n, g, i):
                        return False
                if s0 <= first:
                    break
                n = n.parent
                last = n.n_slots
        return True

    # ---- data movement --------------------------------------------------------------------

    def move_pages(self) -> None:
        """Before the forward: issue the queued offload copies (stores, loads, in order; the
        forward waits for the stores only, see Loads), then the copy-on-write pairs recorded
        by attach, then let go of copy sources and of in-flight pages whose loads landed."""
        if self.mover is not None:
            self.mover.flush()
        pairs = self.memory.take_copies()
        if pairs:
            assert self.mover is not None, "copy-on-write needs the KV pool"
            self.mover.copy_now([s for s, _ in pairs], [d for _, d in pairs])
        for node in self._step_pins:
            node.pins -= 1
            self._num_pins -= 1
        self._step_pins.clear()
        self._reap()
        self.tidy()

    # ---- accounting -----------------------------------------------------------------------

    def _set_dev(self, node: Node, g: int, i: int, page: int) -> None:
        old = node.dev[g][i]
        node.dev[g][i] = page
        delta = (page != NULL) - (old != NULL)
        if not delta:
            return
        node.num_dev += delta
        self.num_dev += delta
        if node.num_dev == (delta > 0):  # 0 -> 1 or 1 -> 0: the node gained or lost its last
            if delta > 0:
                self._dev_nodes.add(node)
            else:
                self._dev_nodes.discard(node)
            if not node.dev_kids:  # and with it its subtree: tell the ancestors
                self._dev_flip(node, delta > 0)

    @staticmethod
    def _dev_flip(node: Node, on: bool) -> None:
        """`node`'s subtree went from no device page to some (`on`) or back: count it in its
        parent's dev_kids, and so on up while an ancestor's own answer flips too."""
        step = 1 if on else -1
        while node.parent is not None:
            parent = node.parent
            was = parent.dev_below()
            parent.dev_kids += step
            if was == parent.dev_below():
                return
            node = parent

    def _drop_dev(self, node: Node, g: int, i: int) -> int:
        """Drop the tree's reference to a device page; returns 1 if the page became free."""
        page = node.dev[g][i]
        self._set_dev(node, g, i, NULL)
        freed = len(self.pool.decref([page]))
        self.evicted_pages += freed
        return freed

    def _set_off(self, node: Node, t: int, g: int, i: int, page: int) -> None:
        old = node.off[t][g][i]
        node.off[t][g][i] = page
        node.num_off[t] += (page != NULL) - (old != NULL)
        if page != NULL and old == NULL and node.num_off[t] == 1:
            q = self._tier_lru[t]
            q.push(node)  # its first copy in tier t: a candidate there
            if len(q) > 2 * len(self.nodes) + 64:  # pushed far more often than popped
                q.prune(lambda n: n in self.nodes and n.num_off[t] > 0)

    def _postorder(self, top: Node | None = None) -> list[Node]:
        """Nodes below `top` (default: all), children before parents; `top` included."""
        out: list[Node] = []
        stack = [(top or self.root, False)]
        while stack:
            n, seen = stack.pop()
            if seen:
                if n is not self.root:
                    out.append(n)
                continue
            stack.append((n, True))
            stack.extend((c, False) for c in n.children.values())
        return out

    def refs(self) -> Counter:
        """{device page: references the tree holds} (for MemoryManager.check_integrity)."""
        c: Counter = Counter()
        for n in self.nodes:
            for row in n.dev:
                c.update(p for p in row if p != NULL)
        c.update(self._inflight.keys())
        return c

    def stats(self) -> dict:
        tier = {t.name: t for t in self.tiers}
        return {
            "cache_pages": self.num_dev,
            "host_pages": tier["host"].num_used if "host" in tier else 0,
            "disk_pages": tier["disk"].num_used if "disk" in tier else 0,
            "cache_hit_tokens": self.hit_tokens,
            "cache_query_tokens": self.query_tokens,
            "cache_hits": self.num_hits,
            "cache_nodes": len(self.nodes),
            "evictions": self.evicted_pages,
            "host_loads": self.loaded_pages,
            "host_stores": self.stored_pages,
            "host_load_waits": self.load_waits,
        }

    def close(self) -> None:
        if self.mover is not None:
            self._drain()
        for t in self.tiers:
            t.close()

    def check_integrity(self) -> None:
        """Tree, tiers and pool agree (O(tree slots + request table entries)). For tests."""
        ps, G = self.ps, len(self.groups)
        seen = self._postorder()
        assert set(seen) == self.nodes, "node registry and tree differ"
        dev_owner: dict[int, int] = {}
        off_held: list[set[int]] = [set() for _ in self.tiers]
        num_dev, pins = 0, 0
        assert self.root.child_keys == sorted(self.root.children), "root: sorted child keys"
        for n in seen:
            where = repr(n)
            assert n.parent is not None and n.parent.children.get(tuple(n.key[:ps])) is n, where
            assert n.start == n.parent.end and n.n_slots > 0, where
            assert len(n.key) == n.n_slots * ps, f"{where}: key not whole pages"
            for c in n.children.values():
                assert c.parent is n, f"{where}: child's parent link"
            assert n.child_keys == sorted(n.children), f"{where}: sorted child keys"
            assert all(len(r) == n.n_slots for r in n.dev), f"{where}: dev rows"
            assert all(len(r) == n.n_slots for t in n.off for r in t), f"{where}: off rows"
            nd = 0
            for g in range(G):
                for i, p in enumerate(n.dev[g]):
                    if p != NULL:
                        nd += 1
                        assert p not in dev_owner, f"device page {p} held twice by the tree"
                        dev_owner[p] = g
                        assert self.pool.refcount(p) >= 1, f"tree page {p} is free"
                    if self.windows[g] is None:
                        assert self._present(n, g, i), f"{where}: full slot {i} lost"
            assert nd == n.num_dev, f"{where}: num_dev {n.num_dev} counted {nd}"
            assert (n in self._dev_nodes) == (nd > 0), f"{where}: device-node set"
            kids = sum(c.dev_below() for c in n.children.values())
            assert kids == n.dev_kids, f"{where}: dev_kids {n.dev_kids} counted {kids}"
            num_dev += nd
            for t, tier in enumerate(n.off):
                cnt = 0
                for row in tier:
                    for p in row:
                        if p != NULL:
                            cnt += 1
                            assert p not in off_held[t], f"tier {t} page {p} held twice"
                            off_held[t].add(p)
                assert cnt == n.num_off[t], f"{where}: num_off[{t}]"
            assert n.pins >= 0
            pins += n.pins
            if not n.children:
                assert nd or any(n.num_off) or n in self._suspects, (
                    f"{where}: a leaf with no page in any tier"
                )
                assert self._end_valid(n) or n in self._suspects, (
                    f"{where}: a leaf whose end cannot be reused, not a suspect"
                )
        assert num_dev == self.num_dev, "device page count drifted"
        assert len(self._dev_nodes) == sum(n.num_dev > 0 for n in seen), "device-node set"
        root_kids = sum(c.dev_below() for c in self.root.children.values())
        assert root_kids == self.root.dev_kids, "root: dev_kids"
        assert pins == self._num_pins, "pins drifted"
        for t, tier in enumerate(self.tiers):
            tier.check_integrity()
            assert tier.held() == off_held[t], f"tier {tier.name}: pool and tree disagree"
        for rid in self._inserted:
            assert rid in self.memory, f"insert cursor of a request without pages: {rid}"
        for rid, n in self._waits.items():
            assert rid in self.memory, f"a load wait of a request without pages: {rid}"
            assert n <= self.mover.next_flush, f"{rid} waits for a flush not queued: {n}"
        for p, n in self._inflight.items():
            assert self.pool.refcount(p) >= 1, f"in-flight page {p} is free"
            assert n <= self.mover.next_flush, f"in-flight page {p}: flush {n} not queued"
        for rid in self.memory.request_ids():
            for g, table in enumerate(self.memory.page_table(rid)):
                for p in table:
                    if p in dev_owner:
                        assert dev_owner[p] == g, f"page {p}: group {g} for a request, "
                        f"{dev_owner[p]} in the tree"


def build_prefix_cache(config, memory: MemoryManager, kv: KVPool, tp=None) -> RadixCache | None:
    """The cache an EngineConfig asks for: None with --disable-prefix-cache; offload tiers
    from --host-cache-gb / --disk-cache-dir / --disk-cache-gb, policy --host-cache-policy.
    `tp`: rank 0's TPGroup with T > 1 (the workers build their tiers alike, worker.py)."""
    if config.host_cache_policy not in ("write_back", "write_through"):
        raise ValueError(
            f"invalid host_cache_policy={config.host_cache_policy!r}: "
            "must be write_back or write_through"
        )
    if config.host_cache_gb < 0:
        raise ValueError(f"invalid host_cache_gb={config.host_cache_gb!r}: must be >= 0")
    disk_gb = config.disk_cache_gb
    if disk_gb is not None and not config.disk_cache_dir:
        raise ValueError("disk_cache_gb needs disk_cache_dir")
    if config.disable_prefix_cache:
        return None
    tiers = config_tiers(config, kv, tp)
    return RadixCache(memory, kv, tiers, write_through=config.host_cache_policy == "write_through")
