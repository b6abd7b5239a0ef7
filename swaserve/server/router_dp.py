"""Which data-parallel replica serves a request (`--data-parallel-size D`, dense models).

Prefix affinity first: a replica that recently served a prompt with the same first
64 / 256 / 1024 tokens has those pages in its prefix cache, so the request goes there (the
longest such match wins), unless that replica's load (sequences in flight) exceeds the least
loaded replica's by more than `margin`. Otherwise the least loaded replica; ties go to the one
that was given the fewest requests so far, then to the lowest rank. A request's samples
(n > 1) are one choice: they share the prompt and so its cached pages.

The PD router (swaserve/disaggregation/router.py) uses the same choice and LRU for its prefill
and decode instances; it does not tokenize, so it keys text prompts by characters
(`text_prefix_keys`) and token-id prompts by tokens (`prefix_keys`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

PREFIX_LENS = (64, 256, 1024)  # page-size multiples for the page sizes in use (16, 32, 64)
LOAD_MARGIN = 4  # sequences in flight an affine replica may carry beyond the least loaded one
LRU_SIZE = 4096  # prefix hashes remembered per replica
TEXT_PREFIX_LENS = (256, 1024, 4096)  # characters: about PREFIX_LENS tokens of English text


def choose_replica(
    loads: Sequence[int],
    prefix_lens: Sequence[int],
    routed: Sequence[int] | None = None,
    margin: int = LOAD_MARGIN,
    eligible: Sequence[bool] | None = None,
) -> int:
    """The replica for one request. `loads[i]`: sequences in flight on replica i;
    `prefix_lens[i]`: the longest prompt prefix replica i recently served (0: none);
    `routed[i]`: requests given to replica i so far (tie-break); `eligible[i]`: False for a
    replica that cannot take it (full). Raises ValueError when none is eligible."""
    ranks = [i for i in range(len(loads)) if eligible is None or eligible[i]]
    if not ranks:
        raise ValueError("no replica can take the request")
    least = min(loads[i] for i in ranks)
    best = max(prefix_lens[i] for i in ranks)
    if best > 0:
        affine = [i for i in ranks if prefix_lens[i] == best]
        i = min(affine, key=lambda r: (loads[r], r))
        if loads[i] <= least + margin:
            return i
    done = routed or [0] * len(loads)
    return min((i for i in ranks if loads[i] == least), key=lambda r: (done[r], r))


def prefix_keys(token_ids: Sequence[int], lens: Sequence[int] = PREFIX_LENS) -> list[tuple]:
    """(length, hash of the first `length` tokens) for each length the prompt has."""
    return [(k, hash(tuple(token_ids[:k]))) for k in lens if len(token_ids) >= k]


def text_prefix_keys(text: str, lens: Sequence[int] = TEXT_PREFIX_LENS) -> list[tuple]:
    """(length, hash of the first `length` characters) for each length the text has: the keys
    of a prompt not tokenized (the PD router). Hashes are per process, as the LRU is."""
    return [(k, hash(text[:k])) for k in lens if len(text) >= k]


class PrefixAffinity:
    """Per replica, an LRU of the prompt-prefix hashes it served recently."""

    def __init__(self, num_replicas: int, capacity: int = LRU_SIZE) -> None:
        self.capacity = capacity
        self.seen: list[OrderedDict[tuple, None]] = [OrderedDict() for _ in range(num_replicas)]

    def match(self, keys: list[tuple]) -> list[int]:
        """Per replica, the longest of `keys` (a prompt's prefix_keys) it served recently."""
        return [max((k[0] for k in keys if k in lru), default=0) for lru in self.seen]

    def forget(self, replica: int) -> None:
        """The replica's prefix cache was emptied (reset_prefix_cache): nothing is remembered."""
        self.seen[replica].clear()

    def record(self, replica: int, keys: list[tuple]) -> None:
        lru = self.seen[replica]
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class Placement:
    """Offline (the Engine's D replicas or ranks, one process places every request): which
    replica holds each live request, and which one takes the next (`choose_replica`, with the
    live requests as the load)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.requests: dict[str, int] = {}  # live request id -> its replica
        self.affinity = PrefixAffinity(size)
        self.routed = [0] * size

    def place(
        self, request_id: str, prompt_token_ids: Sequence[int], dp_rank: int | None = None
    ) -> int:
        """The replica of a new request: `dp_rank`, or by prefix affinity and load; recorded."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        keys = prefix_keys(prompt_token_ids)
        if dp_rank is None:
            loads = [0] * self.size
            for r in self.requests.values():
                loads[r] += 1
            dp_rank = choose_replica(loads, self.affinity.match(keys), self.routed)
        if not 0 <= dp_rank < self.size:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{self.size - 1}")
        self.affinity.record(dp_rank, keys)
        self.routed[dp_rank] += 1
        self.requests[request_id] = dp_rank
        return dp_rank

    def forget(self, request_id: str) -> int | None:
        """The replica that held a request that finished or was aborted (None: not live)."""
        return self.requests.pop(request_id, None)
