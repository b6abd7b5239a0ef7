"""The CPU float32 norms and q/k prologue (swaserve/ops/cpu_prologue.py) give the eager
reference's values: bit for bit in torch ops (no native library), within a few ulps through
native/norms.c (its sums of squares add in another order; its rotary alone is bit-equal):
RMSNorm (Gemma's 1 + w and Llama's w), the residual add and sandwich norm, q/k norms with rotary
(with and without YaRN's scaling), rotary alone; the cos/sin tables are built once a step per
rotary kind; partial rotary keeps the eager path."""

from __future__ import annotations

import pytest
import torch

from swaserve.attention.torch_backend import TorchBackend  # noqa: F401  (import order)
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.models.blocks import Attention, AttentionSpec, RMSNorm, Rotary, add_rmsnorm
from swaserve.ops import cpu_native, cpu_prologue

# torch ops, or native/norms.c where a C compiler is
PATHS = ["torch", pytest.param("native", marks=pytest.mark.skipif(
    not cpu_native.available(), reason="no C compiler here"))]  # fmt: skip


@pytest.fixture
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    return request.param


def _same(got: torch.Tensor, want: torch.Tensor, path: str) -> None:
    if path == "torch":
        assert torch.equal(got, want)
    else:  # a few float32 ulps: the sum of squares in another order
        torch.testing.assert_close(got, want, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("shape", [(3, 64), (16, 4, 32), (1, 640), (70, 640)])
def test_rms_norm_equals_eager(path, unit_offset, shape):
    norm = RMSNorm(shape[-1], 1e-6, unit_offset)
    norm.weight.data = torch.randn(shape[-1]) * 0.3
    x = torch.randn(*shape) * 5
    ref = norm(x)
    norm.cpu_scale = cpu_prologue.norm_scale(norm)
    _same(norm(x), ref, path)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("sandwich", [True, False])  # Gemma's norm of x first, Llama's none
@pytest.mark.parametrize("rows", [16, 70])  # a decode step; more rows than one thread takes
def test_add_rmsnorm_equals_eager(path, sandwich, rows):
    norm, x_norm = RMSNorm(640, 1e-6, True), RMSNorm(640, 1e-5, True)
    norm.weight.data, x_norm.weight.data = torch.randn(640) * 0.3, torch.randn(640) * 0.3
    x, residual = torch.randn(rows, 640) * 4, torch.randn(rows, 640) * 30
    want = add_rmsnorm(x, residual, norm, x_norm if sandwich else None)
    for m in (norm, x_norm):
        m.cpu_scale = cpu_prologue.norm_scale(m)
    got = add_rmsnorm(x, residual, norm, x_norm if sandwich else None)
    for g, w in zip(got, want):
        _same(g, w, path)


def _attention(qk_norm: bool, scaling: float = 1.0, rot_dims: int = 32) -> Attention:
    spec = AttentionSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=32, scale=0.1)
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dims, 2).float() / rot_dims))
    attn = Attention(spec, 48, Rotary(inv, scaling), qk_norm_eps=1e-6 if qk_norm else None,
                     qk_norm_unit_offset=True)  # fmt: skip
    if qk_norm:
        attn.q_norm.weight.data = torch.randn(32) * 0.3
        attn.k_norm.weight.data = torch.randn(32) * 0.3
    attn.qkv_proj = torch.nn.Identity()  # what enable() looks for: a merged projection
    return attn


def _fb(positions: torch.Tensor) -> ForwardBatch:
    return ForwardBatch(input_ids=positions, positions=positions, backend=None, metadata=None,
                        kv=None)  # fmt: skip


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("qk_norm,scaling", [(True, 1.0), (False, 1.0), (True, 1.37)])
def test_qk_prologue_equals_eager(path, qk_norm, scaling):
    attn = _attention(qk_norm, scaling)
    t = 7
    qkv = torch.randn(t, (4 + 2 * 2) * 32) * 3
    positions = torch.tensor([0, 1, 5, 100, 2047, 9, 3])
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    q, k = q.reshape(t, 4, 32), k.reshape(t, 2, 32)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    ref_q, ref_k = attn.rotary(positions, q, k)
    cpu_prologue.enable(attn)
    assert attn.cpu_prologue
    fb = _fb(positions)
    got_q, got_k = cpu_prologue.qk_prologue(attn, qkv, fb)
    # rotary alone is bit-equal on both paths (no fused multiply-adds in the kernel)
    _same(got_q, ref_q, path if qk_norm else "torch")
    _same(got_k, ref_k, path if qk_norm else "torch")
    # a second layer of the same rotary kind reuses the step's tables
    other = _attention(qk_norm, scaling)
    cpu_prologue.enable(other)
    tables = fb.rope_tables[attn.rotary.table_key]
    assert cpu_prologue.rope_tables(other.rotary, fb) is tables and len(fb.rope_tables) == 1


def test_partial_rotary_stays_eager():
    attn = _attention(True, rot_dims=16)
    cpu_prologue.enable(attn)
    assert not attn.cpu_prologue
    assert attn.q_norm.cpu_scale is not None  # its norms still take one rms_norm
