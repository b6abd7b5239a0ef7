"""The CPU backend's native paged attention (swaserve/ops/native/paged_attention.c) against the
torch backend on the same pool: decodes and chunks of any length in one step, sliding and full
layers, GQA, soft-capping, sinks, float32, bfloat16 and FP8 pools (whose chunks stay with
torch), retired pages; a row's result whatever rows it is computed with."""

from __future__ import annotations

import math

import pytest
import torch

from swaserve.attention.base import AttentionInputs
from swaserve.attention.cpu_backend import CpuBackend
from swaserve.attention.torch_backend import TorchBackend
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import build_layout
from swaserve.memory.kv_pool import KVPool
from swaserve.models.blocks import AttentionSpec
from swaserve.ops import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no C compiler here")

FP8 = torch.float8_e4m3fn


def _step(qlens, ctxs, *, window, h, hkv, d, kv_dtype, q_dtype, page_size=4, seed=0):
    """A step over a random pool: two layers (0 sliding, 1 full), page tables with the sliding
    group's pages before its window retired to NULL."""
    g = torch.Generator().manual_seed(seed)
    layout = build_layout([window, None])
    npages = [math.ceil((n + c) / page_size) for n, c in zip(qlens, ctxs)]
    num_pages = 1 + 2 * sum(npages) + 2
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables = []
    for c, p in zip(ctxs, npages):
        sliding, free = free[:p], free[p:]
        full, free = free[:p], free[p:]
        start = max(0, c - window + 1)
        sliding[: start // page_size] = [0] * (start // page_size)
        tables.append([sliding, full])
    pool = KVPool(layout, num_pages, page_size, hkv, d, kv_dtype, torch.device("cpu"))
    pool.pages.copy_(torch.randn(pool.pages.shape, generator=g).to(kv_dtype))
    pool.pages[0] = 0  # the NULL page: the torch backend's padding reads it, masked
    if kv_dtype == FP8:
        pool.set_scales([0.5, 0.25], [0.125, 0.5])
    t = sum(qlens)
    q = torch.randn(t, h, d, generator=g).to(q_dtype)
    kv_new = [(torch.randn(t, hkv, d, generator=g).to(q_dtype),
               torch.randn(t, hkv, d, generator=g).to(q_dtype)) for _ in range(2)]
    inputs = AttentionInputs(list(qlens), list(ctxs), page_tables=tables)
    pos = torch.cat([torch.arange(c, c + n) for n, c in zip(qlens, ctxs)])
    return layout, pool, q, kv_new, inputs, pos


def _forward(backend_cls, layout, pool, q, kv_new, inputs, pos, specs, sinks):
    backend = backend_cls(layout, pool.page_size, torch.device("cpu"))
    fb = ForwardBatch(pos.clone(), pos, backend, backend.prepare(inputs), pool)
    outs = [backend.forward(q, k, v, spec, sinks, fb) for spec, (k, v) in zip(specs, kv_new)]
    return outs, fb


CASES = [  # qlens, ctxs: decodes; decodes and chunks (rows of several work items) in one step
    ([1, 1, 1, 1, 1], [0, 7, 23, 40, 150]),  # past one block of 64 keys
    ([1, 3, 16, 17, 1, 30, 70], [17, 6, 70, 0, 31, 4, 60]),
]


@pytest.mark.parametrize("qlens,ctxs", CASES)
@pytest.mark.parametrize("h,hkv,d", [(4, 1, 32), (6, 2, 16), (4, 4, 8)])
@pytest.mark.parametrize("softcap,use_sinks", [(None, False), (3.0, False), (None, True)])
def test_native_equals_torch_backend(qlens, ctxs, h, hkv, d, softcap, use_sinks):
    window = 6
    layout, pool, q, kv_new, inputs, pos = _step(
        qlens, ctxs, window=window, h=h, hkv=hkv, d=d, kv_dtype=torch.float32,
        q_dtype=torch.float32, seed=h * 10 + d,
    )  # fmt: skip
    specs = [AttentionSpec(0, h, hkv, d, d**-0.5, window, softcap),
             AttentionSpec(1, h, hkv, d, d**-0.5, None, softcap)]
    sinks = torch.randn(h) if use_sinks else None
    want, _ = _forward(TorchBackend, layout, pool, q, kv_new, inputs, pos, specs, sinks)
    before = pool.pages.clone()
    got, fb = _forward(CpuBackend, layout, pool, q, kv_new, inputs, pos, specs, sinks)
    assert torch.equal(pool.pages, before)  # the native store wrote what the torch one did
    assert fb.metadata.groups[0]._views["native"]["native"].tolist() == list(range(len(qlens)))
    for w, o in zip(want, got):
        assert not o.isnan().any()
        torch.testing.assert_close(o, w, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32),
                                              (FP8, torch.float32)])
