"""The CPU KV pool is zero and resident only where written (swaserve/memory/kv_pool.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swaserve.memory.kv_pool import PAGE_BYTES, lazy_zeros


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_lazy_zeros_is_zero_aligned_contiguous(dtype):
    t = lazy_zeros((3, 2, 5, 4, 1, 7), dtype)
    assert t.shape == (3, 2, 5, 4, 1, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % PAGE_BYTES == 0
    assert not t.float().any()
    t[1, 0, 2] = 1.0  # writable, and only there
    assert t.float().sum().item() == 4 * 7


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
def test_lazy_zeros_is_not_resident_until_written():
    size = 256 * 2**20
    before = _rss_bytes()
    t = lazy_zeros((size // 4,), torch.float32)
    assert _rss_bytes() - before < size // 8
    t[: 2**20].fill_(1.0)  # 4 MiB written: about that much more
    assert _rss_bytes() - before < size // 8 + 8 * 2**20
    del t
