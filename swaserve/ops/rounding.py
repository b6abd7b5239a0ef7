"""Rounding float32 values to a tensor's dtype inside Triton kernels, as the eager code does.

The kernels round where the eager torch code rounds (after each op in the tensor dtype), so their
results match it bit for bit, up to reduction order. Two compilers get in the way of doing that
with plain casts: Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU tests) truncates
float32 -> bfloat16 instead of rounding to nearest even, and on the GPU a cast round trip
`x.to(bf16).to(fp32)` feeding further arithmetic did not keep its rounding (seen on H200: about
15% of outputs off by one bfloat16 step). So bfloat16 rounding is done on the bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 `x` rounded to nearest even in `dtype`, as a float32 value."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 `x` rounded to nearest even in `dtype` (exact casts once rounded)."""
    return rounded(x, dtype).to(dtype)
