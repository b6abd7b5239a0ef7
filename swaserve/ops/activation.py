"""Triton gated activation: act(gate) * up in one elementwise launch.

As the eager `GatedMLP`, act(gate) is rounded to the input dtype before the product. GELU with
tanh uses the identity 0.5 * (1 + tanh(y)) = sigmoid(2y). gate and up may be strided row views
(the two halves of one merged gate/up GEMM output): nothing is copied for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.ops.rounding import round_to, rounded

BLOCK = 1024
ACT_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


@triton.jit
def gated(g, u, ACT: tl.constexpr, DTYPE: tl.constexpr):
    """act(g) * u on float32 values, act(g) rounded to DTYPE first (as the eager code); the
    product is returned unrounded. Also the down GEMV's prologue (gemv.py)."""
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))  # 2 * sqrt(2/pi)
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    return rounded(a, DTYPE) * u


@triton.jit
def _act_and_mul_kernel(G, U, OUT, n, stride_g, stride_u, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dtype = OUT.dtype.element_ty
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * n + cols, round_to(gated(g, u, ACT, dtype), dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as `[rows, last dim]` with unit column stride, a view where the layout allows."""
    x = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x if x.stride(-1) == 1 else x.contiguous()


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for same-shaped gate and up; `act` is a `blocks.ACTIVATIONS` name. Returns
    a contiguous tensor of gate's shape."""
    assert gate.shape == up.shape and gate.dtype == up.dtype
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    g, u = _rows(gate), _rows(up)
    n = g.shape[1]
    block = min(BLOCK, triton.next_power_of_2(n))
    _act_and_mul_kernel[(g.shape[0], triton.cdiv(n, block))](
        g, u, out, n, g.stride(0), u.stride(0), ACT=ACT_IDS[act], BLOCK=block, num_warps=4
    )
    return out
