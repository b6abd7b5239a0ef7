"""The per-row e4m3 quantisation kernel of `--quantization fp8` (swaserve/ops/fp8_linear.py
`_quant_rows_kernel`) equals its torch ops bit for bit: scales and codes, float32 and bfloat16
rows, K not a power of two or past one block, all-zero rows, values far below the row's
largest (subnormal codes), and a row-strided input.

On CPU under the interpreter; SWASERVE_TEST_TRITON_CUDA=1 runs it compiled on a CUDA device.
Every test name contains `triton`.
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from swaserve.ops.fp8_linear import quantize_rows_torch, quantize_rows_triton  # noqa: E402

DEVICE = torch.device("cuda" if _CUDA else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,scale", [(5, 200, 3.0), (3, 4096, 0.01), (2, 96, 1e4),
                                          (1, 1536, 1.0)])  # fmt: skip
def test_triton_fp8_rows_equal_torch(dtype, rows, k, scale):
    gen = torch.Generator().manual_seed(rows * k)
    x = torch.randn(rows, k, generator=gen) * scale
    x[0] = 0.0  # an all-zero row keeps a finite scale
    if rows > 1:
        x[1, :5] = torch.tensor([1e-6, -3e-7, 2e-9, 0.0, -0.0])  # subnormal codes, signed zero
    x = x.to(dtype).to(DEVICE)
    q, s = quantize_rows_triton(x)
    qr, sr = quantize_rows_torch(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_triton_fp8_rows_of_a_strided_input():
    x = torch.randn(4, 2 * 160, generator=torch.Generator().manual_seed(3)).to(DEVICE)[:, ::2]
    q, s = quantize_rows_triton(x)
    qr, sr = quantize_rows_torch(x)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
