"""N-gram drafter (prompt lookup): no weights, one-hot drafts (docs/architecture.md §8).

The longest suffix of a request's tokens, from `max_n` down to `min_n` tokens, is looked up
earlier in the same tokens (prompt and committed outputs); the K tokens that followed its
most recent earlier occurrence with K tokens after it are the drafts. Repetitive text (code
edits, summaries that quote their source, retrieval answers) makes them right often;
elsewhere nothing matches and the request decodes as usual. A deterministic function of the
request's tokens, so seeded requests stay reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k drafts to follow `tokens` (fewer near the end of a match; [] for none)."""
        L = len(tokens)
        if k < 1 or L < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = arr[L - n :]
            # Windows starting at i <= L - n - 1: each has at least one token after it.
            windows = sliding_window_view(arr[: L - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The most recent occurrence followed by k tokens, else the earliest (the one
                # followed by the most): in a run of repeats the most recent one is often
                # right before the suffix itself, with a single token after it.
                whole = hits[hits + n + k <= L]
                start = int(whole[-1] if whole.size else hits[0]) + n
                return arr[start : start + k].tolist()
        return []
