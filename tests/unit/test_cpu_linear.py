"""CPU float32 weights packed for oneDNN (swaserve/ops/cpu_linear.py, cpu_pack.py): the packed
GEMM equals F.linear, row lookups equal the dense table exactly, other dtypes are left alone,
and packing a model leaves no dense copy of a packed weight behind."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from swaserve.models.blocks import Attention, GatedMLP, head_logits
from swaserve.models.registry import model_class
from swaserve.ops import cpu_linear
from swaserve.ops.cpu_linear import PackedEmbedding, PackedLinear, PackedWeight, dense_weight
from swaserve.ops.cpu_pack import pack_cpu_weights

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN in this torch")

SHAPES = [(1, 1), (7, 5), (100, 33), (130, 1000), (64, 64), (1536, 640), (4099, 17)]


def _decodes(n: int, k: int) -> bool:
    """This torch's oneDNN packs [n, k] in the row-interleaved layout cpu_linear decodes (true
    of oneDNN 3.12, torch 2.13; oneDNN 3.10, torch 2.11, packs differently: tied tables then
    stay dense and row lookups are refused, which the tests below check instead)."""
    return PackedWeight(torch.randn(n, k)).gatherable


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(n, k, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    pw = PackedWeight(w)
    assert pw.shape == (n, k) and pw.nbytes >= n * k * 4
    for m in (0, 1, 3, 16, 70):
        x = torch.randn(m, k, generator=gen)
        torch.testing.assert_close(pw.linear(x, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, k, generator=gen)  # leading dims, and a non-contiguous input
    torch.testing.assert_close(pw.linear(x3, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)
    xt = torch.randn(k, 5, generator=gen).t()
    torch.testing.assert_close(pw.linear(xt, b), F.linear(xt, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", SHAPES)
def test_packed_rows_and_dense_are_exact(n, k):
    w = torch.randn(n, k)
    pw = PackedWeight(w)
    assert torch.equal(pw.dense(), w)
    if not pw.gatherable:  # an oneDNN whose layout is not the decoded one: lookups refused
        with pytest.raises(RuntimeError, match="not decoded"):
            pw.rows(torch.tensor([0]))
        return
    ids = torch.randint(0, n, (2, 9))
    assert torch.equal(pw.rows(ids), F.embedding(ids, w))
    assert torch.equal(pw.rows(torch.tensor([n - 1, 0])), w[[n - 1, 0]])
    assert torch.equal(pw.dense(), w)
    for dtype in (torch.float32, torch.bfloat16):
        dense, norm = pw.converted(dtype)
        assert torch.equal(dense, w.to(dtype))
        assert norm == pytest.approx(float(w.double().norm(dim=1).max()), rel=1e-5)
    for bad in (n, -1):
        with pytest.raises(IndexError):
            pw.rows(torch.tensor([bad]))


def test_other_dtypes_and_devices_refused():
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        with pytest.raises(ValueError, match="float32"):
            PackedWeight(torch.zeros(8, 8, dtype=dtype))
    with pytest.raises(ValueError):
        PackedWeight(torch.zeros(8))


def _tiny(arch: str, tied: bool) -> nn.Module:
    common = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        num_hidden_layers=2, tie_word_embeddings=tied,
    )
    cfg = (transformers.Gemma3TextConfig(**common, query_pre_attn_scalar=16) if arch == "gemma3"
           else transformers.LlamaConfig(**common, attention_bias=True))
    cfg.architectures = ["Gemma3ForCausalLM" if arch == "gemma3" else "LlamaForCausalLM"]
    torch.manual_seed(0)
    model = model_class(cfg)(cfg).eval().requires_grad_(False)
    for p in model.parameters():  # RMSNorm weights start at 0 / 1: make every weight count
        p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("arch,tied", [("gemma3", True), ("gemma3", False), ("llama", False),
                                       ("llama", True)])
def test_pack_model_same_outputs_no_dense_copy(arch, tied):
    if tied and not _decodes(300, 64):
        pytest.skip("this oneDNN's packed layout does not decode: a tied table stays dense "
                    "(test_engine_tokens_packed_vs_dense covers that case)")
    model = _tiny(arch, tied)
    ref = copy.deepcopy(model)
    # an untied embedding table stays dense (lookups only); every other weight is packed
    kinds = (nn.Linear, nn.Embedding) if tied else (nn.Linear,)
    linears = [m for m in model.modules() if type(m) in kinds]
    dense_bytes = sum(m.weight.nbytes for m in linears)
    alive = [weakref.ref(m.weight) for m in linears]
    del linears
    assert pack_cpu_weights(model) == 4 * 2 + 1  # 2 layers x (qkv, o, gate_up, down) + head
    gc.collect()
    # No dense copy of a packed weight remains: the old tensors are gone, parameters shrank by
    # their bytes and the packed ones take what they took (a few padded rows at most).
    assert all(r() is None for r in alive)
    packed = {id(p): p for m in model.modules() for a in ("packed", "gate", "up", "gate_up")
              if isinstance(p := getattr(m, a, None), PackedWeight)}  # fmt: skip
    packed_bytes = sum(p.nbytes for p in packed.values())
    assert dense_bytes <= packed_bytes <= dense_bytes * 1.5  # 64-row blocks of tiny shapes
    assert not any(type(m) in kinds for m in model.modules())
    left = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(("proj.weight", "lm_head.weight")) for n in left)
    assert ("model.embed_tokens.weight" in left) == (not tied)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=gen)
    refs = dict(ref.named_modules())
    for name, got in model.named_modules():
        want = refs.get(name)
        if isinstance(got, Attention):
            qkv = torch.cat([want.q_proj(x), want.k_proj(x), want.v_proj(x)], dim=-1)
            torch.testing.assert_close(got.qkv_proj(x), qkv, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.o_proj(x), want.o_proj(x), rtol=1e-5, atol=1e-5)
            assert not hasattr(got, "q_proj")
        elif isinstance(got, GatedMLP):
            torch.testing.assert_close(got(x), want(x), rtol=1e-5, atol=1e-5)
    ids = torch.randint(0, 300, (7,), generator=gen)
    assert torch.equal(model.model.embed_tokens(ids), ref.model.embed_tokens(ids))
    torch.testing.assert_close(model.compute_logits(x), ref.compute_logits(x), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(head_logits(model, x), head_logits(ref, x), rtol=1e-5, atol=1e-5)

    head = model.model.embed_tokens if tied else model.lm_head
    assert isinstance(head, PackedEmbedding if tied else PackedLinear)
    with pytest.raises(RuntimeError, match="packed for oneDNN"):
        head.weight  # noqa: B018
    want_head = ref.model.embed_tokens if tied else ref.lm_head
    assert torch.equal(dense_weight(head), want_head.weight)


def test_pack_model_leaves_other_dtypes_dense():
    model = _tiny("gemma3", True).to(torch.bfloat16)
    assert pack_cpu_weights(model) == 0
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert all(m.qkv_proj is None for m in model.modules() if isinstance(m, Attention))


def test_engine_tokens_packed_vs_dense(tmp_path):
    """Greedy tokens of a tiny Gemma 3 through the engine: packed (the CPU default) and dense
    (--disable-fused-ops) agree."""
    from swaserve import Engine, SamplingParams
    from tests.helpers import save_random_hf_model

    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=6, query_pre_attn_scalar=16,
    )
    save_random_hf_model(cfg, tmp_path)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 17, 30)]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for dense in (False, True):
        eng = Engine(model=str(tmp_path), device="cpu", dtype="float32", kv_cache_gb=0.01,
                     page_size=4, disable_fused_ops=dense)
        packed = isinstance(eng.core.model.model.embed_tokens, PackedEmbedding)
        assert packed == (not dense and _decodes(256, 64))
        outs.append([o.token_ids for o in eng.generate(prompt_token_ids=prompts,
                                                       sampling_params=sp)])
    assert outs[0] == outs[1]
