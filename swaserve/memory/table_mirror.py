"""TableMirror: every request's page tables, kept as rows of one int32 array per group.

The memory manager's lists are the truth; the mirror repeats each change to them (a few
entries per step: the pages a chunk adds, the slots a window retires), so a step's table of
B requests is one array gather instead of B list copies padded and converted element by
element (about 7 ms per group at 600 requests of ~75 pages each, on the host, every step).

Invariants (checked by `MemoryManager.check_integrity`):
  - request r's row holds its table, entry for entry, then zeros (NULL_PAGE) to the width;
  - a free row is all zeros, so a reused row needs no clearing.
Rows and columns grow by doubling; nothing here shrinks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from swaserve.memory.pool import NULL_PAGE

assert NULL_PAGE == 0, "rows are zero-padded: padding must read as the NULL page"


class TableMirror:
    def __init__(self, num_groups: int, rows: int = 64, width: int = 64) -> None:
        self.arrays = [np.zeros((rows, width), dtype=np.int32) for _ in range(num_groups)]
        self._free_rows: list[int] = []
        self._next_row = 0

    def add_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        row = self._next_row
        self._next_row += 1
        if row >= self.arrays[0].shape[0]:
            self._grow(rows=2 * self.arrays[0].shape[0])
        return row

    def drop_row(self, row: int, width: int) -> None:
        """Zero the row's first `width` entries (its table's length) and free it."""
        for a in self.arrays:
            a[row, :width] = NULL_PAGE
        self._free_rows.append(row)

    def write(self, row: int, group: int, start: int, pages: Sequence[int]) -> None:
        end = start + len(pages)
        if end > self.arrays[group].shape[1]:
            self._grow(width=max(end, 2 * self.arrays[group].shape[1]))
        self.arrays[group][row, start:end] = pages

    def clear(self, row: int, group: int, start: int, end: int) -> None:
        self.arrays[group][row, start:end] = NULL_PAGE

    def gather(self, rows: Sequence[int], width: int) -> list[np.ndarray]:
        """Per group, a new `[len(rows), width]` int32 array of those rows' first entries."""
        idx = np.asarray(rows, dtype=np.intp)
        if width > self.arrays[0].shape[1]:
            self._grow(width=width)
        return [a[idx, :width] for a in self.arrays]

    def row(self, row: int, group: int) -> np.ndarray:
        """The whole row (a view), for checks."""
        return self.arrays[group][row]

    def check(self, used: Sequence[int]) -> None:
        """Assert the rows in use are distinct, handed out, not free, and every free row is
        zero."""
        assert len(set(used)) == len(used), "two requests share a table mirror row"
        assert all(0 <= r < self._next_row for r in used), "a row never handed out"
        assert not set(used) & set(self._free_rows), "a row in use is on the free list"
        if self._free_rows:
            free = np.asarray(self._free_rows, dtype=np.intp)
            assert not any(a[free].any() for a in self.arrays), "a free row is not zero"

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old_rows, old_width = self.arrays[0].shape
        rows, width = max(rows or 0, old_rows), max(width or 0, old_width)
        for i, a in enumerate(self.arrays):
            b = np.zeros((rows, width), dtype=np.int32)
            b[:old_rows, :old_width] = a
            self.arrays[i] = b
