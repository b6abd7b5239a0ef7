"""Fused Triton ops (RMSNorm with residual add, rotary, gated activation) against the eager
blocks, on CPU under the interpreter, merged q/k/v and gate/up projections, and whole tiny models
with the ops switched on and off.

Every test name contains `triton` (`pytest -k triton`). The kernels run with the tile sizes the
GPU uses. Set SWASERVE_TEST_TRITON_CUDA=1 to run the kernel tests compiled on a CUDA device.

The kernels round where the eager code rounds, so float32 results agree to reduction order and
bfloat16 results to one rounding step at most.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from torch import nn  # noqa: E402

from swaserve.models.blocks import (  # noqa: E402
    ACTIVATIONS,
    Attention,
    AttentionSpec,
    GatedMLP,
    RMSNorm,
    Rotary,
    add_rmsnorm,
)
from swaserve.ops.activation import act_and_mul  # noqa: E402
from swaserve.ops.merge import merge_projections  # noqa: E402
from swaserve.ops.rmsnorm import fused_add_rmsnorm, rmsnorm  # noqa: E402
from swaserve.ops.rotary import apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if _CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2e-2)}


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Close at the dtype's tolerance; in bfloat16 also equal almost everywhere (the kernels round
    where the eager code rounds: only a last-bit difference of float32 math flips a rounding, and
    tails like gelu(-5) may be 0 on one side and -1e-7 on the other)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[got.dtype])
    if got.dtype == torch.bfloat16:
        same = (got.float() - want.float()).abs() <= 1e-6
        assert same.float().mean().item() > 0.99


def _norm(n: int, unit_offset: bool, dtype: torch.dtype, seed: int = 1) -> RMSNorm:
    norm = RMSNorm(n, 1e-6, unit_offset)
    with torch.no_grad():
        w = _randn(n, dtype=torch.float32, seed=seed) * 0.5
        norm.weight.copy_(w if unit_offset else w + 1)
    return norm.to(DEVICE, dtype)


# ---- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (37, 640), (37, 4, 128), (1, 3, 256)])
def test_triton_rmsnorm(shape, unit_offset, dtype):
    norm = _norm(shape[-1], unit_offset, dtype)
    x = _randn(*shape, dtype=dtype) * 3
    got, want = rmsnorm(x, norm), norm(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("sandwich", [False, True])
@pytest.mark.parametrize("t,n", [(1, 96), (37, 640)])
def test_triton_fused_add_rmsnorm(t, n, sandwich, unit_offset, dtype):
    norm = _norm(n, unit_offset, dtype)
    x_norm = _norm(n, unit_offset, dtype, seed=2) if sandwich else None
    x, residual = _randn(t, n, dtype=dtype, seed=3), _randn(t, n, dtype=dtype, seed=4) * 4
    x_before, residual_before = x.clone(), residual.clone()
    got_y, got_s = fused_add_rmsnorm(x, residual, norm, x_norm)
    want_y, want_s = add_rmsnorm(x, residual, norm, x_norm)  # eager: nothing is fused yet
    assert got_s.dtype == dtype and got_y.dtype == dtype
    if sandwich:
        _close(got_s, want_s)
    else:  # the same single rounding of the same sum
        assert torch.equal(got_s, want_s)
    _close(got_y, want_y)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37])
def test_triton_rmsnorm_strided(t, dtype):
    """Per-head norms of q and k read in place from one packed qkv row: the same result as on a
    contiguous copy, and the input is left as it was."""
    hq, hk, d = 4, 2, 24
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=11) * 3
    qkv_before = qkv.clone()
    norm = _norm(d, False, dtype)
    for x in (qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)):
        assert t == 1 or not x.is_contiguous()
        got = rmsnorm(x, norm)
        assert got.is_contiguous() and torch.equal(got, rmsnorm(x.contiguous(), norm))
        _close(got, norm(x))
    assert torch.equal(qkv, qkv_before)


def test_triton_add_rmsnorm_dispatch():
    """`add_rmsnorm` takes the kernel once the norm is fused, and agrees with the eager path."""
    norm, x_norm = _norm(96, True, torch.float32), _norm(96, True, torch.float32, seed=2)
    x, residual = _randn(5, 96, dtype=torch.float32), _randn(5, 96, dtype=torch.float32, seed=3)
    want = add_rmsnorm(x, residual, norm, x_norm)
    norm.fused = x_norm.fused = True
    got = add_rmsnorm(x, residual, norm, x_norm)
    for g, w in zip(got, want, strict=True):
        _close(g, w)


# ---- rotary ----------------------------------------------------------------------------------


def _inv_freq(rot: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37])
@pytest.mark.parametrize(
    "hq,hk,d,rot",
    [(4, 2, 16, 16), (8, 1, 128, 128), (3, 1, 80, 40), (4, 4, 64, 32), (4, 1, 256, 256)],
)
def test_triton_rotary(hq, hk, d, rot, t, dtype):
    q, k = _randn(t, hq, d, dtype=dtype, seed=5), _randn(t, hk, d, dtype=dtype, seed=6)
    gen = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 40000, (t,), generator=gen, dtype=torch.int64).to(DEVICE)
    rotary = Rotary(_inv_freq(rot)).to(DEVICE)
    want_q, want_k = rotary(positions, q, k)
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = apply_rotary(positions, q, k, rotary.inv_freq, inplace=False)
    assert torch.equal(q, q_in) and torch.equal(k, k_in)
    _close(got_q, want_q)
    _close(got_k, want_k)
    got_q, got_k = apply_rotary(positions, q, k, rotary.inv_freq)  # in place
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(q[..., rot:], q_in[..., rot:])  # the pass-through dims stay bit for bit


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rotary_yarn_scale(dtype):
    """YaRN's attention scaling multiplies cos and sin (gpt-oss: 0.1 ln 32 + 1): the kernel
    scales them in float32 before rounding, as the eager Rotary does."""
    t, hq, hk, d = 9, 4, 2, 64
    q, k = _randn(t, hq, d, dtype=dtype, seed=15), _randn(t, hk, d, dtype=dtype, seed=16)
    positions = torch.arange(3, 3 + 7 * t, 7, device=DEVICE)
    rotary = Rotary(_inv_freq(d), attention_scaling=1.3466).to(DEVICE)
    want_q, want_k = rotary(positions, q, k)
    got_q, got_k = apply_rotary(positions, q, k, rotary.inv_freq, inplace=False, scale=1.3466)
    _close(got_q, want_q)
    _close(got_k, want_k)
    plain_q, _ = Rotary(_inv_freq(d)).to(DEVICE)(positions, q, k)
    assert not torch.allclose(plain_q, want_q)  # the scale shows


def test_triton_rotary_strided():
    """q and k as views of one packed qkv row (head stride D, token stride (Hq + 2 Hkv) D)."""
    t, hq, hk, d = 6, 4, 2, 32
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=torch.float32, seed=8)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    positions = torch.arange(100, 100 + t, device=DEVICE)
    rotary = Rotary(_inv_freq(d)).to(DEVICE)
    want_q, want_k = rotary(positions, q, k)
    apply_rotary(positions, q, k, rotary.inv_freq)
    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


# ---- gated activation ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid tails, exact: 1/inf
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("t,n", [(1, 96), (37, 640)])
def test_triton_act_and_mul(t, n, act, dtype):
    gate, up = _randn(t, n, dtype=dtype, seed=9) * 3, _randn(t, n, dtype=dtype, seed=10)
    want = ACTIVATIONS[act](gate) * up
    got = act_and_mul(gate, up, act)
    assert got.dtype == dtype
    _close(got, want)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n", [(1, 96), (37, 640)])
def test_triton_act_and_mul_strided(t, n, dtype):
    """gate and up as the two halves of one merged `[T, 2n]` GEMM output (row stride 2n)."""
    gate_up = _randn(t, 2 * n, dtype=dtype, seed=12) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    got = act_and_mul(gate, up, "silu")
    assert got.is_contiguous() and torch.equal(got, act_and_mul(gate.contiguous(), up, "silu"))
    _close(got, ACTIVATIONS["silu"](gate) * up)


# ---- merged projections ----------------------------------------------------------------------

MERGED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _storage_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters and the merged projection tensors."""
    tensors = list(model.parameters()) + [
        t
        for m in model.modules()
        for a in ("qkv_weight", "qkv_bias", "gate_up_weight", "gate_up_bias")
        if (t := getattr(m, a, None)) is not None
    ]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _merged_params(model: nn.Module) -> list[weakref.ref]:
    return [
        weakref.ref(p) for name, p in model.named_parameters() if name.rsplit(".", 2)[-2] in MERGED
    ]


