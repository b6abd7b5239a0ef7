"""LruQueue: least recently used first, entries of nodes stamped since their push skipped."""

from __future__ import annotations

from swaserve.memory.lru_queue import LruQueue


class Item:
    def __init__(self, stamp: int, serial: int) -> None:
        self.stamp, self.serial = stamp, serial

    def lru_key(self) -> tuple[int, int]:
        return (self.stamp, self.serial)


def test_pops_oldest_first_and_skips_stamped_entries():
    items = [Item(s, i) for i, s in enumerate([5, 1, 3, 1])]
    q: LruQueue[Item] = LruQueue()
    q.build(items)
    items[2].stamp = 9  # touched after its push: younger than every entry, skipped
    assert [q.pop() for _ in range(3)] == [items[1], items[3], items[0]]
    assert q.pop() is None and len(q) == 0
    q.push(items[2])
    q.push(items[2])  # pushed twice with one key: never compared with itself
    assert q.pop() is items[2] and q.pop() is items[2] and q.pop() is None


def test_prune_drops_stale_and_refused_entries_and_keeps_the_order():
    items = [Item(s, i) for i, s in enumerate([4, 2, 8, 6])]
    q: LruQueue[Item] = LruQueue()
    for it in items:
        q.push(it)
    items[0].stamp = 10
    q.prune(lambda it: it is not items[3])
    assert len(q) == 2
    assert [q.pop(), q.pop(), q.pop()] == [items[1], items[2], None]
