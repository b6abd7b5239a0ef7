"""act(gate) * up through oneDNN post-ops (swaserve/ops/cpu_gated.py) against torch on the
same packed GEMMs: each activation, biases, leading dims, zero rows; the product is torch's
multiply bit for bit, the activations within a few float32 ulps (which gated path `cpu_pack`
picks: test_cpu_act_mul.py)."""

from __future__ import annotations

import pytest
import torch

from swaserve.models.blocks import ACTIVATIONS
from swaserve.ops import cpu_gated, cpu_linear
from swaserve.ops.cpu_linear import PackedWeight

pytestmark = pytest.mark.skipif(
    not (cpu_linear.available() and cpu_gated.available("silu")), reason="no oneDNN post-ops"
)


@pytest.mark.parametrize("act", sorted(cpu_gated.POST_OPS))
@pytest.mark.parametrize("bias", [False, True])
def test_gated_proj_matches_torch_on_the_same_gemms(act, bias):
    gen = torch.Generator().manual_seed(0)
    k, n = 96, 200
    wg, wu = (torch.randn(n, k, generator=gen) * 0.2 for _ in range(2))
    bg, bu = (torch.randn(n, generator=gen) if bias else None for _ in range(2))
    proj = cpu_gated.PackedGatedProj(PackedWeight(wg), PackedWeight(wu), bg, bu, act)
    x = torch.randn(3, 7, k, generator=gen) * 3  # gate outputs well into both tails
    gate = proj.gate.linear(x, bg)
    up = proj.up.linear(x, bu)
    want_act = ACTIVATIONS[act](gate)
    got = proj(x)
    assert got.shape == (3, 7, n)
    # the activation within 16 ulps of its output's scale (oneDNN's vector exp/tanh differ by
    # ISA: ~3 ulps seen with AVX-512); then the exact product
    eps = torch.finfo(torch.float32).eps
    fine = up.abs() > 1e-2  # the quotient recovers the activation only where up is not tiny
    act_err = (got / up - want_act).abs()[fine]
    assert (act_err <= 16 * eps * want_act.abs()[fine].clamp_min(1.0) + 4 * eps / up.abs()[fine]
            * got.abs()[fine]).all()  # fmt: skip
    torch.testing.assert_close(got, want_act * up, rtol=1e-5, atol=1e-5)
    assert proj(x[:0]).shape == (0, 7, n)


@pytest.mark.parametrize("act", sorted(cpu_gated.POST_OPS))
def test_the_product_is_torchs_multiply_bit_for_bit(act):
    """The binary post-op rounds as torch's multiply of the activated gate by the up GEMM."""
    gen = torch.Generator().manual_seed(1)
    wg, wu = (torch.randn(64, 32, generator=gen) for _ in range(2))
    proj = cpu_gated.PackedGatedProj(PackedWeight(wg), PackedWeight(wu), None, None, act)
    x = torch.randn(5, 32, generator=gen)
    gate = torch.ops.mkldnn._linear_pointwise(x, proj.gate.packed, None, proj.attr, [],
                                              proj.algorithm)  # fmt: skip
    assert torch.equal(proj(x), gate * proj.up.linear(x))


def test_refuses_mismatched_halves_and_unknown_activations():
    w = PackedWeight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="differ"):
        cpu_gated.PackedGatedProj(w, PackedWeight(torch.randn(9, 4)), None, None, "silu")
    with pytest.raises(ValueError, match="no oneDNN post-op"):
        cpu_gated.PackedGatedProj(w, w, None, None, "relu2")


# cpu_pack's choice among the gated paths: test_cpu_act_mul.py (native, post-ops, merged GEMM)
