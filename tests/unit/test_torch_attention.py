"""The torch backend's fast path: `attend_fast` (torch SDPA where it applies) equals the einsum
reference `attend_batched`, and decodes are batched by key count with bounded padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.attention.torch_backend import (
    PAD_RATIO,
    _decode_batches,
    attend_batched,
    attend_fast,
)


@pytest.mark.parametrize("n", [1, 5])  # decodes, a prefill chunk
@pytest.mark.parametrize("h,hkv", [(4, 1), (6, 3), (4, 4)])  # one KV head, GQA, MHA
@pytest.mark.parametrize("window", [None, 4])
def test_attend_fast_equals_reference(n, h, hkv, window):
    g = torch.Generator().manual_seed(n * 100 + h * 10 + hkv)
    R, L, d = 3, 17, 16
    q = torch.randn(R, n, h, d, generator=g)
    k, v = (torch.randn(R, L, hkv, d, generator=g) for _ in range(2))
    lens = torch.tensor([L, 9, n])  # padded rows past each request's keys
    kpos = torch.arange(L)[None, None, :]
    qpos = (lens[:, None] - n + torch.arange(n)[None, :])[:, :, None]  # the last n positions
    mask = (kpos <= qpos) & (kpos < lens[:, None, None])
    if window is not None:
        mask &= kpos > qpos - window
    want = attend_batched(q, k, v, mask, 0.25)
    got = attend_fast(q, k, v, mask, 0.25)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_attend_fast_decodes_from_strided_queries():
    """The engine's q is a strided view of the merged q|k|v projection: the grouped-query form
    of single-token rows takes it as it comes."""
    g = torch.Generator().manual_seed(3)
    R, L, h, hkv, d = 4, 11, 6, 2, 8
    qkv = torch.randn(R, (h + 2 * hkv) * d, generator=g)
    q = qkv[:, : h * d].view(R, h, d)[:, None]  # [R, 1, H, D], rows (H + 2 Hkv) D apart
    assert not q.is_contiguous()
    k, v = (torch.randn(R, L, hkv, d, generator=g) for _ in range(2))
    mask = (torch.arange(L)[None, None, :] < torch.tensor([11, 3, 7, 1])[:, None, None])
    torch.testing.assert_close(attend_fast(q, k, v, mask, 0.3),
                               attend_batched(q, k, v, mask, 0.3), atol=2e-6, rtol=1e-5)


def test_attend_fast_keeps_softcap_and_sinks():
    """SDPA has neither: those calls take the reference itself (bit-equal)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 3, 4, 8, generator=g)
    k, v = (torch.randn(2, 6, 2, 8, generator=g) for _ in range(2))
    mask = torch.ones(2, 3, 6, dtype=torch.bool)
    sinks = torch.randn(4, generator=g)
    for softcap, s in ((2.0, None), (None, sinks)):
        want = attend_batched(q, k, v, mask, 0.5, softcap, s)
        assert torch.equal(attend_fast(q, k, v, mask, 0.5, softcap, s), want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_decode_batches_cover_every_row_with_bounded_padding(lengths):
    lens = dict(enumerate(lengths))
    rows = list(lens)
    batches = _decode_batches(rows, lens)
    assert sorted(r for b in batches for r in b) == rows  # each row once
    for b in batches:
        assert b == sorted(b)  # step order
        padded = max(lens[r] for r in b) * len(b)
        assert len(b) == 1 or padded <= PAD_RATIO * sum(lens[r] for r in b)


def test_decode_batches_split_a_long_decode_from_short_ones():
    lens = {0: 40, 1: 1500, 2: 41, 3: 600, 4: 39}
    assert _decode_batches(list(lens), lens) == [[1, 3], [0, 2, 4]]
