"""MXFP4 (OCP microscaling FP4) checkpoint tensors, dequantised at load (gpt-oss experts).

A weight of logical shape [..., R, C] is stored as two tensors:

    X_blocks [..., R, C/32, 16] uint8   32 e2m1 values per block, two per byte:
                                        element 2j in the low nibble of byte j, 2j+1 in the high
    X_scales [..., R, C/32]     uint8   one e8m0 exponent per block, bias 127

and value = E2M1[nibble] * 2 ** (scale - 127), with E2M1 nibble = sign bit (8) | 3-bit magnitude
code. Every product is exact in bfloat16 and float32 (at most 2 mantissa bits).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK = 32
_CHUNK = 1 << 20  # blocks dequantised at a time


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] of `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(E2M1, dtype=dtype, device=blocks.device)
    b = blocks.reshape(-1, BLOCK // 2)
    exp = scales.reshape(-1, 1)
    out = torch.empty(b.shape[0], BLOCK, dtype=dtype, device=b.device)
    for r in range(0, b.shape[0], _CHUNK):  # bounds the int index tensors' memory
        blk, sub = b[r : r + _CHUNK], out[r : r + _CHUNK]
        sub[:, 0::2] = lut[(blk & 0x0F).int()]
        sub[:, 1::2] = lut[(blk >> 4).int()]
        torch.ldexp(sub, exp[r : r + _CHUNK].int() - SCALE_BIAS, out=sub)
    return out.view(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def join_mxfp4(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, transpose: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a checkpoint's (name, tensor) stream through, replacing each `X_blocks` / `X_scales`
    pair (in any order, anywhere in the stream) by (X, the dequantised [..., R, C] tensor, or its
    [..., C, R] view with `transpose`, as transformers lays gpt-oss experts out). A half whose
    partner never comes is passed through under its own name (the loader then reports it)."""
    pending: dict[str, tuple[str, torch.Tensor]] = {}  # base name -> (suffix, tensor)
    for name, t in tensors:
        base, _, suffix = name.rpartition("_")
        if not base or suffix not in ("blocks", "scales"):
            yield name, t
            continue
        other = pending.pop(base, None)
        if other is None or other[0] == suffix:
            if other is not None:  # the same half twice: pass the first one on
                yield f"{base}_{other[0]}", other[1]
            pending[base] = (suffix, t)
            continue
        blocks, scales = (t, other[1]) if suffix == "blocks" else (other[1], t)
        dense = dequantize_mxfp4(blocks, scales, dtype)
        yield base, dense.transpose(-1, -2) if transpose else dense
    for base, (suffix, t) in pending.items():
        yield f"{base}_{suffix}", t
