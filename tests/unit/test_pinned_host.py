"""memory/pinned.py on the CPU: the host tier's exact-size pinning, its lifecycle against a
recording stand-in for CUDA's runtime (the real registration runs in
tests/gpu/test_pinned_cuda.py): registered once at the exact size and a page-aligned address,
unregistered once (at release, at garbage collection, never twice), after a device sync, and
not inside a graph capture; a view outlives the release; a refused registration is a clear
error."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from swaserve.memory import pinned
from swaserve.memory.host_cache import OffloadPool


class FakeCudart:
    def __init__(self, register_error: int = 0) -> None:
        self.calls: list[tuple] = []
        self.register_error = register_error

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, size, flags))
        return self.register_error

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: fake.calls.append(("sync",)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return fake


def test_registered_at_its_exact_size_and_released_once(cudart):
    shape = (5, 3, 1000)  # 15,000 bytes: torch's allocator would pin 16 KiB
    data, buf = pinned.pinned_empty(shape)
    assert data.shape == shape and data.dtype == torch.uint8
    (op, ptr, size, flags), = cudart.calls
    assert (op, size, flags) == ("register", 15_000, 1)
    assert ptr == data.data_ptr() and ptr % mmap.PAGESIZE == 0
    data[4, 2, 999] = 7
    buf.release()
    buf.release()  # idempotent
    assert cudart.calls[1:] == [("sync",), ("unregister", ptr)]
    assert int(data[4, 2, 999]) == 7  # the view still reads valid (pageable) memory


def test_garbage_collection_unregisters(cudart):
    data, buf = pinned.pinned_empty((4096,))
    ptr = data.data_ptr()
    del buf
    gc.collect()
    assert cudart.calls[-2:] == [("sync",), ("unregister", ptr)]
    data.fill_(1)  # the mapping outlives the registration while a view holds it
    assert int(data.sum()) == 4096


def test_a_refused_registration_is_a_clear_error(monkeypatch):
    fake = FakeCudart(register_error=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with pytest.raises(RuntimeError, match="page-lock 0.00 GiB .*--host-cache-gb"):
        pinned.pinned_empty((3, 4))


def test_the_host_tier_pins_and_closes(cudart):
    pool = OffloadPool("host", 6, (2, 8), pin=True)
    assert pool.pinned and pool.data.shape == (6, 2, 8)
    (_, ptr, size, _), = cudart.calls
    assert size == 6 * 2 * 8 and ptr == pool.data.data_ptr()
    pool.close()
    assert cudart.calls[-1] == ("unregister", ptr) and pool.data.numel() == 0
    pool.close()
    assert sum(c[0] == "unregister" for c in cudart.calls) == 1


def test_a_size_of_zero_is_refused():
    with pytest.raises(ValueError, match="positive size"):
        pinned.PinnedHostBuffer(0)


def test_not_unregistered_inside_a_graph_capture(cudart, monkeypatch):
    """A sync inside a capture would break it: the range stays pinned (and mapped)."""
    data, buf = pinned.pinned_empty((4096,))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    buf.release()
    assert [c[0] for c in cudart.calls] == ["register"]
    assert any(t.data_ptr() == data.data_ptr() for t in pinned._kept)
    pinned._kept.clear()