def _check_merge_keeps_state(model: nn.Module, merge: Callable[[nn.Module], bool]) -> None:
    """`merge(model)` succeeds, keeps the state dict (keys, order, values), adds no storage and
    frees the per-projection parameters it replaced."""
    want = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes, old = _storage_bytes(model), _merged_params(model)
    assert old
    assert merge(model)
    gc.collect()
    assert all(ref() is None for ref in old)
    got = model.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert _storage_bytes(model) <= nbytes


@pytest.mark.parametrize("bias", [False, True])
def test_triton_merge_projections(bias):
    """q/k/v and gate/up become row views of one tensor each; writes to the per-projection
    parameters reach it; merging is idempotent and redone after a cast breaks the aliasing."""
    spec = AttentionSpec(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=24, scale=0.2)
    attn = Attention(spec, 96, Rotary(_inv_freq(24)), bias=bias, qk_norm_eps=1e-6)
    mlp = GatedMLP(96, 160, "silu", bias=bias)
    model = nn.ModuleList([attn, mlp]).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    _check_merge_keeps_state(model, lambda m: merge_projections(m) == 2)
    assert merge_projections(model) == 0
    assert attn.qkv_weight.shape == (192, 96) and mlp.gate_up_weight.shape == (320, 96)
    assert (attn.qkv_bias is not None) == bias and (mlp.gate_up_bias is not None) == bias
    assert not any(t is attn.qkv_weight for t in model.state_dict().values())
    assert not attn.k_proj.weight.requires_grad
    with torch.no_grad():
        attn.k_proj.weight.fill_(3.0)
        mlp.up_proj.weight.copy_(torch.ones(160, 96))
    assert torch.equal(attn.qkv_weight[96:144], torch.full((48, 96), 3.0))
    assert torch.equal(mlp.gate_up_weight[160:], torch.ones(160, 96))
    model.double()
    _check_merge_keeps_state(model, lambda m: merge_projections(m) == 2)
    assert attn.qkv_weight.dtype == torch.float64


