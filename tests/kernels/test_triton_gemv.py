"""The decode GEMV (swaserve/ops/gemv.py) against a float64 torch reference on random inputs:
two tiles, with and without the RMSNorm in front (Llama weights and Gemma's 1 + w) or the gated
activation (from a merged gate|up row), bias and residual behind, K not a multiple of the tile,
N not a multiple of the block, 1 to MAX_ROWS rows, a row-strided x; bad shapes raise.

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
from swaserve.ops.gemv import (  # noqa: E402
    MAX_DOT_ROWS,
    MAX_ROWS,
    SMALL_HIDDEN,
    SMALL_MODEL_ROWS,
    GemvConfig,
    default_config,
    gemv,
)

DEVICE = torch.device("cuda" if _CUDA else "cpu")
SMALL = {
    "narrow": GemvConfig(4, 32, 4, 2),
    "wide": GemvConfig(16, 64, 4, 1),
    "dot": GemvConfig(16, 32, 4, 2, use_dot=True),
}


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _reference(x, w, bias, norm, residual) -> torch.Tensor:
    xf = x.double()
    if norm is not None:
        g = norm.weight.double() + (1.0 if norm.unit_offset else 0.0)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * g
    y = xf @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if residual is not None:
        y = y + residual.double()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", sorted(SMALL))
@pytest.mark.parametrize(
    "m, n, k, norm, bias, residual",
    [
        (1, 48, 64, None, False, False),
        (1, 40, 96, "llama", False, True),  # N not a multiple of the block
        (2, 64, 80, "gemma", True, False),  # K not a multiple of the tile
        (2, 33, 200, "llama", True, True),
        (2, 16, 32, None, False, True),
    ],
)
def test_triton_gemv_matches_reference(dtype, tile, m, n, k, norm, bias, residual):
    x = _randn(m, k, dtype=dtype, seed=1) * 3  # a residual stream is not unit scale
    w = _randn(n, k, dtype=dtype, seed=2) * k**-0.5
    b = _randn(n, dtype=dtype, seed=3) if bias else None
    r = _randn(m, n, dtype=dtype, seed=4) if residual else None
    nm = None
    if norm is not None:
        nm = RMSNorm(k, 1e-6, unit_offset=norm == "gemma")
        with torch.no_grad():
            nm.weight.copy_(_randn(k, dtype=torch.float32, seed=5) * 0.5 + (norm == "llama"))
        nm = nm.to(DEVICE, dtype)
    got = gemv(x, w, b, norm=nm, residual=r, config=SMALL[tile])
    want = _reference(x, w, b, nm, r)
    assert got.shape == (m, n) and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    else:  # float32 products and sums: one rounding of the output (and of x with `dot`)
        err = (got.double() - want).abs() / want.abs().clamp_min(1.0)
        assert err.max().item() < (2e-2 if tile == "dot" else 8e-3)
        assert err.mean().item() < (4e-3 if tile == "dot" else 2e-3)


@pytest.mark.parametrize(
    "m, n, k, norm",
    [(MAX_ROWS, 96, 512, False), (1, 96, 512, True), (1, 16384, 64, True)]
    + ([(1, 65536, 256, False), (2, 28672, 512, True)] if _CUDA else []),
)
def test_triton_gemv_default_tiles_and_strided_rows(m, n, k, norm):
    """The engine's default tiles (each branch of `default_config`) on x rows taken from a wider
    tensor."""
    wide = _randn(m, 2 * k, dtype=torch.float32, seed=6)
    x = wide[:, :k]  # row stride 2k, unit column stride: read in place
    w = _randn(n, k, dtype=torch.float32, seed=7)
    nm = RMSNorm(k, 1e-6).to(DEVICE) if norm else None
    assert default_config(m, n, k, norm).block_k <= k
    torch.testing.assert_close(gemv(x, w, norm=nm).double(), _reference(x, w, None, nm, None),
                               atol=1e-4, rtol=1e-5)  # fmt: skip
    assert gemv(x[:0], w).shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("m, n, k", [(1, 40, 64), (2, 24, 72)])
def test_triton_gemv_gated_activation_in_front(dtype, act, m, n, k):
    """x = act(gate) * up from a merged gate|up row, as act_and_mul computes it (its rounding
    included), then the product and the residual add."""
    gu = _randn(m, 2 * k, dtype=dtype, seed=10)
    w = _randn(n, k, dtype=dtype, seed=11) * k**-0.5
    r = _randn(m, n, dtype=dtype, seed=12)
    got = gemv(gu, w, residual=r, act=act, config=SMALL["narrow"])
    a = act_and_mul(gu[:, :k], gu[:, k:], act)
    want = _reference(a, w, None, None, r)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    else:
        err = (got.double() - want).abs() / want.abs().clamp_min(1.0)
        assert err.max().item() < 8e-3


@pytest.mark.parametrize("tile", ["dot", "narrow"])
@pytest.mark.parametrize("m", [3, 8, 16])
def test_triton_gemv_more_rows(m, tile):
    """An explicit tile on 3 to MAX_DOT_ROWS rows, with a norm and a residual: the
    tensor-core variant (`use_dot`) and the elementwise one, what gemv_bench.py sweeps against
    cuBLAS past MAX_ROWS (the default tile stops at MAX_ROWS)."""
    k, n = 96, 40
    x = _randn(m, k, dtype=torch.float32, seed=13)
    w = _randn(n, k, dtype=torch.float32, seed=14)
    r = _randn(m, n, dtype=torch.float32, seed=15)
    nm = RMSNorm(k, 1e-6).to(DEVICE)
    got = gemv(x, w, norm=nm, residual=r, config=SMALL[tile])
    torch.testing.assert_close(got.double(), _reference(x, w, None, nm, r), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(x, w)


def test_triton_gemv_refuses_bad_shapes():
    w = _randn(16, 32, dtype=torch.float32, seed=8)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(_randn(MAX_ROWS + 1, 32, dtype=torch.float32, seed=9), w)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(_randn(MAX_DOT_ROWS + 1, 32, dtype=torch.float32, seed=9), w, config=SMALL["dot"])
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(_randn(1, 31, dtype=torch.float32, seed=9), w)
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(_randn(1, 32, dtype=torch.float32, seed=9), w.T.contiguous().T)
    with pytest.raises(ValueError, match="gemv takes"):  # act: x is gate|up, [m, 2 K]
        gemv(_randn(1, 32, dtype=torch.float32, seed=9), w, act="silu")


def test_gemv_rows_by_model_size(monkeypatch):
    """Small models take steps of up to SMALL_MODEL_ROWS through the GEMV, larger ones up to
    MAX_ROWS (cuBLAS wins past two rows on Llama-8B's shapes); SWASERVE_GEMV_ROWS overrides
    both, capped at MAX_DOT_ROWS."""
    from swaserve.ops import gemv_rows

    monkeypatch.delenv("SWASERVE_GEMV_ROWS", raising=False)
    assert gemv_rows(576) == gemv_rows(SMALL_HIDDEN) == SMALL_MODEL_ROWS
    assert gemv_rows(SMALL_HIDDEN + 1) == gemv_rows(4096) == MAX_ROWS
    for env, want in (("0", 0), ("2", 2), ("99", MAX_DOT_ROWS)):
        monkeypatch.setenv("SWASERVE_GEMV_ROWS", env)
        assert gemv_rows(576) == gemv_rows(4096) == want


def test_triton_gemv_path_only_for_dense_llama_layers():
    """`enable_fused_ops` turns the decode GEMV path on for Llama-family models whose every
    layer has a dense MLP; gpt-oss and Qwen3-MoE (Llama layers with the MLP swapped for MoE,
    Qwen3-MoE with one dense layer among them) keep the other path, and so do models with the
    fused ops off."""
    import transformers as t

    from swaserve.models.registry import model_class
    from swaserve.ops import enable_fused_ops

    common = dict(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=64, num_hidden_layers=2, intermediate_size=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    configs = {
        "llama": (t.LlamaConfig(**common), True),
        "qwen3_moe": (t.Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=4,
                                       num_experts_per_tok=2, mlp_only_layers=[1]), False),
        "gpt_oss": (t.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                   sliding_window=8), False),
    }  # fmt: skip
    for name, (cfg, dense) in configs.items():
        model = model_class(cfg)(cfg)
        assert not model.model.takes_gemv(1), name  # fused ops off: never
        enable_fused_ops(model)
        assert model.model.takes_gemv(1) == dense, name
        # a small model (hidden 32) takes steps of up to SMALL_MODEL_ROWS (ops.gemv_rows)
        assert model.model.takes_gemv(SMALL_MODEL_ROWS) == dense, name
        assert not model.model.takes_gemv(SMALL_MODEL_ROWS + 1), name
        assert not model.model.takes_gemv(0), name  # an idle rank's empty step
        enable_fused_ops(model, enabled=False)
        assert not model.model.takes_gemv(1), name


@pytest.mark.parametrize(
    "dtype, kv, m, tile, scaling",
    [
        (torch.bfloat16, "model", 1, None, 1.0),
        (torch.bfloat16, "fp8", 2, None, 1.0),
        (torch.float32, "model", 2, "narrow", 1.2),  # YaRN-style attention scaling
        (torch.bfloat16, "model", 5, "dot", 1.0),  # a verify step through the dot tile
    ],
)
def test_triton_gemv_rope_store_matches_prologue_kernel(dtype, kv, m, tile, scaling):
    """The q/k/v GEMV finishing the prologue (`RopeStore`): its output (q, k rotated; v as is)
    and the cache slots it writes are bit-identical to the plain GEMV followed by
    `qk_rope_store` (the launch it replaces), for bf16 and fp8 caches, 1 to 5 rows, a padded
    row (slot -1) that stores nothing, and no other cache slot touched."""
    from swaserve.attention.kernels.rope_store import QKPrologue, qk_rope_store
    from swaserve.models.blocks import Rotary
    from swaserve.ops.gemv import RopeStore

    hq, hk, d, k, ps = 4, 2, 16, 48, 4
    n = (hq + 2 * hk) * d
    cfg = SMALL[tile] if tile else default_config(m, n, k, norm=True)
    x = _randn(m, k, dtype=dtype, seed=21)
    w = _randn(n, k, dtype=dtype, seed=22) * 0.3
    nm = RMSNorm(k, 1e-6).to(DEVICE)
    nm.weight.data = (1 + _randn(k, dtype=torch.float32, seed=23) * 0.1).to(dtype)
    rotary = Rotary(1.0 / 1000 ** (torch.arange(0, d, 2).float() / d), scaling)
    rotary.restore_buffers(DEVICE)
    positions = torch.tensor([7, 300, 5, 6, 9][:m], device=DEVICE)
    slots = torch.tensor([3, -1, 10, 11, 17][:m], device=DEVICE)  # row 1: padding
    cache_dtype = torch.float8_e4m3fn if kv == "fp8" else dtype
    scales = (0.05, 0.07) if kv == "fp8" else (1.0, 1.0)

    def caches():
        k_c = torch.full((6, ps, hk, d), 0.5, device=DEVICE).to(cache_dtype)
        return k_c, torch.full((6, ps, hk, d), -0.25, device=DEVICE).to(cache_dtype)

    kc1, vc1 = caches()
    y1 = gemv(x, w, norm=nm, config=cfg)
    q, kk, v = y1.split([hq * d, hk * d, hk * d], dim=-1)
    qk_rope_store(positions, q.view(m, hq, d), kk.view(m, hk, d), v.view(m, hk, d),
                  QKPrologue(rotary), kc1, vc1, slots, *scales)  # fmt: skip
    kc2, vc2 = caches()
    store = RopeStore(positions, rotary.inv_freq, scaling, slots, kc2, vc2, *scales, hq * d,
                      hk * d, d)  # fmt: skip
    y2 = gemv(x, w, norm=nm, config=cfg, rope_store=store)
    assert torch.equal(y2, y1)
    assert torch.equal(kc2.view(torch.uint8), kc1.view(torch.uint8))
    assert torch.equal(vc2.view(torch.uint8), vc1.view(torch.uint8))
    fresh_k, _ = caches()
    assert not torch.equal(kc2.view(torch.uint8), fresh_k.view(torch.uint8))  # it stored
