"""Eviction candidates in least-recently-used order, kept from one eviction to the next.

Finding the candidates walks the whole radix tree. Walking it on every eviction made each
admission into a full cache cost O(nodes): with ~50k cached prompts on smollm2, answering fell
to ~1.4 prompts a second, and /tmp-sized CPU runs of 5,000 short requests spent 37 of their 58 s
there (benchmarks/RESULTS.md, stop 29). The queue is built once and popped until it runs dry.

It stays in LRU order because every change that makes a node a candidate, or moves it in the
order, stamps the node with a fresh, larger `last_access` (insert, extend, a prefix hit): an
entry whose node's key has changed since it was pushed is stale and skipped. Such a node is
younger than every entry of the queue, so it loses nothing by waiting for the next build. The
one candidate that can appear without a stamp is a leaf whose request let go of it with no new
full page since its last insert: it waits for the next build, at most a page of decode steps
out of order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar


class Stamped(Protocol):
    def lru_key(self) -> tuple[int, int]: ...


N = TypeVar("N", bound=Stamped)


class LruQueue(Generic[N]):
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int], int, N]] = []
        self._ties = itertools.count()  # a node pushed twice with one key is never compared

    def __len__(self) -> int:
        return len(self._heap)

    def build(self, nodes: Iterable[N]) -> None:
        """Replace the queue's contents with `nodes` (the tree's candidates now)."""
        self._heap = [(n.lru_key(), next(self._ties), n) for n in nodes]
        heapq.heapify(self._heap)

    def push(self, node: N) -> None:
        heapq.heappush(self._heap, (node.lru_key(), next(self._ties), node))

    def pop(self) -> N | None:
        """The least recently used node whose key is unchanged since its push; None when
        the queue has run dry. The caller checks it is still a candidate."""
        while self._heap:
            key, _, node = heapq.heappop(self._heap)
            if node.lru_key() == key:
                return node
        return None

    def prune(self, keep: Callable[[N], bool]) -> None:
        """Drop the stale entries and those whose node `keep` refuses (a queue pushed to more
        often than it is popped, so that dead nodes do not pile up in it)."""
        self._heap = [e for e in self._heap if e[2].lru_key() == e[0] and keep(e[2])]
        heapq.heapify(self._heap)

    def drain(self, candidates: Callable[[], Iterable[N]], done: Callable[[], bool]) -> Iterator[N]:
        """Pop nodes, least recently used first, until `done()`. A queue that runs dry is
        rebuilt once from `candidates()` (the tree's candidates now): at most one walk of the
        tree per drain. Pushes while draining are popped in their turn."""
        built = False
        while not done():
            node = self.pop()
            if node is None:
                if built:
                    return
                self.build(candidates())
                built = True
                continue
            yield node
