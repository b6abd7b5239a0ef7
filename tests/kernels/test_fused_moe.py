"""Triton fused MoE against its torch reference, on CPU under the interpreter, and the alignment
step alone.

Every test name contains `triton` (`pytest -k triton`). The kernels run with the tile sizes the
GPU uses (`moe_config`), plus small forced tiles for multi-step K loops, wrapped column tiles and
several alignment chunks. Set SWASERVE_TEST_TRITON_CUDA=1 to run them compiled on a CUDA device.

The kernels round where the reference rounds, so float32 agrees to summation order and bfloat16
to a last-bit flip now and then.
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from swaserve.ops.fused_moe import (  # noqa: E402
    MoEConfig,
    align_num_blocks,
    fused_moe,
    fused_moe_reference,
    fused_moe_with_config,
    moe_align,
)

DEVICE = torch.device("cuda" if _CUDA else "cpu")
HIDDEN, INTER = 32, 64


def _routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [t, k] float32, not normalised; topk_ids [t, k] int32): distinct experts per
    token, the last expert never chosen when k < e (an expert with no token), so with t > 1
    tokens share experts."""
    gen = torch.Generator().manual_seed(seed)
    pool = e - 1 if k < e else e
    ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) * 1.5
    return weights.to(DEVICE), ids.to(DEVICE, torch.int32)


def _problem(t, e, k, dtype, bias, seed=0, h=HIDDEN, i=INTER):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)

    x = randn(t, h)
    w13 = randn(e, 2 * i, h, scale=h**-0.5)
    w2 = randn(e, h, i, scale=i**-0.5)
    b13 = randn(e, 2 * i, scale=0.5) if bias else None
    b2 = randn(e, h, scale=0.5) if bias else None
    weights, ids = _routing(t, e, k, seed + 1)
    return x, w13, w2, weights, ids, b13, b2


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = want.float().abs().max().item() + 1e-6
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)
    else:  # same rounding points: equal but where float32 order flips a last bit
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)
        same = (got.float() - want.float()).abs() <= 1e-6
        assert same.float().mean().item() > 0.95


# ---- alignment --------------------------------------------------------------------------------


def _expected_layout(ids: torch.Tensor, e: int, block_m: int) -> tuple[list[int], list[int]]:
    """The documented layout built in Python: each expert's slots ascending, padded with N to a
    multiple of block_m, experts in order, then N up to the shape-only length (expert -1)."""
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for ex in range(e):
        slots = [s for s, x in enumerate(flat) if x == ex]
        blocks = triton.cdiv(len(slots), block_m)
        sorted_ids += slots + [n] * (blocks * block_m - len(slots))
        expert_ids += [ex] * blocks
    num_blocks = align_num_blocks(n, e, block_m)
    sorted_ids += [n] * (num_blocks * block_m - len(sorted_ids))
    expert_ids += [-1] * (num_blocks - len(expert_ids))
    return sorted_ids, expert_ids


