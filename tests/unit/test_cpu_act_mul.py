"""The gated MLP's native pass (swaserve/ops/native/act_mul.c through
`cpu_gated.NativeGatedProj`) against float64 and against torch on the same merged GEMM: each
activation, both tails, biases, leading dims, zero rows, widths that leave a scalar tail; and
`cpu_pack`'s choice among the three gated paths."""

from __future__ import annotations

import pytest
import torch

from swaserve.models.blocks import ACTIVATIONS, GatedMLP
from swaserve.ops import cpu_gated, cpu_linear
from swaserve.ops.cpu_linear import PackedWeight
from swaserve.ops.cpu_pack import pack_cpu_weights

pytestmark = pytest.mark.skipif(
    not (cpu_linear.available() and cpu_gated.native_available("silu")),
    reason="no oneDNN or no native kernels",
)
EPS = torch.finfo(torch.float32).eps


def _f64(act: str, g: torch.Tensor) -> torch.Tensor:
    """act(g) in float64, as x sigmoid(z): 0.5 (1 + tanh(y)) = sigmoid(2 y), without the
    cancellation of 1 + tanh(y) in the far negative tail (float64 loses it too, past x ~ -7)."""
    g = g.double()
    z = g if act == "silu" else 2 * 0.7978845608028654 * (g + 0.044715 * g**3)
    return g * torch.sigmoid(z)


def _ulps(act: str, g: torch.Tensor) -> torch.Tensor:
    """The error allowed, in float32 ulps of the result: a few roundings, plus, for tanh-GELU,
    z's own rounding (~3 ulps of z) carried through e^-|z|, which multiplies a relative error
    by |z| (SiLU's z is x itself, exact)."""
    if act == "silu":
        return torch.full_like(g, 8.0, dtype=torch.float64)
    z = 2 * 0.7978845608028654 * (g.double() + 0.044715 * g.double() ** 3)
    return 8.0 + 4.0 * z.abs()


def _native(act: str, gu: torch.Tensor) -> torch.Tensor:
    from swaserve.ops import cpu_native

    t, n2 = gu.shape
    out = torch.empty(t, n2 // 2)
    code = cpu_gated.NATIVE_ACTS[act]
    lib = cpu_native.library()
    assert lib.swa_act_mul(out.data_ptr(), gu.data_ptr(), n2, t, n2 // 2, code) == 0
    return out


@pytest.mark.parametrize("act", sorted(cpu_gated.NATIVE_ACTS))
@pytest.mark.parametrize("width", [200, 2048])  # 200: 12 vectors of 16 and a scalar tail of 8
def test_the_pass_is_within_a_few_ulps_of_float64(act, width):
    gen = torch.Generator().manual_seed(0)
    gu = torch.randn(33, 2 * width, generator=gen) * 6  # both tails, past x = -20
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 90.0, -90.0, 1e-3, -1e-3])
    got = _native(act, gu)
    g, u = gu[:, :width], gu[:, width:]
    want = _f64(act, g) * u.double()
    err = (got.double() - want).abs()
    assert (err <= _ulps(act, g) * EPS * want.abs() + 1e-38).all(), err.max()


@pytest.mark.parametrize("act", sorted(cpu_gated.NATIVE_ACTS))
def test_the_pass_is_torchs_activation_where_torch_is_accurate(act):
    """Against torch's own formulas: a few ulps of the output's scale (torch's tanh-GELU loses
    the far negative tail to 1 + tanh cancelling; the scale there is |x u|)."""
    gen = torch.Generator().manual_seed(1)
    gu = torch.randn(16, 2 * 640, generator=gen) * 4
    got = _native(act, gu)
    g, u = gu[:, :640], gu[:, 640:]
    want = ACTIVATIONS[act](g) * u
    assert (got - want).abs().le(8 * EPS * (g * u).abs() + 1e-38).all()


def test_unknown_activation_code_is_refused():
    from swaserve.ops import cpu_native

    gu, out = torch.randn(2, 8), torch.empty(2, 4)
    assert cpu_native.library().swa_act_mul(out.data_ptr(), gu.data_ptr(), 8, 2, 4, 7) == -1


@pytest.mark.parametrize("act", sorted(cpu_gated.NATIVE_ACTS))
@pytest.mark.parametrize("bias", [False, True])
def test_native_proj_matches_torch_on_the_same_gemm(act, bias):
    gen = torch.Generator().manual_seed(2)
    k, n = 96, 200
    w = torch.randn(2 * n, k, generator=gen) * 0.2
    b = torch.randn(2 * n, generator=gen) if bias else None
    proj = cpu_gated.NativeGatedProj(PackedWeight(w), b, act)
    x = torch.randn(3, 7, k, generator=gen) * 3
    gate, up = proj.gate_up.linear(x, b).chunk(2, dim=-1)
    got = proj(x)
    assert got.shape == (3, 7, n)
    want = _f64(act, gate) * up.double()
    assert ((got.double() - want).abs() <= _ulps(act, gate) * EPS * want.abs() + 1e-38).all()
    torch.testing.assert_close(got, ACTIVATIONS[act](gate) * up, rtol=1e-5, atol=1e-5)
    assert proj(x[:0]).shape == (0, 7, n)


def test_native_proj_refuses_odd_rows_and_unknown_activations():
    with pytest.raises(ValueError, match="odd"):
        cpu_gated.NativeGatedProj(PackedWeight(torch.randn(9, 4)), None, "silu")
    with pytest.raises(ValueError, match="no native gated pass"):
        cpu_gated.NativeGatedProj(PackedWeight(torch.randn(8, 4)), None, "gelu")


@pytest.mark.parametrize("native,post_ops", [(True, True), (False, True), (False, False)])
def test_pack_prefers_native_then_post_ops_then_the_merged_gemm(monkeypatch, native, post_ops):
    monkeypatch.setattr(cpu_gated, "native_available", lambda act: native)
    monkeypatch.setattr(cpu_gated, "available", lambda act: post_ops)
    torch.manual_seed(3)
    mlp = GatedMLP(32, 48, "gelu_pytorch_tanh")
    x = torch.randn(6, 32)
    want = mlp(x)
    pack_cpu_weights(mlp)
    kind = type(mlp.gated_proj).__name__ if mlp.gated_proj is not None else None
    assert kind == ("NativeGatedProj" if native else "PackedGatedProj" if post_ops else None)
    assert (mlp.gate_up_proj is not None) == (not native and not post_ops)
    assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
