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


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to k drafts to follow `tokens` (fewer near the end of a match; [] for none).

        One vector compare finds the earlier positions holding the last token (few, unless
        the text repeats); longer suffixes are then checked at those positions only, a token
        at a time. Hundreds of requests of thousands of tokens cost a few ms per step."""
        L = len(tokens)
        if k < 1 or L < self.min_n + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # ends e <= L - 2 of earlier occurrences of the last token (each has a token after it)
        ends = np.flatnonzero(arr[: L - 1] == arr[L - 1])
        if not ends.size:
            return []
        matched = [ends]  # matched[j]: ends of occurrences of the (j + 1)-token suffix
        for j in range(1, min(self.max_n, L - 1)):
            prev = matched[-1]
            prev = prev[prev >= j]
            nxt = prev[arr[prev - j] == arr[L - 1 - j]]
            if not nxt.size:
                break
            matched.append(nxt)
        n = len(matched)
        if n < self.min_n:
            return []
        ends = matched[n - 1]
        # The most recent occurrence followed by k tokens, else the earliest (the one followed
        # by the most): in a run of repeats the most recent one is often right before the
        # suffix itself, with a single token after it.
        whole = ends[ends + k <= L - 1]
        e = int(whole[-1] if whole.size else ends[0])
        return arr[e + 1 : e + 1 + k].tolist()
