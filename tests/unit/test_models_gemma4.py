"""Gemma 4 text on tiny random configs against transformers' Gemma4ForCausalLM.

- "dense" (31B-like): full layers with their own head size (32 against 16) and, through
  `attention_k_eq_v`, one KV head where sliding layers have two and no v_proj; proportional
  rope on full layers; final-logit soft-capping.
- "edge" (E2B-like): per-layer embeddings (PLE), the last three layers sharing K/V with the last
  earlier layer of their kind, twice-wide MLPs there, head sizes 16 / 32.
- "moe" (26B-A4B-like): routed experts (4, top 2) beside each layer's dense MLP, routed by the
  residual stream, with per-expert scales.

Every layer's `layer_scalar` is set away from 1 before saving. Prompts are longer than the
window (5), pages and chunks small, so chunked prefill, paged KV and window retirement run, and
the pool holds layers of two K/V widths in one page size.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from tests.helpers import (
    assert_greedy_equals_hf_generate,
    assert_logits_match_hf,
    assert_tp2_equals_tp1,
    random_prompts,
)

ENGINE = dict(device="cpu", dtype="float32", kv_cache_gb=0.01)
TYPES = ["sliding_attention", "sliding_attention", "full_attention"]


def _config(name: str) -> transformers.Gemma4TextConfig:
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        head_dim=16, global_head_dim=32, sliding_window=5, max_position_embeddings=256,
        rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    if name == "dense":
        return transformers.Gemma4TextConfig(
            **common, num_hidden_layers=6, layer_types=TYPES * 2, num_key_value_heads=2,
            attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=3.0,
            hidden_size_per_layer_input=0, num_kv_shared_layers=0,
        )  # fmt: skip
    if name == "moe":
        return transformers.Gemma4TextConfig(
            **common, num_hidden_layers=3, layer_types=TYPES, num_key_value_heads=2,
            attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            final_logit_softcapping=30.0,
        )  # fmt: skip
    return transformers.Gemma4TextConfig(
        **common, num_hidden_layers=7, layer_types=TYPES * 2 + ["full_attention"],
        num_key_value_heads=1, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
        num_kv_shared_layers=3, use_double_wide_mlp=True, final_logit_softcapping=None,
    )  # fmt: skip


NAMES = ["dense", "edge", "moe"]


def _save(cfg, folder):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.6 + 0.15 * i)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    out = {}
    for name in NAMES:
        folder = tmp_path_factory.mktemp(f"gemma4_{name}")
        out[name] = (folder, _save(_config(name), folder))
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("page_size,chunk", [(4, 7), (16, 64), (1, 5)])
def test_logits_match_hf(hf_folders, name, page_size, chunk):
    folder, ref = hf_folders[name]
    engine = Engine(model=str(folder), page_size=page_size, max_num_batched_tokens=chunk, **ENGINE)
    assert_logits_match_hf(engine, ref)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("disable_fused_ops", [False, True])
def test_greedy_equals_hf_generate(hf_folders, name, disable_fused_ops):
    """Greedy tokens (CPU-packed weights, or the eager blocks) equal transformers' `generate`
    past the window, in one batch of three prompts."""
    folder, ref = hf_folders[name]
    engine = Engine(model=str(folder), page_size=4, max_num_batched_tokens=16,
                    disable_fused_ops=disable_fused_ops, **ENGINE)  # fmt: skip
    assert_greedy_equals_hf_generate(engine, ref, random_prompts(128, [11, 20, 3], seed=4),
                                     label=name)  # fmt: skip
    engine.core.memory.check_integrity()


def test_pool_layout(hf_folders):
    """What the pool holds: full layers' rows twice as wide as sliding ones' in the dense
    model (two unit slots); shared layers own no slot and read their source's cache."""
    engine = Engine(model=str(hf_folders["dense"][0]), page_size=4, **ENGINE)
    layout = engine.core.layout
    assert layout.kv_shapes == ((2, 16), (2, 16), (1, 32)) * 2
    assert layout.unit_width == 32 and layout.num_padded_slots == 0
    kv = engine.core.kv
    assert kv.layer_cache(2)[0].shape[1:] == (4, 1, 32)
    assert kv.layer_cache(0)[0].shape[1:] == (4, 2, 16)
    edge = Engine(model=str(hf_folders["edge"][0]), page_size=4, **ENGINE)
    lay = edge.core.layout
    assert lay.kv_sources == (0, 1, 2, 3, 3, 2, 2)
    owned = sorted(x for g in lay.groups for x in g.layers)
    assert owned == [0, 1, 2, 3]
    k6, k2 = edge.core.kv.layer_cache(6)[0], edge.core.kv.layer_cache(2)[0]
    assert k6.data_ptr() == k2.data_ptr() and k6.stride() == k2.stride()


