"""Triton neox rotary embedding (rotate_half) of q and k together, in one launch.

One program per token rotates all its q heads and all its k heads, computing cos/sin once from
`position * inv_freq` in float32. Only the first `rot = 2 * len(inv_freq)` dims of each head
turn (partial rotary); the rest stay as they are. As `blocks.Rotary`, cos/sin and every product
are rounded to the input dtype before the sum:

    x1, x2 = x[:rot/2], x[rot/2:rot]
    out1 = x1 * cos - x2 * sin        out2 = x2 * cos + x1 * sin
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.ops.rounding import round_to, rounded


@triton.jit
def _rotate_heads(
    X, stride_t, stride_h, t, H, cos, sin, HALF, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < H) & (d[None, :] < HALF)
    p1 = X + t.to(tl.int64) * stride_t + heads[:, None] * stride_h + d[None, :]
    p2 = p1 + HALF
    dtype = X.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    x1c = rounded(x1 * cos, dtype)
    x2s = rounded(x2 * sin, dtype)
    x2c = rounded(x2 * cos, dtype)
    x1s = rounded(x1 * sin, dtype)
    tl.store(p1, round_to(x1c - x2s, dtype), mask=mask)
    tl.store(p2, round_to(x2c + x1s, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, POS, INV_FREQ,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h,
    HQ, HK, HALF, SCALE,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    d = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(INV_FREQ + d, mask=d < HALF, other=0.0).to(tl.float32)
    freqs = tl.load(POS + t).to(tl.float32) * inv_freq
    dtype = Q.dtype.element_ty
    cos = rounded(tl.cos(freqs) * SCALE, dtype)[None, :]  # SCALE: YaRN's, in float32
    sin = rounded(tl.sin(freqs) * SCALE, dtype)[None, :]
    _rotate_heads(Q, q_stride_t, q_stride_h, t, HQ, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(K, k_stride_t, k_stride_h, t, HK, cos, sin, HALF, BLOCK_HK, BLOCK_HALF)


def rotary_blocks(hq: int, hk: int, half: int) -> tuple[int, int, int]:
    """The kernel's (BLOCK_HQ, BLOCK_HK, BLOCK_HALF) for hq q heads, hk k heads and `half`
    rotary pairs. At least one lane each: a q of zero heads turns the keys alone (the DFlash
    drafter's context keys), its one lane masked off."""
    return (max(1, triton.next_power_of_2(hq)), max(1, triton.next_power_of_2(hk)),
            triton.next_power_of_2(half))


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    inplace: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, H, D]` and k `[T, Hkv, D]` at `positions` `[T]`; `inv_freq` is `[rot/2]`
    with rot <= D; cos/sin are multiplied by `scale` (YaRN's attention scaling) in float32.
    In place unless `inplace=False`; returns the rotated (q, k)."""
    t, hq, dim = q.shape
    hk = k.shape[1]
    half = inv_freq.shape[0]
    assert k.shape[0] == t and k.shape[2] == dim and 2 * half <= dim and q.dtype == k.dtype
    if not inplace:
        q, k = q.clone(), k.clone()
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary needs unit stride in head_dim"
    if t == 0:
        return q, k
    block_hq, block_hk, block_half = rotary_blocks(hq, hk, half)
    num_warps = min(8, max(1, block_hq * block_half // 256))
    _rotary_kernel[(t,)](
        q, k, positions, inv_freq.contiguous(),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        hq, hk, half, float(scale),
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, num_warps=num_warps,
    )  # fmt: skip
    return q, k
