"""The CPU float32 norms and q/k prologue (swaserve/ops/cpu_prologue.py) give the eager
reference's values bit for bit: RMSNorm (Gemma's 1 + w and Llama's w), q/k norms with rotary
(with and without YaRN's scaling), rotary alone; the cos/sin tables are built once a step per
rotary kind; partial rotary keeps the eager path."""

from __future__ import annotations

import pytest
import torch

from swaserve.attention.torch_backend import TorchBackend  # noqa: F401  (import order)
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.models.blocks import Attention, AttentionSpec, RMSNorm, Rotary
from swaserve.ops import cpu_prologue


@pytest.mark.parametrize("unit_offset", [True, False])
@pytest.mark.parametrize("shape", [(3, 64), (16, 4, 32), (1, 640)])
def test_rms_norm_bit_equal(unit_offset, shape):
    norm = RMSNorm(shape[-1], 1e-6, unit_offset)
    norm.weight.data = torch.randn(shape[-1]) * 0.3
    x = torch.randn(*shape) * 5
    ref = norm(x)
    norm.cpu_scale = cpu_prologue.norm_scale(norm)
    assert torch.equal(norm(x), ref)


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


@pytest.mark.parametrize("qk_norm,scaling", [(True, 1.0), (False, 1.0), (True, 1.37)])
def test_qk_prologue_bit_equal(qk_norm, scaling):
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
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
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