def test_native_reads_bf16_and_fp8_pools(kv_dtype, q_dtype):
    """FP8: decodes go native; a longer chunk reads its own keys at full precision (torch)."""
    qlens, ctxs = CASES[1]
    layout, pool, q, kv_new, inputs, pos = _step(
        qlens, ctxs, window=5, h=4, hkv=2, d=16, kv_dtype=kv_dtype, q_dtype=q_dtype, seed=3
    )
    specs = [AttentionSpec(0, 4, 2, 16, 0.25, 5), AttentionSpec(1, 4, 2, 16, 0.25, None)]
    want, _ = _forward(TorchBackend, layout, pool, q, kv_new, inputs, pos, specs, None)
    got, fb = _forward(CpuBackend, layout, pool, q, kv_new, inputs, pos, specs, None)
    native = fb.metadata.groups[0]._views["native"]["native"].tolist()
    assert native == [r for r, n in enumerate(qlens) if kv_dtype != FP8 or n == 1]
    tol = 1e-2 if q_dtype == torch.bfloat16 else 2e-5
    for w, o in zip(want, got):
        assert o.dtype == q_dtype
        torch.testing.assert_close(o.float(), w.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("h,hkv,d", [(4, 1, 32), (6, 2, 16), (3, 3, 24)])  # 24: plain C
def test_a_row_equals_itself_in_any_batch(h, hkv, d):
    """A query row's result does not depend on the rest of the step, bit for bit: each row of
    an 11-row chunk (several work items, across a block of 64 keys) equals a decode at its
    position alone, and a decode beside others equals itself alone (with sinks)."""
    window = 40
    layout, pool, q, kv_new, inputs, pos = _step(
        [1, 11, 1], [9, 60, 20], window=window, h=h, hkv=hkv, d=d, kv_dtype=torch.float32,
        q_dtype=torch.float32, seed=5,
    )  # fmt: skip
    specs = [AttentionSpec(0, h, hkv, d, 0.2, window), AttentionSpec(1, h, hkv, d, 0.2, None)]
    sinks = torch.randn(h)
    together, _ = _forward(CpuBackend, layout, pool, q, kv_new, inputs, pos, specs, sinks)
    for row, r, ctx in [(12, 2, 20)] + [(1 + i, 1, 60 + i) for i in range(11)]:
        alone_inputs = AttentionInputs([1], [ctx], page_tables=[inputs.page_tables[r]])
        one = slice(row, row + 1)
        alone, _ = _forward(CpuBackend, layout, pool, q[one], [(k[one], v[one]) for k, v in kv_new],
                            alone_inputs, pos[one], specs, sinks)  # fmt: skip
        for t, a in zip(together, alone):
            assert torch.equal(t[one], a), (row, ctx)


def test_a_layer_wider_than_its_group_is_an_error():
    layout, pool, q, kv_new, inputs, pos = _step(
        [1, 1], [20, 3], window=4, h=4, hkv=1, d=8, kv_dtype=torch.float32,
        q_dtype=torch.float32,
    )  # fmt: skip
    wide = [AttentionSpec(0, 4, 1, 8, 0.3, 9)]  # group 0 keeps 4 keys a request
    with pytest.raises(ValueError, match="window"):
        _forward(CpuBackend, layout, pool, q, kv_new[:1], inputs, pos, wide, None)


def test_the_cpu_default_and_the_eager_reference():
    from swaserve.config import EngineConfig

    assert EngineConfig(model="x", device="cpu").backend_name() == "cpu"
    assert EngineConfig(model="x", device="cpu", disable_fused_ops=True).backend_name() == "torch"


@pytest.mark.parametrize("d", [64, 256, 24])  # 24: the plain C path (head_dim % 16 != 0)
def test_peaked_and_flat_scores(d):
    """Scores from far below to near the row's maximum (the kernel's own exponential) and all
    equal, over several blocks of keys."""
    qlens, ctxs = [1, 1, 5], [200, 130, 90]
    layout, pool, q, kv_new, inputs, pos = _step(
        qlens, ctxs, window=300, h=2, hkv=1, d=d, kv_dtype=torch.float32,
        q_dtype=torch.float32, seed=d,
    )  # fmt: skip
    # peaked: scores of spread 5 (e^-30 and below to the maximum); flat: all zero
    for scale in (5 * d**-0.5, 0.0):
        specs = [AttentionSpec(0, 2, 1, d, scale, 300), AttentionSpec(1, 2, 1, d, scale, None)]
        want, _ = _forward(TorchBackend, layout, pool, q, kv_new, inputs, pos, specs, None)
        got, _ = _forward(CpuBackend, layout, pool, q, kv_new, inputs, pos, specs, None)
        for w, o in zip(want, got):
            torch.testing.assert_close(o, w, atol=2e-5, rtol=1e-5)


def test_more_query_heads_a_kv_head_than_the_kernel_holds_take_torch():
    qlens, ctxs = [1, 3], [10, 4]
    layout, pool, q, kv_new, inputs, pos = _step(
        qlens, ctxs, window=6, h=32, hkv=1, d=8, kv_dtype=torch.float32, q_dtype=torch.float32
    )
    specs = [AttentionSpec(0, 32, 1, 8, 0.3, 6), AttentionSpec(1, 32, 1, 8, 0.3, None)]
    want, _ = _forward(TorchBackend, layout, pool, q, kv_new, inputs, pos, specs, None)
    got, fb = _forward(CpuBackend, layout, pool, q, kv_new, inputs, pos, specs, None)
    assert "native" not in fb.metadata.groups[0]._views
    for w, o in zip(want, got):
        assert torch.equal(o, w)
