"""Triton gated activation: act(gate) * up in one elementwise launch.

As the eager `GatedMLP`, act(gate) is rounded to the input dtype before the product. GELU with
tanh uses the identity 0.5 * (1 + tanh(y)) = sigmoid(2y).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swaserve.ops.rounding import round_to, rounded

BLOCK = 1024
ACT_IDS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


@triton.jit
def _act_and_mul_kernel(G, U, OUT, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = OUT.dtype.element_ty
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g * tl.sigmoid(g)
    elif ACT == 1:
        a = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))  # 2 * sqrt(2/pi)
    else:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    tl.store(OUT + offs, round_to(rounded(a, dtype) * u, dtype), mask=mask)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for same-shaped gate and up; `act` is a `blocks.ACTIVATIONS` name."""
    assert gate.shape == up.shape and gate.dtype == up.dtype
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _act_and_mul_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, out, n, ACT=ACT_IDS[act], BLOCK=BLOCK, num_warps=4
        )
    return out
