"""GPU only (skipped elsewhere): the host tier's memory is page-locked at its exact size
(memory/pinned.py) rather than through torch's pinned allocator, which rounds a block up to a
power of two and caches it after use. Registered memory is pinned for CUDA (asynchronous
copies both ways give back what went in), torch's host allocator holds nothing of it, and
release() unpins it."""

from __future__ import annotations

import pytest
import torch

from swaserve.memory.host_cache import OffloadPool
from swaserve.memory.pinned import PinnedHostBuffer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _host_allocator_bytes() -> int:
    """Bytes torch's caching host allocator has handed out now."""
    stats = torch.cuda.host_memory_stats()
    key = next((k for k in ("allocated_bytes.current", "allocated_bytes.all.current")
                if k in stats), None)  # fmt: skip
    assert key is not None, sorted(stats)
    return int(stats[key])


def test_exact_size_pinned_roundtrip_and_release():
    nbytes = (1 << 30) + 12_345  # torch's allocator would pin 2 GiB for it
    before = _host_allocator_bytes()
    buf = PinnedHostBuffer(nbytes)
    host = buf.tensor
    assert host.is_pinned() and host.numel() == nbytes
    assert _host_allocator_bytes() - before < nbytes  # not torch's caching allocator's
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host.copy_(src, non_blocking=True)  # device -> pinned host: asynchronous DMA
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    buf.release()
    assert not host.is_pinned()
    # the stat does see torch's own pinned blocks (so the check above can fail)
    before = _host_allocator_bytes()
    theirs = torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True)
    assert _host_allocator_bytes() - before >= 3 << 20  # (4 MiB: rounded to a power of two)
    del theirs


def test_the_host_tier_is_pinned_until_closed():
    pool = OffloadPool("host", 64, (2, 4096), pin=True)
    assert pool.pinned and pool.data.is_pinned()
    view = pool.data[3]
    pool.close()
    assert not view.is_pinned() and pool.data.numel() == 0