# ---- whole models ----------------------------------------------------------------------------

TINY = dict(
    vocab_size=128, hidden_size=96, intermediate_size=160, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, max_position_embeddings=256, rms_norm_eps=1e-6,
    num_hidden_layers=3,
)  # fmt: skip


def _tiny_configs() -> dict:
    import transformers as t

    return {
        # (config, modules enable_fused_ops switches: per layer + the final norm)
        "llama": (t.LlamaConfig(**TINY, tie_word_embeddings=False), 3 * 5 + 1),
        "llama_bias": (
            t.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
            3 * 5 + 1,
        ),
        "qwen3": (t.Qwen3Config(**TINY, tie_word_embeddings=False), 3 * 7 + 1),
        "gemma3": (
            t.Gemma3TextConfig(
                **TINY, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                sliding_window=5, query_pre_attn_scalar=24, rope_local_base_freq=10000.0,
                partial_rotary_factor=0.5,
            ),
            3 * 9 + 1,
        ),
        # the newer architectures' fused-path specifics: Phi-3's partial rotary (v5's
        # rope_parameters), Gemma 2's soft-capped attention without q/k norms, SmolLM3's NoPE
        # layer (zero-frequency rotary)
        "phi3": (
            t.Phi3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}),
            3 * 5 + 1,
        ),
        "gemma2": (
            t.Gemma2Config(**TINY, sliding_window=5, query_pre_attn_scalar=24,
                           attn_logit_softcapping=4.0, final_logit_softcapping=3.0),
            3 * 7 + 1,
        ),
        "smollm3": (
            t.SmolLM3Config(**TINY, no_rope_layers=[1, 0, 1], tie_word_embeddings=True,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2),
            3 * 5 + 1,
        ),
    }  # fmt: skip


