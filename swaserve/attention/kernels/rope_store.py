"""One launch for what comes between the q/k/v projection and attention: the per-head q/k
RMSNorms (Qwen3, Gemma 3; optional), the neox rotary embedding of q and k, and the K/V store
into the paged pool. Three to five launches per layer become one (a decode step of a 62-layer
Gemma 3 enqueued ~190 fewer kernels).

Programs are (token, block of heads): q blocks first, then k blocks, which also store their k
and v heads. Steps of fewer than PER_HEAD_BELOW_TOKENS tokens take one head per program (a
batch-1 decode step of Llama-3.1-8B: 40 programs instead of one, 4.5 -> ~2 us a layer); longer
ones one program for all q heads and one for all k heads of a token. Each head is loaded whole
as a `[heads, D]` tile and again permuted by its rotary partner (`d <-> d +- rot/2` for
d < rot), so the norm and the rotation need no slicing; q and k are written back in place (the
attention kernel reads q, and a prefill chunk its own k, from the step's rows), then k and v go
to the token's slot of the layer's cache.

Numerics are those of the separate kernels, which follow the eager blocks step for step
(swaserve/ops/rmsnorm.py, rotary.py, paged_attention.store_kv): the norm rounds to the input
dtype (Llama-style weights after rounding, Gemma's `1 + w` before), cos/sin and every rotary
product are rounded to the input dtype before the sum, an fp8 cache stores `x / scale` rounded
to e4m3, saturated at +-448. A negative slot (padding) stores nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from swaserve.attention.kernels.paged_attention import _run, _write_slot
from swaserve.ops.pdl import pdl_enabled, pdl_launch, pdl_wait
from swaserve.ops.rounding import rounded

PER_HEAD_BELOW_TOKENS = 64  # steps with fewer tokens run one program per (token, head)


@dataclass(frozen=True)
class QKPrologue:
    """What q and k still need before attention: rotary at the step's positions and, when
    given, per-head RMSNorms applied first (`blocks.RMSNorm`: weight, eps, unit_offset)."""

    rotary: torch.nn.Module  # blocks.Rotary
    q_norm: torch.nn.Module | None = None
    k_norm: torch.nn.Module | None = None


@triton.jit
def _rope_heads(
    X, stride_t, stride_h, t, h0, H, W, eps, cos, sin, sign, d, partner, in_rot,
    D: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):  # fmt: skip
    """Heads h0 .. h0 + BLOCK_H - 1 (those < H) of token t: normed (NORM) and rotated, written
    back in place; returned as float32 holding dtype-rounded values."""
    heads = h0 + tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < H) & (d[None, :] < D)
    row = X + t.to(tl.int64) * stride_t + heads[:, None] * stride_h
    dtype = X.dtype.element_ty
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # one per head, for both
        w = tl.load(W + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(W + partner, mask=d < D, other=0.0).to(tl.float32)[None, :]
        if UNIT_OFFSET:
            x = rounded(x * rstd * (1.0 + w), dtype)
            xp = rounded(xp * rstd * (1.0 + wp), dtype)
        else:
            x = rounded(rounded(x * rstd, dtype) * w, dtype)
            xp = rounded(rounded(xp * rstd, dtype) * wp, dtype)
    turned = rounded(x * cos, dtype) + sign * rounded(xp * sin, dtype)
    y = tl.where(in_rot[None, :], rounded(turned, dtype), x)
    tl.store(row + d[None, :], y.to(dtype), mask=mask)
    return y


@triton.jit
def _qk_rope_store_kernel(
    Q, K, V, K_CACHE, V_CACHE, SLOTS, POS, INV_FREQ, QW, KW,
    k_scale, v_scale, rot_scale, q_eps, k_eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cp, stride_co, stride_ch, stride_dp, stride_do, stride_dh,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, FP8: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (swaserve/ops/pdl.py)
):  # fmt: skip
    t = tl.program_id(0)
    j = tl.program_id(1)  # a block of q heads (j < Q_BLOCKS), else of k/v heads
    pdl_wait(USE_PDL)  # q, k, v come from the q/k/v projection just before
    Q_BLOCKS: tl.constexpr = (HQ + BLOCK_HQ - 1) // BLOCK_HQ
    d = tl.arange(0, D_PAD)
    in_rot = d < 2 * HALF
    partner = tl.where(in_rot, tl.where(d < HALF, d + HALF, d - HALF), d)
    inv_freq = tl.load(INV_FREQ + d % HALF, mask=in_rot, other=0.0).to(tl.float32)
    freqs = tl.load(POS + t).to(tl.float32) * inv_freq
    dtype = Q.dtype.element_ty
    cos = rounded(tl.cos(freqs) * rot_scale, dtype)[None, :]  # rot_scale: YaRN's, in float32
    sin = rounded(tl.sin(freqs) * rot_scale, dtype)[None, :]
    sign = tl.where(d < HALF, -1.0, 1.0)[None, :]  # rotate_half: (-x2, x1)
    if j < Q_BLOCKS:
        _rope_heads(Q, stride_qt, stride_qh, t, j * BLOCK_HQ, HQ, QW, q_eps, cos, sin, sign, d,
                    partner, in_rot, D, BLOCK_HQ, NORM, UNIT_OFFSET)  # fmt: skip
        return
    h0 = (j - Q_BLOCKS) * BLOCK_HK
    k = _rope_heads(K, stride_kt, stride_kh, t, h0, HK, KW, k_eps, cos, sin, sign, d, partner,
                    in_rot, D, BLOCK_HK, NORM, UNIT_OFFSET)  # fmt: skip
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot < 0:  # padded token (e.g. a CUDA-graph batch): nothing to store
        return
    hh = h0 + tl.arange(0, BLOCK_HK)
    mask = (hh[:, None] < HK) & (d[None, :] < D)
    v = tl.load(V + t.to(tl.int64) * stride_vt + hh[:, None] * stride_vh + d[None, :],
                mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    _write_slot(k, v, slot, hh, d, mask, K_CACHE, V_CACHE, stride_cp, stride_co, stride_ch,
                stride_dp, stride_do, stride_dh, k_scale, v_scale, PAGE_SIZE, FP8)


def qk_rope_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prologue: QKPrologue,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Norm (when `prologue` has norms) and rotate q `[T, H, D]` and k `[T, Hkv, D]` in place,
    then store k and v `[T, Hkv, D]` at `slot_mapping` in the layer's caches
    `[num_pages, page_size, Hkv, D]` (as `paged_attention.store_kv`), in one launch."""
    t, hq, d = q.shape
    hk = k.shape[1]
    rotary = prologue.rotary
    half = rotary.inv_freq.shape[0]
    assert k.shape == v.shape == (t, hk, d) and 2 * half <= d and q.dtype == k.dtype
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if t == 0:
        return
    qn, kn = prologue.q_norm, prologue.k_norm
    norm = qn is not None
    assert norm == (kn is not None) and (not norm or qn.unit_offset == kn.unit_offset)
    qw = qn.weight if norm else rotary.inv_freq  # dummy pointers when there is no norm
    kw = kn.weight if norm else rotary.inv_freq
    pdl = pdl_enabled(q.device)
    per_head = t < PER_HEAD_BELOW_TOKENS
    bhq = 1 if per_head else triton.next_power_of_2(hq)
    bhk = 1 if per_head else triton.next_power_of_2(hk)
    _run(
        _qk_rope_store_kernel,
        (t, triton.cdiv(hq, bhq) + triton.cdiv(hk, bhk)),
        q, k, v, k_cache, v_cache, slot_mapping, positions, rotary.inv_freq, qw, kw,
        float(k_scale), float(v_scale), float(rotary.attention_scaling),
        qn.eps if norm else 0.0, kn.eps if norm else 0.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=hq, HK=hk, D=d, HALF=half,
        BLOCK_HQ=bhq, BLOCK_HK=bhk, D_PAD=triton.next_power_of_2(d), PAGE_SIZE=k_cache.shape[1],
        NORM=norm, UNIT_OFFSET=bool(norm and qn.unit_offset),
        FP8=k_cache.dtype == torch.float8_e4m3fn, USE_PDL=pdl,
        num_warps=min(8, max(1, bhq * triton.next_power_of_2(d) // 512)), **pdl_launch(pdl),
    )  # fmt: skip
