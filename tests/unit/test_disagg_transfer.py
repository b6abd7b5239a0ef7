"""KV page transfer (swaserve/disaggregation/transfer.py and its backends): the in-process
reference, then NIXL between two real processes on loopback."""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid

import pytest
import torch

from swaserve.disaggregation.local_backend import LocalBackend, LocalFabric
from swaserve.disaggregation.transfer import (
    LayoutMismatchError,
    PageLayout,
    create_transfer_backend,
    page_runs,
    segments,
)
from swaserve.memory.groups import build_layout
from tests.transfer_helpers import (
    DST,
    LAYOUT,
    SRC,
    expected_after,
    nixl_only,
    pool,
    same_bytes,
    wait,
)

# ---- geometry -----------------------------------------------------------------------------


def test_runs_and_segments():
    assert page_runs(SRC, DST) == [(3, 7, 3), (9, 2, 1), (1, 20, 1), (12, 15, 1), (13, 3, 1)]
    a = PageLayout.of(pool(16, 0).pages, LAYOUT)
    b = PageLayout.of(pool(24, 1).pages, LAYOUT)
    segs = segments(a, b, SRC, DST)
    page = 2 * 2 * 4 * 2 * 8 * 2  # slots x (k, v) x tokens x heads x dim x bf16 bytes
    assert a.page_bytes == page
    # page-major pools: one segment per run, whatever the slots per page
    assert segs.tolist() == [[s * page, d * page, n * page] for s, d, n in page_runs(SRC, DST)]


def test_bad_page_lists():
    a = PageLayout.of(pool(16, 0).pages)
    for src, dst, match in (
        ([1, 2], [3], "destination pages"),
        ([0], [3], "NULL"),
        ([16], [3], "out of range"),
        ([1, 2], [3, 3], "twice"),
    ):
        with pytest.raises(ValueError, match=match):
            segments(a, a, src, dst)


# ---- (a) the local backend ----------------------------------------------------------------


def test_local_backend_moves_scattered_pages():
    fabric = LocalFabric()
    prefill, decode = pool(16, 0), pool(24, 1)  # pools of different sizes may pair
    before = decode.pages.clone()
    a = create_transfer_backend("local", "prefill", fabric=fabric)
    b = create_transfer_backend("local", "decode", fabric=fabric)
    a.register(prefill.pages, LAYOUT)
    a.connect("decode", b.register(decode.pages, LAYOUT))
    h = a.write_pages("decode", SRC, DST, b"req-1")
    assert a.poll(h) == "done" and a.error(h) is None
    assert b.notifications() == [("prefill", b"req-1")] and b.notifications() == []
    assert same_bytes(decode.pages, expected_after(before, prefill.pages))
    a.release(h)
    with pytest.raises(KeyError):
        a.poll(h)
    h = a.write_pages("decode", [], [], b"req-2")  # nothing to send: the notice still goes
    assert a.poll(h) == "done" and b.notifications() == [("prefill", b"req-2")]
    b.close()
    h = a.write_pages("decode", SRC, DST, b"req-3")
    assert a.poll(h) == "failed" and "closed" in a.error(h)


def test_local_backend_fp8_bytes():
    fabric = LocalFabric()
    src, dst = pool(16, 0, dtype=torch.float8_e4m3fn), pool(24, 1, dtype=torch.float8_e4m3fn)
    before = dst.pages.clone()
    a, b = LocalBackend("a", fabric), LocalBackend("b", fabric)
    a.register(src.pages)
    a.connect("b", b.register(dst.pages))
    assert a.poll(a.write_pages("b", SRC, DST, b"")) == "done"
    assert same_bytes(dst.pages, expected_after(before, src.pages))


# ---- (c) layouts must match ---------------------------------------------------------------


@pytest.mark.parametrize(
    "other, field",
    [
        (dict(page_size=8), "page_size"),
        (dict(dtype=torch.float16), "dtype"),
        (dict(layout=build_layout([4, None, 4, None, 4, 4])), "groups"),
    ],
)
def test_layout_mismatch_is_refused(other, field):
    fabric = LocalFabric()
    a, b = LocalBackend("a", fabric), LocalBackend("b", fabric)
    layout = other.pop("layout", LAYOUT)
    a.register(pool(16, 0).pages, LAYOUT)
    desc = b.register(pool(16, 1, layout=layout, **other).pages, layout)
    with pytest.raises(LayoutMismatchError, match=f"refusing to connect: {field}"):
        a.connect("b", desc)
    with pytest.raises(ValueError, match="descriptor is from 'b'"):
        a.connect("c", desc)


def test_backend_registry_errors(monkeypatch):
    from swaserve.disaggregation import nixl_backend

    with pytest.raises(ValueError, match="unknown transfer backend 'ucx'"):
        create_transfer_backend("ucx", "x")
    monkeypatch.setattr(nixl_backend, "MODULES", ("no_such_nixl_module",))
    with pytest.raises(RuntimeError, match="install the nixl-cu13 package"):
        create_transfer_backend("nixl", "x")


# ---- NIXL between two processes -----------------------------------------------------------


def _decode_peer(conn, name: str) -> None:
    """The decode side: registers its pool, sends its descriptor, reports what arrives."""
    torch.set_num_threads(1)
    decode = pool(24, 1)
    backend = create_transfer_backend("nixl", name)
    conn.send((backend.register(decode.pages, LAYOUT), decode.pages.clone()))
    deadline, got = time.monotonic() + 20, []
    while not got and time.monotonic() < deadline and not conn.poll(0.005):  # poll: "exit"
        got = backend.notifications()
    if got:
        conn.send((got, decode.pages.clone()))
        conn.recv()  # stay alive (registered) until told, or until killed
    backend.close()


