"""The decode side's reservation: pages for a prompt whose K/V another instance computes.

After `reserve`, the request's page tables cover the whole prompt [0, P) the way a request
that computed it would hold them, so the decode side continues at position P as usual:

    full group      pages for [0, P)                 (cached prefix C shared, the rest new)
    swa(w) group    pages for [P - w + 1, P) only    (entries below are NULL: retired)

Its prefix cache's hit C is attached first (its pages are not sent: pages_to_send.py), and
the rest is allocated a few pages at a time while `num_computed_tokens` walks from C to P and
out-of-window SWA entries retire behind it, so an SWA group never holds more than its window
plus one chunk, even for a long prompt. Nothing is computed: until the K/V has landed the
request must not run, and `num_computed_tokens` goes back to C before any release (the
prefix cache inserts what a request computed: it must never take pages still being written).
"""

from __future__ import annotations

from swaserve.engine.request import Request
from swaserve.engine.scheduler import Scheduler
from swaserve.memory.radix_cache import PrefixHit

CHUNK_PAGES = 4  # pages per group allocated per walk step


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def pages_to_reserve(scheduler: Scheduler, prompt_len: int, cached: int) -> int:
    """New pages, summed over groups, that a reservation of `prompt_len` tokens with a hit of
    `cached` needs at its peak (the walk's chunk included)."""
    mem = scheduler.memory
    ps = mem.page_size
    total = 0
    end = _ceil(prompt_len, ps)
    for g in mem.layout.groups:
        first = _ceil(cached, ps)
        if g.window is not None:
            first = max(first, max(0, prompt_len - g.window + 1) // ps)
            total += min(CHUNK_PAGES, max(0, end - first))
        total += max(0, end - first)
    return total


def reserve(scheduler: Scheduler, req: Request) -> bool:
    """Give `req` (not in the scheduler's queues) pages for its whole prompt, from its longest
    cached prefix; its num_computed_tokens ends at the prompt's length and num_cached_tokens is
    the hit. False, with nothing changed, when the pool cannot take it now."""
    mem, cache = scheduler.memory, scheduler.cache
    prompt_len = req.num_prompt_tokens
    hit = None
    if cache is not None:
        hit = cache.match(req.prompt_token_ids, prompt_len)
        if hit.num_tokens:
            cache.lock(hit)
        else:
            hit = None
    try:
        cached = hit.num_tokens if hit is not None else 0
        need = pages_to_reserve(scheduler, prompt_len, cached) + mem.watermark_pages
        if hit is not None:
            need += hit.extra_pages
        short = need - mem.pool.num_free
        if short > 0 and cache is not None:
            cache.evict(short)
        if need > mem.pool.num_free:
            return False
        if cache is not None:
            cache.attach(req.request_id, hit or PrefixHit(), prompt_len)
    finally:
        if hit is not None:
            cache.unlock(hit)
    req.num_computed_tokens = req.num_cached_tokens = cached
    chunk = CHUNK_PAGES * mem.page_size
    pos = cached
    while pos < prompt_len:
        n = min(chunk - pos % chunk, prompt_len - pos)  # chunk-aligned steps
        if not mem.allocate(req, n):  # only if the count above was wrong: undo, not crash
            release(scheduler, req)
            return False
        pos += n
        req.num_computed_tokens = pos
    mem.retire_out_of_window([req])
    return True


def release(scheduler: Scheduler, req: Request) -> None:
    """Drop a reservation whose K/V never (or not surely) landed: only the cached prefix may
    enter the prefix cache."""
    req.num_computed_tokens = req.num_cached_tokens
    scheduler._release(req)
