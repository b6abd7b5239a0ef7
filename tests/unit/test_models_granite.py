"""Granite, GraniteSWA, CWM and VaultGemma on tiny random configs against transformers.

- Granite (granite.py): the muP multipliers far from 1 (embedding 3, residual 0.3 folded into
  o_proj/down_proj at load, attention scale 0.2, logits divided by 4 or by 3), with biases on
  the attention and MLP projections so the folded biases are on the path too.
- GraniteSWA (granite.py): sliding layers, per-head sinks (the engine's extra-logit sinks for
  the reference's sigmoid(lse - sink) scaling), a rope base per layer with a NoPE layer.
- CWM (registry: the Llama class): sliding and full `layer_types`, llama3 rope scaling.
- VaultGemma (gemma3.py): Gemma 2 without post-norms, soft-capped attention and logits.

Prompts are longer than the window (5), pages and chunks small, so chunked prefill, paged KV
and window retirement run.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from swaserve import Engine
from swaserve.ops import greedy_head
from tests.helpers import (
    assert_greedy_equals_hf_generate,
    assert_tp2_equals_tp1,
    engine_prompt_logits,
    random_hf_models,
    random_prompts,
)

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
)  # fmt: skip
SLIDING = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
MUP = dict(embedding_multiplier=3.0, residual_multiplier=0.3, attention_multiplier=0.2)
ENGINE = dict(device="cpu", dtype="float32", kv_cache_gb=0.01)


def tiny_granite_config(**overrides) -> transformers.GraniteConfig:
    args = dict(
        **COMMON, **MUP, num_hidden_layers=3, logits_scaling=4.0, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    args.update(overrides)
    return transformers.GraniteConfig(**args)


def _configs() -> dict:
    t = transformers
    return {
        "granite": tiny_granite_config(),
        # a divisor that is not a power of two, tied embeddings (the scale is not in the table)
        "granite_tied": tiny_granite_config(logits_scaling=3.0, tie_word_embeddings=True,
                                            attention_bias=False, mlp_bias=False),
        "granite_swa": t.GraniteSWAConfig(
            **COMMON, **MUP, logits_scaling=4.0, num_hidden_layers=4, layer_types=SLIDING,
            sliding_window=5, layer_rope_theta=[10000.0, 0, 500.0, 10000.0],
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ),
        "cwm": t.CwmConfig(
            **COMMON, num_hidden_layers=4, layer_types=SLIDING, sliding_window=5,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        ),
        "vaultgemma": t.VaultGemmaConfig(
            **COMMON, num_hidden_layers=4, layer_types=SLIDING, sliding_window=5,
            query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=3.0,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    return random_hf_models(_configs(), tmp_path_factory)


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("page_size,chunk", [(4, 7), (16, 64), (1, 5)])
def test_logits_match_hf(hf_folders, name, page_size, chunk):
    folder, ref = hf_folders[name]
    engine = Engine(model=str(folder), page_size=page_size, max_num_batched_tokens=chunk, **ENGINE)
    ids = random_prompts(128, [40])[0]
    got = engine_prompt_logits(engine, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    err = (got - want).abs().max().item()
    assert err < 1e-3, f"{name}: max |logit diff| {err}"
    engine.core.memory.check_integrity()
    idle = engine.memory_stats()
    assert idle["pages_free"] + idle["cache_pages"] == idle["pages_total"]
    assert idle["pages_held_by_requests"] == 0


@pytest.mark.parametrize(
    "name,disable_fused_ops",
    [(name, False) for name in _configs()] + [("granite", True), ("granite_swa", True)],
)
def test_greedy_equals_hf_generate(hf_folders, name, disable_fused_ops):
    """Greedy tokens of the engine (CPU-packed weights and, where the divisor allows, the
    screened greedy head; or the eager blocks) equal `generate` of transformers, past the
    window."""
    folder, ref = hf_folders[name]
    engine = Engine(
        model=str(folder), page_size=4, max_num_batched_tokens=16,
        disable_fused_ops=disable_fused_ops, **ENGINE,
    )  # fmt: skip
    if not disable_fused_ops and greedy_head.screen_available():
        # the screen serves a power-of-two divisor (4), not 3, nor soft-capped logits
        screened = engine.core.runner.greedy_head is not None
        assert screened == (name in ("granite", "granite_swa", "cwm")), name
    assert_greedy_equals_hf_generate(engine, ref, random_prompts(128, [11, 20, 3], seed=4),
                                     label=name)  # fmt: skip


def test_granite_greedy_head_only_for_power_of_two_divisors():
    """The CPU greedy screen picks the raw head's argmax: it serves a Granite whose
    `logits_scaling` is a positive power of two (division by it is exact), no other."""
    from swaserve.models.granite import GraniteForCausalLM

    if not greedy_head.screen_available():
        pytest.skip("no AVX512-BF16 screen on this CPU")
    with torch.device("meta"):
        model = GraniteForCausalLM(tiny_granite_config())
    for divisor in (3.0, 0.3, -4.0, 0.0):
        model.logits_scaling = divisor
        assert greedy_head.greedy_head_for(model) is None, divisor


def test_granite_mapping():
    """What the engine's Granite holds: the attention scale, the embedding scale, the divisor,
    sinks only on GraniteSWA, and a zero-frequency rotary on its NoPE layer."""
    from swaserve.models.registry import model_class

    cfgs = _configs()
    granite = model_class(cfgs["granite"])(cfgs["granite"])
    assert {layer.self_attn.spec.scale for layer in granite.model.layers} == {0.2}
    assert granite.model.embed_scale == 3.0 and granite.logits_scaling == 4.0
    assert granite.model.layers[0].self_attn.sinks is None
    swa = model_class(cfgs["granite_swa"])(cfgs["granite_swa"])
    assert [layer.self_attn.spec.window for layer in swa.model.layers] == [5, None, 5, 5]
    assert all(layer.self_attn.sinks is not None for layer in swa.model.layers)
    assert not swa.model.layers[1].self_attn.rotary.inv_freq_host.any()
    vault = model_class(cfgs["vaultgemma"])(cfgs["vaultgemma"])
    assert vault.model.layers[0].post_attention_layernorm is None


@pytest.mark.parametrize("name", ["granite", "granite_swa"])
def test_granite_tensor_parallel_equals_tp1(hf_folders, name):
    """TP = 2 (gloo, 2 ranks), o_proj/down_proj folded before they are cut (GraniteSWA: its
    sinks split with the heads, its NoPE and per-layer rope bases per rank): greedy tokens,
    logprobs and every prompt position's logits equal TP = 1."""
    folder, _ = hf_folders[name]
    assert_tp2_equals_tp1(dict(model=str(folder), page_size=4, max_num_batched_tokens=16,
                               **ENGINE))  # fmt: skip
