"""The unified page pool: page ids, reference counts and a free list. Bookkeeping only.

    page id:   0      1  2  3 ... num_pages-1
               NULL   |<------ capacity ------>|

Page 0 is the NULL page: never allocated, never freed; retired page-table slots point at it
and kernels never read it. Every other page is either free (refcount 0, on the free list) or
referenced (refcount = number of holders: request page tables, prefix-cache nodes, ...).
The free list is LIFO: a page just released is the next one handed out (warm in caches).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

NULL_PAGE = 0


class PageRefError(RuntimeError):
    """A reference-count misuse: double free, incref of a free page, or the NULL page."""


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (page 0 is NULL), got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        # Popped from the end: page 1 is handed out first.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def capacity(self) -> int:
        """Allocatable pages (every page but NULL)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def free_pages(self) -> list[int]:
        """A copy of the free list (for integrity checks and tests)."""
        return list(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n free pages with refcount 1, or None (and no change) if fewer than n are free."""
        if n < 0:
            raise ValueError(f"alloc of {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        for p in pages:
            self._refcount[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """One more holder for each page (a page may repeat); every page must be referenced."""
        pages = list(pages)
        for p in pages:
            self._check_id(p)
            if self._refcount[p] == 0:
                raise PageRefError(f"incref of free page {p}")
        for p in pages:
            self._refcount[p] += 1

    def decref(self, pages: Iterable[int]) -> list[int]:
        """One holder fewer for each page; returns the pages that became free.

        All or nothing: raises PageRefError (and changes nothing) if a page would go below 0.
        """
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_id(p)
            if self._refcount[p] < c:
                raise PageRefError(
                    f"decref of page {p} x{c} with refcount {self._refcount[p]} (double free)"
                )
        freed = []
        for p, c in counts.items():
            self._refcount[p] -= c
            if self._refcount[p] == 0:
                freed.append(p)
        self._free.extend(freed)
        return freed

    def _check_id(self, page: int) -> None:
        if page == NULL_PAGE:
            raise PageRefError("the NULL page has no references")
        if not 0 < page < self.num_pages:
            raise PageRefError(f"page {page} out of range [1, {self.num_pages})")
