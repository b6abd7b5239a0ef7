"""Which KV pages a prefill instance sends to a decode instance: window-aware (DESIGN §9.3).

The decode side continues at position P = prompt_len: its first query, at P, sees keys
(P - window, P], i.e. it reads keys [P - window + 1, P) from the pool and writes key P itself.
Every later query q > P reads only keys > q - window > P - window, so that set is all the
decode side ever needs from the prompt:

    full group      keys [0, P)
    swa(w) group    keys [max(0, P - w + 1), P)           (none when w == 1)

Its prefix cache already holds the first C tokens (C <= P): full pages for [0, C) and, by the
match rule (DESIGN §3), SWA pages for [C - w + 1, C), which covers every needed key below C.
So the keys to send are the needed ones at or after C, and the pages to send are the page-table
entries holding any of them:

    group g sends table entries  first .. last      first = max(C, lo_g) // page_size
                                                    last  = (P - 1) // page_size
    (nothing when max(C, lo_g) >= P)

Whole pages travel: the first entry may also hold keys below C (the decode side's partial
prefix page) or below lo_g (dead keys); they are rewritten with the same values or never read.
So the decode side's entries that receive pages must be private to the request (copy-on-write
of a shared partial page first), and non-NULL.

Worked example: page_size 16, P = 1000, one full group and one swa(512) group.
    C = 0:   full sends entries 0..62 (63 pages); swa: lo = 489, entries 30..62 (33 pages).
    C = 960: both send entries 60..62 (3 pages each).
    C = 970: both send 60..62: entry 60 holds keys 960..975, of which 970.. are new.
    P = 100, window 512 (prompt inside the window): swa sends all 7 pages, like full.
"""

from __future__ import annotations

from collections.abc import Sequence

from swaserve.memory.groups import AttentionGroup, GroupLayout
from swaserve.memory.pool import NULL_PAGE


def first_needed_key(group: AttentionGroup, prompt_len: int) -> int:
    """The oldest prompt key a decode query at position prompt_len can see."""
    if group.window is None:
        return 0
    return max(0, prompt_len - group.window + 1)


def entries_to_send(
    group: AttentionGroup, page_size: int, prompt_len: int, num_cached_tokens: int
) -> range:
    """Page-table entries of `group` the decode side lacks (see the module docstring)."""
    if not 0 <= num_cached_tokens <= prompt_len:
        raise ValueError(f"cached tokens {num_cached_tokens} not in [0, {prompt_len}]")
    start = max(num_cached_tokens, first_needed_key(group, prompt_len))
    if start >= prompt_len:
        return range(0)
    return range(start // page_size, (prompt_len - 1) // page_size + 1)


def pages_to_send(
    layout: GroupLayout,
    page_size: int,
    prompt_len: int,
    src_tables: Sequence[Sequence[int]],
    dst_tables: Sequence[Sequence[int]],
    num_cached_tokens: int = 0,
) -> list[tuple[int, int]]:
    """(prefill page, decode page) pairs to write, group by group, entries in order.

    `src_tables` / `dst_tables`: the request's page table per group on the prefill side and
    the decode side's reservation. Raises ValueError if an entry to send is missing or NULL
    on either side."""
    if len(src_tables) != layout.num_groups or len(dst_tables) != layout.num_groups:
        raise ValueError(
            f"need one page table per group ({layout.num_groups}), got "
            f"{len(src_tables)} source and {len(dst_tables)} destination"
        )
    pairs: list[tuple[int, int]] = []
    for group, src, dst in zip(layout.groups, src_tables, dst_tables, strict=True):
        entries = entries_to_send(group, page_size, prompt_len, num_cached_tokens)
        if entries and (len(src) < entries.stop or len(dst) < entries.stop):
            raise ValueError(
                f"group {group.index}: tables of {len(src)} (prefill) and "
                f"{len(dst)} (decode) entries, {entries.stop} needed"
            )
        for i in entries:
            if src[i] == NULL_PAGE or dst[i] == NULL_PAGE:
                raise ValueError(
                    f"group {group.index} entry {i}: a NULL page to send "
                    f"(prefill {src[i]}, decode {dst[i]})"
                )
            pairs.append((src[i], dst[i]))
    return pairs


def pages_to_send_count(
    layout: GroupLayout, page_size: int, prompt_len: int, num_cached_tokens: int = 0
) -> int:
    """len(pages_to_send(...)) without the page tables."""
    return sum(
        len(entries_to_send(g, page_size, prompt_len, num_cached_tokens)) for g in layout.groups
    )


def transfer_bytes(
    layout: GroupLayout,
    page_size: int,
    prompt_len: int,
    page_nbytes: int,
    num_cached_tokens: int = 0,
) -> int:
    """Bytes one request moves: pages to send x `page_nbytes` (memory/manager.py `page_bytes`,
    or `PageLayout.page_bytes`)."""
    return pages_to_send_count(layout, page_size, prompt_len, num_cached_tokens) * page_nbytes
