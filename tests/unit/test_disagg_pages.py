"""Which pages a prefill instance sends (swaserve/disaggregation/pages_to_send.py): hand cases and a
brute-force check against the token-level definition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.disaggregation.pages_to_send import (
    entries_to_send,
    pages_to_send,
    pages_to_send_count,
    transfer_bytes,
)
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import page_bytes
from swaserve.memory.pool import NULL_PAGE


def tables(layout, num_entries: int, base: int) -> list[list[int]]:
    """Distinct, scattered page ids per group: group g entry i -> base + 1000 g + 7 i."""
    return [[base + 1000 * g + 7 * i for i in range(num_entries)] for g in range(layout.num_groups)]


def needed_keys(window: int | None, prompt_len: int, cached: int) -> set[int]:
    """Token-level definition: keys the decode query at prompt_len reads from the pool
    (q - window < k < q, all k < q for full) that the decode side's cache does not hold."""
    q = prompt_len
    return {k for k in range(cached, q) if window is None or q - window < k}


# Gemma-like: two SWA groups (window 8) and one full group, one slot per layer.
LAYOUT = build_layout([8, None, 8])


def entries(layout, page_size, prompt_len, cached=0):
    return [list(entries_to_send(g, page_size, prompt_len, cached)) for g in layout.groups]


def test_full_and_swa_groups():
    # page 4, P = 20: full needs keys 0..19 (entries 0..4); swa(8) keys 13..19 (entries 3, 4).
    assert entries(LAYOUT, 4, 20) == [[3, 4], [0, 1, 2, 3, 4], [3, 4]]


def test_prompt_shorter_than_window():
    # P = 7 < window 8: the SWA groups need every key, like the full group.
    assert entries(LAYOUT, 4, 7) == [[0, 1]] * 3


def test_window_boundary_off_by_ones():
    # window 8, page 4: lo = P - 7. P = 11 -> lo 4 (entry 1); P = 12 -> lo 5 (entry 1);
    # P = 15 -> lo 8 (entry 2 exactly at a page start); P = 16 -> lo 9, last key 15 (entry 3).
    swa = LAYOUT.groups[0]
    assert list(entries_to_send(swa, 4, 11, 0)) == [1, 2]
    assert list(entries_to_send(swa, 4, 12, 0)) == [1, 2]
    assert list(entries_to_send(swa, 4, 15, 0)) == [2, 3]
    assert list(entries_to_send(swa, 4, 16, 0)) == [2, 3]
    assert list(entries_to_send(swa, 4, 17, 0)) == [2, 3, 4]  # key 16 opens entry 4


def test_window_one_and_window_smaller_than_a_page():
    layout = build_layout([1, 3, None])
    # window 1: the query sees only itself, nothing from the pool. window 3, page 8, P = 9:
    # keys 7, 8 -> entries 0 and 1.
    assert entries(layout, 8, 9) == [[], [0, 1], [0, 1]]


def test_decode_prefix_hit_part_and_all():
    # C = 12 of P = 20, page 4: full sends keys 12..19 (entries 3, 4); SWA the same.
    assert entries(LAYOUT, 4, 20, cached=12) == [[3, 4]] * 3
    # C = 10 (mid-page): entry 2 holds keys 8..11, of which 10, 11 are new -> sent whole.
    assert entries(LAYOUT, 4, 20, cached=10) == [[3, 4], [2, 3, 4], [3, 4]]
    # C = P: nothing to send (the completion notice still travels).
    assert entries(LAYOUT, 4, 20, cached=20) == [[]] * 3
    assert pages_to_send_count(LAYOUT, 4, 20, 20) == 0


def test_pairs_follow_the_tables():
    src, dst = tables(LAYOUT, 5, 1), tables(LAYOUT, 6, 50000)
    pairs = pages_to_send(LAYOUT, 4, 20, src, dst)
    expect = [(src[g][i], dst[g][i]) for g, es in enumerate(entries(LAYOUT, 4, 20)) for i in es]
    assert pairs == expect and len(pairs) == 9


def test_swa_tables_with_retired_entries():
    # Prefill retired SWA entries 0..2 (P = 20, window 8: keys < 13 dead, page-floored -> 3);
    # decode reserved only entries 3, 4. Only live entries are read.
    src, dst = tables(LAYOUT, 5, 1), tables(LAYOUT, 5, 50000)
    for g in (0, 2):
        src[g][:3] = [NULL_PAGE] * 3
        dst[g][:3] = [NULL_PAGE] * 3
    assert len(pages_to_send(LAYOUT, 4, 20, src, dst)) == 9


def test_bad_inputs():
    src, dst = tables(LAYOUT, 5, 1), tables(LAYOUT, 5, 50000)
    dst[1][2] = NULL_PAGE
    with pytest.raises(ValueError, match="NULL"):
        pages_to_send(LAYOUT, 4, 20, src, dst)
    with pytest.raises(ValueError, match="entries"):
        pages_to_send(LAYOUT, 4, 20, src, tables(LAYOUT, 4, 50000))
    with pytest.raises(ValueError, match="one page table per group"):
        pages_to_send(LAYOUT, 4, 20, src[:2], dst)
    with pytest.raises(ValueError, match="cached"):
        pages_to_send_count(LAYOUT, 4, 20, 21)


def test_transfer_bytes_gemma_shape():
    # Gemma 3 270M: 15 swa(512) + 3 full layers -> 5 swa + 1 full groups of 3 slots.
    layout = build_layout([None if i % 6 == 5 else 512 for i in range(18)])
    assert [g.kind for g in layout.groups].count("swa") == 5
    page = 2 * 3 * 16 * 1 * 256 * 2  # K and V, 3 slots, 16 tokens, 1 head of 256, bf16
    # P = 1000: full 63 pages; each swa group keys 489..999 -> entries 30..62 = 33 pages.
    assert transfer_bytes(layout, 16, 1000, page) == (63 + 5 * 33) * page
    assert transfer_bytes(layout, 16, 1000, page, num_cached_tokens=960) == 6 * 3 * page
    # Every layer full: one group of 18 slots, pages 6x as large, 63 of them: 2.3x the bytes.
    every_layer_full = build_layout([None] * 18)
    big = page_bytes(every_layer_full, 16, 1, 256, 2)
    assert big == 6 * page == page_bytes(layout, 16, 1, 256, 2) * 6
    assert transfer_bytes(every_layer_full, 16, 1000, big) == 63 * 6 * page


@settings(max_examples=300, deadline=None)
@given(
    windows=st.lists(st.one_of(st.none(), st.integers(1, 40)), min_size=1, max_size=5),
    page_size=st.integers(1, 9),
    prompt_len=st.integers(1, 120),
    cached_frac=st.floats(0, 1),
)
def test_brute_force_against_tokens(windows, page_size, prompt_len, cached_frac):
    layout = build_layout(windows)
    cached = int(cached_frac * prompt_len)
    num_entries = -(-prompt_len // page_size)
    src, dst = tables(layout, num_entries, 1), tables(layout, num_entries + 1, 50000)
    expect = []
    for g in layout.groups:
        keys = needed_keys(g.window, prompt_len, cached)
        expect += [
            (src[g.index][i], dst[g.index][i]) for i in sorted({k // page_size for k in keys})
        ]
    assert pages_to_send(layout, page_size, prompt_len, src, dst, cached) == expect
    assert pages_to_send_count(layout, page_size, prompt_len, cached) == len(expect)