@pytest.mark.skipif(_CUDA, reason="CPU engine test")
@pytest.mark.parametrize(
    "name,backend",
    [(name, "torch") for name in ("llama", "llama_bias", "qwen3", "gemma3")]
    # the Triton backend takes the q/k norms and rotary into its K/V store (rope_store.py)
    + [("llama", "triton"), ("qwen3", "triton"), ("gemma3", "triton"), ("phi3", "triton"),
       ("gemma2", "triton"), ("smollm3", "triton")],
)
def test_triton_fused_ops_model(tmp_path, name, backend):
    """Per-position logits and greedy tokens of a tiny random model are the same with the fused
    ops and merged projections on as with the eager blocks (float32: equal up to reduction
    order); enabling keeps the state dict and adds no weight memory; disabling gives back the
    eager results exactly."""
    from swaserve import Engine, SamplingParams
    from swaserve.ops import enable_fused_ops
    from tests.helpers import engine_prompt_logits, save_random_hf_model

    cfg, switched = _tiny_configs()[name]
    save_random_hf_model(cfg, tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4,
        max_num_batched_tokens=16, kv_cache_gb=0.01, attention_backend=backend,
        disable_fused_ops=True,  # eager blocks, not CPU-packed ones: the test fuses them itself
    )  # fmt: skip
    model = engine.core.model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (23,), generator=gen).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0)

    def run() -> tuple[torch.Tensor, list[int]]:
        logits = engine_prompt_logits(engine, ids)
        out = engine.generate(prompt_token_ids=[ids[:9]], sampling_params=greedy)
        return logits, out[0].outputs[0].token_ids

    want_logits, want_tokens = run()
    _check_merge_keeps_state(model, lambda m: enable_fused_ops(m) == switched)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    assert (attn.prologue(engine.core.runner.backend) is not None) == (backend == "triton")
    got_logits, got_tokens = run()
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    assert got_tokens == want_tokens
    assert enable_fused_ops(model, enabled=False) == switched
    eager_logits, eager_tokens = run()
    assert torch.equal(eager_logits, want_logits) and eager_tokens == want_tokens


