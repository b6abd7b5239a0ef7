"""KV page transfer test helpers (tests/unit/test_disagg_transfer.py, test_disagg_notices.py,
tests/gpu/test_disagg_cuda.py): random pools of one small layout, a scattered page list, the
expected pool after a write, and whether NIXL can run here. No pyzmq here: the GPU machine
lacks it, and its NIXL test imports this module."""

from __future__ import annotations

import time

import pytest
import torch

from swaserve.memory.groups import build_layout
from swaserve.memory.kv_pool import KVPool

LAYOUT = build_layout([4, None, 4, 4, None, 4])  # 2 slots per page: 2 swa + 1 full groups
# Scattered, with a contiguous run (3, 4, 5 -> 7, 8, 9) and a run on one side only (9, 1).
SRC = [3, 4, 5, 9, 1, 12, 13]
DST = [7, 8, 9, 2, 20, 15, 3]


def pool(num_pages: int, seed: int, page_size: int = 4, layout=LAYOUT,
         dtype: torch.dtype = torch.bfloat16, heads: int = 2, dim: int = 8,
         device: str = "cpu") -> KVPool:
    """A pool of `layout` filled with seeded random values (drawn on the CPU: the same values
    on every device)."""
    p = KVPool(layout, num_pages, page_size, heads, dim, dtype, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    p.pages.copy_(torch.randn(p.pages.shape, generator=g))
    return p


def expected_after(dst_before: torch.Tensor, src: torch.Tensor, src_pages: list[int] = SRC,
                   dst_pages: list[int] = DST) -> torch.Tensor:
    """The reference: whole pages (every slot, K and V) copied by page id, the rest as before
    (page-major pools, `KVPool.pages`)."""
    out = dst_before.clone()
    out[dst_pages] = src[src_pages]
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def wait(backend, handle, limit_s: float = 15.0) -> tuple[str, float]:
    """Poll a write until it is final (or `limit_s` passed): (state, seconds waited)."""
    t0 = time.monotonic()
    while (state := backend.poll(handle)) == "pending" and time.monotonic() - t0 < limit_s:
        time.sleep(0.002)
    return state, time.monotonic() - t0


def nixl_missing() -> str | None:
    """Why the NIXL backend cannot run here, or None."""
    from swaserve.disaggregation.nixl_backend import _import_nixl

    try:
        _import_nixl()
    except RuntimeError as e:
        return str(e)
    return None


NIXL_MISSING = nixl_missing()
nixl_only = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"NIXL unusable: {NIXL_MISSING}")