@pytest.mark.parametrize(
    "t,e,k,block_m,chunk",
    [
        (1, 4, 1, 16, None),  # decode: one slot
        (3, 8, 2, 16, None),
        (17, 8, 4, 32, None),
        (64, 8, 4, 16, 16),  # 16 chunks: count kernel + cumsum + scatter
        (40, 128, 4, 16, None),  # E_PAD 128: chunks of 64, 3 of them
        (64, 4, 4, 64, 64),  # every expert gets every token
    ],
)
def test_triton_moe_align(t, e, k, block_m, chunk):
    _, ids = _routing(t, e, k, seed=t + e)
    ids = ids.to(torch.int64) if e == 128 else ids  # both id dtypes
    n = t * k
    sorted_ids, expert_ids = moe_align(ids, e, block_m, chunk)
    num_blocks = align_num_blocks(n, e, block_m)
    assert sorted_ids.dtype == expert_ids.dtype == torch.int32
    assert sorted_ids.shape == (num_blocks * block_m,) and expert_ids.shape == (num_blocks,)
    got_sorted, got_experts = sorted_ids.cpu(), expert_ids.cpu()

    # every (token, k) slot exactly once; everything else is the padding mark N
    real = got_sorted[got_sorted < n]
    assert torch.equal(real.sort().values, torch.arange(n, dtype=torch.int32))
    assert bool(((got_sorted < n) | (got_sorted == n)).all())
    # blocks are single-expert; blocks with expert -1 hold padding only and come last
    flat = ids.reshape(-1).cpu()
    blocks = got_sorted.view(num_blocks, block_m)
    for b in range(num_blocks):
        row = blocks[b][blocks[b] < n].long()
        if got_experts[b] < 0:
            assert row.numel() == 0 and bool((got_experts[b:] == -1).all())
        else:
            assert row.numel() > 0 and bool((flat[row] == got_experts[b]).all())
    # and the exact documented layout (ascending slots per expert, experts in order)
    want_sorted, want_experts = _expected_layout(ids.cpu(), e, block_m)
    assert got_sorted.tolist() == want_sorted
    assert got_experts.tolist() == want_experts


# ---- fused MoE --------------------------------------------------------------------------------


SHAPES = [(1, 4, 1), (1, 8, 4), (3, 8, 2), (17, 4, 2), (17, 8, 4), (64, 8, 1), (64, 4, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "swigluoai", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t,e,k", SHAPES)
def test_triton_fused_moe(t, e, k, bias, activation, dtype):
    x, w13, w2, weights, ids, b13, b2 = _problem(t, e, k, dtype, bias, seed=t * 10 + e + k)
    limit = 0.75  # small enough that both clamps of swigluoai bite on these values
    got = fused_moe(x, w13, w2, weights, ids, b13, b2, activation, limit)
    want = fused_moe_reference(x, w13, w2, weights, ids, b13, b2, activation, limit)
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "h,i,cfg,chunk",
    [
        # K loops of 4 steps, 4 column tiles, groups of 2 blocks, 8 alignment chunks
        (64, 64, MoEConfig(16, 16, 16, 16, 2, 4, 2), 16),
        # H, I not multiples of BLOCK_K or BLOCK_N: masked K tails, wrapped column tiles
        (40, 24, MoEConfig(32, 16, 16, 16, 1, 4, 2), None),
    ],
)
def test_triton_fused_moe_tiles(h, i, cfg, chunk, dtype):
    t, e, k = 64, 8, 2
    x, w13, w2, weights, ids, b13, b2 = _problem(t, e, k, dtype, True, seed=5, h=h, i=i)
    got = fused_moe_with_config(x, w13, w2, weights, ids, b13, b2, "swigluoai", 1.0, cfg, chunk)
    _close(got, fused_moe_reference(x, w13, w2, weights, ids, b13, b2, "swigluoai", 1.0))


def test_triton_fused_moe_int64_ids_strided_x_no_tokens():
    x, w13, w2, weights, ids, _, _ = _problem(3, 8, 2, torch.float32, False)
    wide = torch.cat([x, x], dim=1)[:, :HIDDEN]  # row stride 2 * HIDDEN
    want = fused_moe_reference(x, w13, w2, weights, ids)
    _close(fused_moe(wide, w13, w2, weights, ids.long()), want)
    empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, HIDDEN) and empty.dtype == x.dtype


@pytest.mark.skipif(_CUDA, reason="the CPU fallback")
def test_triton_fused_moe_cpu_fallback_is_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, w13, w2, weights, ids, b13, b2 = _problem(5, 4, 2, torch.bfloat16, True)
    got = fused_moe(x, w13, w2, weights, ids, b13, b2, "swigluoai")
    assert torch.equal(got, fused_moe_reference(x, w13, w2, weights, ids, b13, b2, "swigluoai"))