def test_unsupported_variants_are_clear_errors():
    from swaserve.models.gemma4 import Gemma4ForCausalLM

    cfg = _config("dense")
    cfg.use_bidirectional_attention = "all"
    with pytest.raises(ValueError, match="bidirectional"):
        Gemma4ForCausalLM(cfg)


def test_memory_bench_on_the_shipped_31b_shape():
    """`swaserve bench memory --model gemma-4-31b` on the release's shape (50 sliding layers of
    16 x 256, window 1024; 10 full layers of 4 x 512): pages of 10 unit slots of 2,048
    elements (16 tokens: 1,310,720 bytes in bf16), one full group of 10 layers and 10 sliding
    groups of 5, nothing padded. A 32k request holds the full group's 2,048 pages and one
    window (64 pages) in each sliding group."""
    import json

    from swaserve.bench.memory import main_from_config
    from swaserve.weights.loader import SHIPPED_CONFIGS

    cfg = json.loads((SHIPPED_CONFIGS / "gemma-4-31b" / "config.json").read_text())
    r = main_from_config(cfg, context=32768, kv_cache_gb=20, page_size=16)
    assert r["layout"]["page_bytes"] == 10 * 2 * 16 * 2048 * 2
    assert r["layout"]["num_groups"] == 11
    assert r["layout"]["pages_per_request"] == 2048 + 10 * 64
    assert r["bytes_per_request"] == (2048 + 640) * r["layout"]["page_bytes"]
    assert r["max_concurrent"] == 5 and r["max_concurrent_all_full"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_tensor_parallel_equals_tp1(hf_folders, name):
    """TP = 2 (gloo, 2 ranks): full and sliding layers cut by their own KV heads (the dense
    full layers' one KV head serves both ranks), shared-KV layers' query heads cut with their
    source's, the per-layer embedding table over the vocabulary, the experts by their
    intermediate rows: greedy tokens, logprobs and prompt logits equal TP = 1."""
    folder, _ = hf_folders[name]
    assert_tp2_equals_tp1(dict(model=str(folder), page_size=4, max_num_batched_tokens=16,
                               **ENGINE))  # fmt: skip


def test_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """The released checkpoints are Gemma4ForConditionalGeneration (`model.language_model.*`
    beside a vision tower and its embedder): the engine loads the text model from it, the
    towers skipped, and its prompt logits equal the multimodal model's on text."""
    cfg = transformers.Gemma4Config(
        text_config=_config("dense").to_dict(), audio_config=None,
        vision_config=transformers.Gemma4VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16,
        ).to_dict(),
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.Gemma4ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    ref.save_pretrained(tmp_path)
    engine = Engine(model=str(tmp_path), page_size=4, **ENGINE)
    assert_logits_match_hf(engine, ref.eval())


def test_ngram_speculation_is_lossless(hf_folders):
    """Verify chunks and their rollback through the per-layer pool and KV-shared layers: n-gram
    speculation on repetitive prompts accepts drafts and gives the tokens and logprobs of
    speculation off."""
    folder = str(hf_folders["edge"][0])
    prompts = [[5, 6, 7, 8] * 8, [9, 10, 11] * 9 + [12]]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    outs = {}
    for spec in (None, "ngram"):
        kw = {"speculative_algorithm": spec} if spec else {}
        engine = Engine(model=folder, page_size=4, **ENGINE, **kw)
        outs[spec] = engine.generate(prompt_token_ids=prompts, sampling_params=p)
        engine.core.memory.check_integrity()
    assert sum(o.spec_decoding["spec_accepted_drafts"] for o in outs["ngram"]) > 0
    for a, b in zip(outs[None], outs["ngram"], strict=True):
        assert a.token_ids == b.token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert max(abs(x.logprob - y.logprob) for x, y in zip(la, lb, strict=True)) < 1e-5


def test_prefix_hit_past_the_window(hf_folders):
    """A second prompt sharing a 45-token prefix (nine windows) reuses it from the prefix cache
    (the full layers' pages, the sliding layers' last window; the shared layers read their
    sources') and generates what a cold engine does."""
    folder = str(hf_folders["edge"][0])
    base = random_prompts(128, [45], seed=9)[0]
    prompts = [base + [3, 4, 5], base + [7, 8]]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    cold = Engine(model=folder, page_size=4, disable_prefix_cache=True, **ENGINE)
    want = [cold.generate(prompt_token_ids=[x], sampling_params=p)[0] for x in prompts]
    warm = Engine(model=folder, page_size=4, **ENGINE)
    got = []
    for x in prompts:
        got.append(warm.generate(prompt_token_ids=[x], sampling_params=p)[0])
        warm.core.memory.check_integrity()
    assert [g.num_cached_tokens for g in got] == [0, 45]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        lg, lw = g.outputs[0].logprobs, w.outputs[0].logprobs
        assert max(abs(x.logprob - y.logprob) for x, y in zip(lg, lw, strict=True)) < 1e-5


def test_dummy_weights_keep_the_scales_at_one():
    """`--load-format dummy`: layer_scalar and the router's scales are 1 (zeros, as other
    vectors get, would zero every layer's output and every expert weight)."""
    from swaserve.models.gemma4 import Gemma4ForCausalLM
    from swaserve.weights.loader import _init_dummy

    model = Gemma4ForCausalLM(_config("moe"))
    _init_dummy(model, seed=0)
    layer = model.model.layers[0]
    assert layer.layer_scalar.item() == 1.0
    assert bool((layer.experts.router_scale == 1).all())
    assert bool((layer.experts.per_expert_scale == 1).all())
    assert bool((layer.input_layernorm.weight == 1).all())
    assert layer.self_attn.q_proj.weight.std().item() > 0


def test_host_and_disk_tiers_under_device_pressure(hf_folders, tmp_path):
    """Whole pages of a pool of two K/V widths through the host and disk tiers: three
    conversations whose cached prefixes do not fit the device pool together come back from the
    host (and disk) tiers and answer as an engine without a prefix cache does."""
    import random

    folder = str(hf_folders["edge"][0])
    rng = random.Random(3)
    starts = [[rng.randrange(3, 128) for _ in range(150)] for _ in range(3)]
    turns = [[[rng.randrange(3, 128) for _ in range(20)] for _ in range(3)] for _ in range(2)]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def talk(engine):
        history, outs = list(starts), []
        for rnd in turns:
            for c in range(3):
                prompt = history[c] + rnd[c]
                out = engine.generate(prompt_token_ids=[prompt], sampling_params=p,
                                      use_tqdm=False)[0]  # fmt: skip
                engine.core.memory.check_integrity()
                outs.append(out.token_ids)
                history[c] = prompt + out.token_ids
        return outs

    want = talk(Engine(model=folder, disable_prefix_cache=True, **ENGINE))
    tiers = Engine(model=folder, kv_cache_gb=0.00012, device="cpu", dtype="float32",
                   host_cache_gb=0.01, disk_cache_dir=str(tmp_path))  # fmt: skip
    assert talk(tiers) == want
    stats = tiers.memory_stats()
    assert stats["evictions"] > 0 and stats["host_loads"] > 0, stats
    tiers.core.cache.close()


@pytest.mark.parametrize("name", ["dense", "edge"])
def test_dflash_on_gemma4_is_lossless(hf_folders, tmp_path, name):
    """DFlash on a Gemma 4 target: the drafter's context layers (a sliding and a full one, of
    its own K/V shape) sit in the pool beside the target's two widths (and its KV-shared
    layers); drafting through verify chunks keeps tokens and logprobs equal to speculation
    off."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    from tests.helpers import check_integrity_every_step

    folder = str(hf_folders[name][0])
    n = _config(name).num_hidden_layers
    raw = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=128, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        num_hidden_layers=2, num_target_layers=n, use_sliding_window=True, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        dflash_config={"block_size": 4, "mask_token_id": 127, "target_layer_ids": [1, n - 2],
                       "input_embedding_scale": 8.0, "final_logit_softcapping": 3.0},
    )  # fmt: skip
    drafter = DFlashDraftModel(Qwen3Config.from_dict(raw)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in drafter.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if pname.endswith("norm.weight") else 0.2 * noise)
    drafter.save_pretrained(tmp_path)
    prompts = random_prompts(126, [14, 30, 5], seed=6)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    kw = dict(model=folder, page_size=4, max_num_batched_tokens=12, **ENGINE)
    want = Engine(**kw).generate(prompt_token_ids=prompts, sampling_params=params)
    on = check_integrity_every_step(Engine(
        **kw, speculative_algorithm="dflash", speculative_draft_model=str(tmp_path),
        disable_adaptive_speculation=True))  # fmt: skip
    got = on.generate(prompt_token_ids=prompts, sampling_params=params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        lg, lw = g.outputs[0].logprobs, w.outputs[0].logprobs
        assert max(abs(a.logprob - b.logprob) for a, b in zip(lg, lw, strict=True)) < 1e-4
    assert sum(o.spec_decoding["spec_verify_ct"] for o in got) > 0