@pytest.mark.skipif(_CUDA, reason="CPU engine test")
def test_triton_gemv_path_past_two_rows(tmp_path, monkeypatch):
    """SWASERVE_GEMV_ROWS above gemv.MAX_ROWS (an experiment, off by default): batched decode
    steps of up to 5 rows and n-gram verify steps of K + 1 = 4 rows per request run the decode
    GEMV's tiles past two rows (`gemv.row_config`: tensor-core tiles, the elementwise one for
    down), and give the eager blocks' greedy tokens and logprobs (float32)."""
    from swaserve import Engine, SamplingParams
    from swaserve.ops import enable_fused_ops
    from swaserve.ops.gemv import ROW_TILES, row_config
    from tests.helpers import save_random_hf_model

    monkeypatch.setenv("SWASERVE_GEMV_ROWS", "8")
    cfg, _ = _tiny_configs()["llama"]
    save_random_hf_model(cfg, tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4, kv_cache_gb=0.01,
        attention_backend="triton", disable_fused_ops=True, speculative_algorithm="ngram",
        speculative_num_draft_tokens=3, speculative_ngram_min=1, speculative_ngram_max=2,
        disable_adaptive_speculation=True,
    )  # fmt: skip
    model = engine.core.model
    gen = torch.Generator().manual_seed(2)
    # repetitive prompts: the n-gram drafter finds drafts in them
    prompts = [(torch.randint(0, 128, (4,), generator=gen).tolist() * 4)[: 9 + i] for i in range(5)]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)

    def run() -> list[list[tuple[int, float]]]:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=greedy)
        engine.core.memory.check_integrity()
        # the verify steps ran (K + 1 = 4 rows a request) and accepted drafts
        assert sum(o.spec_decoding["spec_verify_ct"] for o in outs) > 0
        assert sum(o.spec_decoding["spec_accepted_drafts"] for o in outs) > 0
        return [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outs]

    want = run()
    enable_fused_ops(model)
    assert model.model.gemv_rows == 8 and model.model.takes_gemv(5)
    assert row_config(2, "o") is None and row_config(5, "o") is ROW_TILES["o"]
    assert row_config(5, "qkv").use_dot and not row_config(5, "down").use_dot
    import swaserve.ops.gemv as gemv_module

    rows_seen: list[int] = []
    rope_stores: list[bool] = []
    plain = gemv_module.gemv

    def counting(x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        rows_seen.append(x.shape[0])
        rope_stores.append(kwargs.get("rope_store") is not None)
        return plain(x, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", counting)
    got = run()
    assert max(rows_seen) > 2  # steps past MAX_ROWS went through the GEMV
    # the q/k/v GEMVs of one- and two-row steps rotated q/k and stored K/V themselves
    # (gemv.RopeStore: head_dim 24 splits into rotary half-tiles of 4, not of the q/k/v row
    # tile's 8)
    assert any(rope_stores)
    for a, b in zip(got, want, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4


@pytest.mark.slow  # ~60 s of interpreted fp8 attention; the fast suite is near its 15 min
@pytest.mark.skipif(_CUDA, reason="CPU engine test")
def test_triton_gemv_rope_store_engine_fp8_kv(tmp_path, monkeypatch):
    """Two-row decode steps with an fp8 KV cache: the q/k/v GEMV that rotates and stores K/V
    itself (gemv.RopeStore) gives exactly the tokens and logprobs of the GEMV followed by
    `qk_rope_store` (SWASERVE_GEMV_ROPE=0), and it did run. (One row and the cache bytes:
    test_triton_gemv_rope_store_matches_prologue_kernel.)"""
    from swaserve import Engine, SamplingParams
    from swaserve.ops import enable_fused_ops
    from tests.helpers import save_random_hf_model

    cfg, _ = _tiny_configs()["llama"]
    save_random_hf_model(cfg, tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4, kv_cache_gb=0.01,
        attention_backend="triton", kv_cache_dtype="fp8_e4m3", disable_fused_ops=True,
        disable_prefix_cache=True,  # a prefix hit would prefill through another path (fp8)
    )  # fmt: skip
    enable_fused_ops(engine.core.model)
    assert engine.core.model.model.takes_gemv(2)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (7 + i,), generator=gen).tolist() for i in range(2)]
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0)
    import swaserve.ops.gemv as gemv_module

    stores: list[bool] = []
    plain = gemv_module.gemv

    def spy(x, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        stores.append(kwargs.get("rope_store") is not None)
        return plain(x, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", spy)

    def run() -> list[list[tuple[int, float]]]:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=greedy)  # 2-row steps
        engine.core.memory.check_integrity()
        return [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outs]

    fused = run()
    assert any(stores)
    stores.clear()
    monkeypatch.setenv("SWASERVE_GEMV_ROPE", "0")
    separate = run()
    assert stores and not any(stores)
    assert fused == separate