@pytest.fixture
def peer():
    """A decode process; yields (its name, pipe, process)."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    name = f"decode-{uuid.uuid4().hex[:8]}"
    proc = ctx.Process(target=_decode_peer, args=(there, name), daemon=True)
    proc.start()
    yield name, here, proc
    if proc.is_alive():
        here.send("exit")
        proc.join(10)
    if proc.is_alive():
        proc.kill()


@pytest.fixture
def nixl_prefill():
    backend = create_transfer_backend("nixl", f"prefill-{uuid.uuid4().hex[:8]}")
    yield backend
    backend.close()


@nixl_only
def test_nixl_two_processes(peer, nixl_prefill):
    name, conn, _ = peer
    prefill = pool(16, 0)
    nixl_prefill.register(prefill.pages, LAYOUT)
    assert conn.poll(60), "the decode process did not start"
    descriptor, before = conn.recv()
    nixl_prefill.connect(name, descriptor)
    h = nixl_prefill.write_pages(name, SRC, DST, b"req-1")
    assert wait(nixl_prefill, h)[0] == "done", nixl_prefill.error(h)
    nixl_prefill.release(h)
    assert conn.poll(20)
    notes, after = conn.recv()
    assert notes == [(nixl_prefill.name, b"req-1")]
    assert same_bytes(after, expected_after(before, prefill.pages))  # others untouched


@nixl_only
def test_nixl_layout_mismatch(nixl_prefill):
    other = create_transfer_backend("nixl", f"decode-{uuid.uuid4().hex[:8]}")
    try:
        nixl_prefill.register(pool(16, 0, page_size=8).pages, LAYOUT)
        descriptor = other.register(pool(16, 1).pages, LAYOUT)
        with pytest.raises(LayoutMismatchError, match="page_size: local 8, peer 4"):
            nixl_prefill.connect(other.name, descriptor)
    finally:
        other.close()


@nixl_only
def test_nixl_shared_memory_only(monkeypatch):
    """UCX_TLS=sm,self refuses "peer" error handling: the backend falls back to "none"."""
    monkeypatch.setenv("UCX_TLS", "sm,self")
    tag = uuid.uuid4().hex[:8]
    a = create_transfer_backend("nixl", f"a-{tag}")
    b = create_transfer_backend("nixl", f"b-{tag}")
    try:
        assert a.ucx_error_handling_mode == "none"
        src, dst = pool(16, 0), pool(24, 1)
        before = dst.pages.clone()
        a.register(src.pages, LAYOUT)
        a.connect(b.name, b.register(dst.pages, LAYOUT))
        h = a.write_pages(b.name, SRC, DST, b"sm")
        assert wait(a, h)[0] == "done", a.error(h)
        deadline, notes = time.monotonic() + 5, []
        while not notes and time.monotonic() < deadline:
            notes = b.notifications()
        assert notes == [(a.name, b"sm")]
        assert same_bytes(dst.pages, expected_after(before, src.pages))
    finally:
        a.close()
        b.close()


@nixl_only
def test_nixl_dead_peer_fails_fast(peer, nixl_prefill):
    name, conn, proc = peer
    prefill = pool(16, 0)
    nixl_prefill.register(prefill.pages, LAYOUT)
    assert conn.poll(60)
    nixl_prefill.connect(name, conn.recv()[0])
    assert wait(nixl_prefill, nixl_prefill.write_pages(name, [1], [1], b"warm"))[0] == "done"
    assert conn.poll(20) and conn.recv()[0]  # connected and delivered; now it dies
    proc.kill()
    proc.join(10)
    h = nixl_prefill.write_pages(name, SRC, DST, b"req-2", timeout_s=5)
    state, took = wait(nixl_prefill, h)
    assert state == "failed" and took < 6, (state, took)
    assert "failed" in nixl_prefill.error(h) or "timed out" in nixl_prefill.error(h)
    print(f"dead peer: failed after {took:.3f} s: {nixl_prefill.error(h)}")


# ---- the local backend between processes (process_vm_writev + a loopback notice) -----------


def _local_peer(conn, name: str) -> None:
    torch.set_num_threads(1)
    decode = pool(24, 1)
    backend = create_transfer_backend("local", name)
    conn.send((backend.register(decode.pages, LAYOUT), decode.pages.clone()))
    deadline, got = time.monotonic() + 20, []
    while not got and time.monotonic() < deadline:
        got = backend.notifications()
        time.sleep(0.002)
    conn.send((got, decode.pages.clone()))
    conn.recv()  # stay alive until told, or until killed
    backend.close()


def test_local_backend_between_processes():
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    name = f"decode-{uuid.uuid4().hex[:8]}"
    proc = ctx.Process(target=_local_peer, args=(there, name), daemon=True)
    proc.start()
    prefill = pool(16, 0)
    a = create_transfer_backend("local", f"prefill-{uuid.uuid4().hex[:8]}")
    try:
        a.register(prefill.pages, LAYOUT)
        assert here.poll(60), "the decode process did not start"
        descriptor, before = here.recv()
        a.connect(name, descriptor)
        h = a.write_pages(name, SRC, DST, b"req-1")
        assert a.poll(h) == "done", a.error(h)
        assert here.poll(20)
        notes, after = here.recv()
        assert notes == [(a.name, b"req-1")]
        assert same_bytes(after, expected_after(before, prefill.pages))
        proc.kill()
        proc.join(10)
        for src, dst in ((SRC, DST), ([], [])):  # pages, or the notice alone
            h = a.write_pages(name, src, dst, b"req-2")
            assert a.poll(h) == "failed" and "is gone" in a.error(h)
    finally:
        a.close()
        if proc.is_alive():
            proc.kill()
