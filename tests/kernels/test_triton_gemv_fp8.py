"""The decode GEMV (swaserve/ops/gemv.py) on float8 e4m3 weights with a scale per output row
(`--quantization fp8`'s Fp8Linear: weights-only fp8 at one or two rows) against a float64
torch reference of W = codes * scale: every tile (the tensor-core one widens the codes to
bfloat16, exactly), with the norm in front, the gated activation in front, bias and residual
behind; and the arguments' contract.

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

from swaserve.models.blocks import RMSNorm  # noqa: E402
from swaserve.ops.activation import act_and_mul  # noqa: E402
from swaserve.ops.fp8_linear import quantize_rows_torch  # noqa: E402
from swaserve.ops.gemv import gemv  # noqa: E402
from tests.kernels.test_triton_gemv import SMALL, _randn, _reference  # noqa: E402

DEVICE = torch.device("cuda" if _CUDA else "cpu")


def _fp8(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [n, k], float32 scales [1, n]) of a random weight, as Fp8Linear keeps them."""
    w = _randn(n, k, dtype=torch.float32, seed=seed) * k**-0.5
    q, s = quantize_rows_torch(w)
    return q.to(DEVICE), s.reshape(1, -1).contiguous().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", sorted(SMALL))
@pytest.mark.parametrize(
    "m, n, k, norm, bias, residual",
    [(1, 48, 64, None, False, False), (1, 40, 96, "llama", False, True),
     (2, 64, 80, "gemma", True, False), (2, 33, 200, "llama", True, True)],
)  # fmt: skip
def test_triton_gemv_fp8_weights_match_reference(dtype, tile, m, n, k, norm, bias, residual):
    x = _randn(m, k, dtype=dtype, seed=1) * 3
    q, s = _fp8(n, k, dtype, seed=2)
    b = _randn(n, dtype=dtype, seed=3) if bias else None
    r = _randn(m, n, dtype=dtype, seed=4) if residual else None
    nm = None
    if norm is not None:
        nm = RMSNorm(k, 1e-6, unit_offset=norm == "gemma")
        with torch.no_grad():
            nm.weight.copy_(_randn(k, dtype=torch.float32, seed=5).cpu() * 0.5 + (norm == "llama"))
        nm = nm.to(DEVICE, dtype)
    got = gemv(x, q, b, norm=nm, residual=r, config=SMALL[tile], weight_scale=s)
    want = _reference(x, q.double() * s.double().T, b, nm, r)
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32 and tile != "dot":
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    else:  # one rounding of the output (and of x to bf16 with `dot` on a GPU)
        err = (got.double() - want).abs() / want.abs().clamp_min(1.0)
        assert err.max().item() < (2e-2 if tile == "dot" else 8e-3)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_triton_gemv_fp8_weights_with_the_activation_in_front(act):
    m, n, k = 2, 24, 72
    gu = _randn(m, 2 * k, dtype=torch.float32, seed=10)
    q, s = _fp8(n, k, torch.float32, seed=11)
    r = _randn(m, n, dtype=torch.float32, seed=12)
    got = gemv(gu, q, residual=r, act=act, config=SMALL["narrow"], weight_scale=s)
    a = act_and_mul(gu[:, :k], gu[:, k:], act)
    want = _reference(a, q.double() * s.double().T, None, None, r)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_triton_gemv_fp8_contract():
    """e4m3 weights need their scales, and only they take one."""
    x = _randn(1, 64, dtype=torch.float32, seed=1)
    q, s = _fp8(32, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, q)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, q.float(), weight_scale=s)
