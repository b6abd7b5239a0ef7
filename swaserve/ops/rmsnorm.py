"""Triton RMSNorm, optionally with the residual add (and Gemma's sandwich norm) fused in front.

One program normalises BLOCK_M rows, each whole in one tile (N <= BLOCK_N). Numerics follow
`blocks.RMSNorm` and the eager residual add step for step, so only reduction order differs:

    s = (residual + x).to(dtype)             the residual stream stays in the input dtype
    rstd = rsqrt(mean(s.float() ** 2) + eps)
    unit_offset (Gemma):  y = (s * rstd * (1 + w)).to(dtype)
    otherwise (Llama):    y = ((s * rstd).to(dtype) * w).to(dtype)   HF rounds before the weight

With `x_norm` (Gemma's post-attention / post-feedforward norms) x is first replaced by
`x_norm(x)`, rounded to dtype, before the add.

x may be a strided `[T, H, D]` view (per-head q/k norms on slices of one merged qkv output):
row r of the flattened input sits at (r // H) * stride_t + (r % H) * stride_h, and it is read in
place. The outputs are contiguous.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from swaserve.ops.pdl import pdl_enabled, pdl_launch, pdl_wait
from swaserve.ops.rounding import round_to, rounded

TILE_ELEMENTS = 4096  # rows are packed into one program up to this many elements


class NormParams(Protocol):
    """What a norm needs (`blocks.RMSNorm` has these attributes)."""

    weight: torch.Tensor
    eps: float
    unit_offset: bool


@triton.jit
def _normalize(x, w, eps, N, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    xn = x * rstd[:, None]
    if UNIT_OFFSET:
        y = xn * (1.0 + w[None, :])
    else:
        y = rounded(xn, DTYPE) * w[None, :]
    return round_to(y, DTYPE)


@triton.jit
def _rmsnorm_kernel(
    X, RES, XW, W, Y, RES_OUT,
    M, N, X_INNER, stride_xo, stride_xi, eps, x_eps,
    UNIT_OFFSET: tl.constexpr, X_UNIT_OFFSET: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_XW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (ops/pdl.py)
):  # fmt: skip
    pdl_wait(USE_PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    offs = rows64[:, None] * N + cols[None, :]
    x_offs = (rows64 // X_INNER) * stride_xo + (rows64 % X_INNER) * stride_xi
    dtype = Y.dtype.element_ty
    x = tl.load(X + x_offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_XW:
        xw = tl.load(XW + cols, mask=cols < N, other=0.0).to(tl.float32)
        x = _normalize(x, xw, x_eps, N, X_UNIT_OFFSET, dtype).to(tl.float32)
    if HAS_RES:
        s = round_to(x + tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(RES_OUT + offs, s, mask=mask)
        x = s.to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Y + offs, _normalize(x, w, eps, N, UNIT_OFFSET, dtype), mask=mask)


def _row_layout(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x, H, stride_t, stride_h) with `x` readable as `[rows / H, H, N]` at those strides and
    unit stride in N; `x` is copied only when no such view exists."""
    if x.dim() >= 3 and x.stride(-1) == 1:
        try:
            x3 = x.view(-1, x.shape[-2], x.shape[-1])
            return x, x3.shape[1], x3.stride(0), x3.stride(1)
        except RuntimeError:  # leading dims not mergeable as a view
            pass
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, 1, x2.stride(0), 0


def _launch(
    x: torch.Tensor,
    norm: NormParams,
    residual: torch.Tensor | None,
    x_norm: NormParams | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual = residual.contiguous()
        res_out = torch.empty_like(y)
    m = x.numel() // n
    if m == 0:
        return y, res_out
    x, inner, stride_xo, stride_xi = _row_layout(x)
    block_n = triton.next_power_of_2(n)
    block_m = max(1, TILE_ELEMENTS // block_n)
    num_warps = min(16, max(4, block_m * block_n // 1024))
    xw = x_norm.weight if x_norm is not None else norm.weight
    pdl = pdl_enabled(x.device)
    _rmsnorm_kernel[(triton.cdiv(m, block_m),)](
        x, residual if residual is not None else x, xw, norm.weight, y,
        res_out if res_out is not None else y,
        m, n, inner, stride_xo, stride_xi, norm.eps, x_norm.eps if x_norm is not None else 0.0,
        UNIT_OFFSET=norm.unit_offset,
        X_UNIT_OFFSET=x_norm.unit_offset if x_norm is not None else False,
        HAS_RES=residual is not None, HAS_XW=x_norm is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, USE_PDL=pdl, **pdl_launch(pdl),
    )  # fmt: skip
    return y, res_out


def rmsnorm(x: torch.Tensor, norm: NormParams) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape), in one launch."""
    return _launch(x, norm, None, None)[0]


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm: NormParams,
    x_norm: NormParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) with s = residual + x, or residual + x_norm(x), in one launch."""
    y, s = _launch(x, norm, residual, x_norm)
    assert s is not None
    return y, s
