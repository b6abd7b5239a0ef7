"""The post-norm family (swaserve/models/olmo.py) on tiny random configs: per-position logits
and greedy tokens equal Hugging Face's, and tensor parallelism (2 ranks, gloo) equals one rank.

- OLMo 2: q/k norms over the whole projections, every layer full;
- OLMo 3: the same layer with sliding and full `layer_types` (window 5) and YaRN on the full
  layers only (rope per layer type);
- EXAONE 4: per-head q/k norms, sliding and global layers, the global ones without rotary.

Weights are random (seeded) in the HF model, saved as a HF folder and loaded by the engine.
Prompts are longer than the window; page and chunk sizes are small, so chunked prefill, paged KV
and window retirement are on the path.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from tests.helpers import (
    assert_logits_match_hf,
    assert_tp2_equals_tp1,
    engine_prompt_logits,
    random_hf_models,
    random_prompts,
    save_random_hf_model,
)

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
SLIDING, FULL = "sliding_attention", "full_attention"


def _configs() -> dict:
    t = transformers
    return {
        "olmo2": t.Olmo2Config(**COMMON, num_hidden_layers=2, attention_bias=True),
        "olmo3": t.Olmo3Config(
            **COMMON, num_hidden_layers=4, sliding_window=5,
            layer_types=[SLIDING, FULL, SLIDING, FULL],
            # the v4 field: Olmo3Config puts it on the full layers' rope only
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64},
        ),
        # pattern 2: layers 0 and 2 sliding, 1 and 3 global (NoPE)
        "exaone4": t.Exaone4Config(
            **COMMON, num_hidden_layers=4, sliding_window=5, sliding_window_pattern=2,
        ),
    }  # fmt: skip


NAMES = list(_configs())


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict:
    return random_hf_models(_configs(), tmp_path_factory)


def test_configs_mix_window_kinds():
    """The configs exercise what the file is for: OLMo 3's YaRN on full layers only, EXAONE 4's
    sliding and NoPE global layers."""
    from swaserve.models.olmo import Exaone4ForCausalLM, Olmo3ForCausalLM

    cfgs = _configs()
    olmo3 = Olmo3ForCausalLM(cfgs["olmo3"])
    scales = [layer.self_attn.rotary.attention_scaling for layer in olmo3.model.layers]
    assert scales[0] == scales[2] == 1.0 and scales[1] == scales[3] > 1.0
    exaone = Exaone4ForCausalLM(cfgs["exaone4"])
    windows = [layer.self_attn.spec.window for layer in exaone.model.layers]
    assert windows == [5, None, 5, None]
    nope = [not layer.self_attn.rotary.inv_freq.any() for layer in exaone.model.layers]
    assert nope == [False, True, False, True]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("page_size,chunk", [(4, 7), (16, 64), (1, 5)])
def test_postnorm_logits_match_hf(hf_folders, name, page_size, chunk):
    folder, ref = hf_folders[name]
    engine = Engine(
        model=str(folder), device="cpu", dtype="float32", page_size=page_size,
        max_num_batched_tokens=chunk, kv_cache_gb=0.01,
    )  # fmt: skip
    assert_logits_match_hf(engine, ref)


@pytest.mark.parametrize("name", NAMES)
def test_postnorm_greedy_matches_hf_generate(hf_folders, name):
    """Greedy tokens past the window equal transformers' generate (its own sliding cache)."""
    folder, ref = hf_folders[name]
    engine = Engine(
        model=str(folder), device="cpu", dtype="float32", page_size=4,
        max_num_batched_tokens=16, kv_cache_gb=0.01,
    )  # fmt: skip
    prompts = random_prompts(128, [23, 9], seed=2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            seq = ref.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert out.outputs[0].token_ids == seq[0, len(ids) :].tolist(), name


def test_postnorm_fused_is_eager_without_cpu_packing(hf_folders):
    """`--disable-fused-ops` (the eager blocks) and the CPU-packed default give the same logits
    (the whole-projection q/k norms keep the eager split path under packing)."""
    folder, _ = hf_folders["olmo3"]
    ids = random_prompts(128, [30], seed=4)[0]
    kw = dict(model=str(folder), device="cpu", dtype="float32", page_size=4,
              max_num_batched_tokens=16, kv_cache_gb=0.01)  # fmt: skip
    packed = engine_prompt_logits(Engine(**kw), ids)
    eager = engine_prompt_logits(Engine(disable_fused_ops=True, **kw), ids)
    assert (packed - eager).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def tp_folders(tmp_path_factory) -> dict:
    """OLMo 3 with one KV head (replicated on both ranks: its k norm's sum of squares counts
    it twice, and so does its divisor) and EXAONE 4 with two (split)."""
    cfgs = _configs()
    olmo3 = cfgs["olmo3"]
    olmo3.num_key_value_heads = 1
    out = {}
    for name, cfg in (("olmo3", olmo3), ("exaone4", cfgs["exaone4"])):
        out[name] = tmp_path_factory.mktemp(f"tp_{name}")
        save_random_hf_model(cfg, out[name])
    return out


@pytest.mark.parametrize("name", ["olmo3", "exaone4"])
def test_postnorm_tp2_equals_tp1(tp_folders, name):
    kw = dict(model=str(tp_folders[name]), device="cpu", dtype="float32", page_size=4,
              max_num_batched_tokens=16, kv_cache_gb=0.01)  # fmt: skip
    assert_tp2_equals_tp1(kw)
