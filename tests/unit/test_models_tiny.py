"""Tiny random configs of every architecture: per-position logits equal Hugging Face's.

Weights are random (seeded) in the HF model, saved as a HF folder and loaded by the engine, so
both sides run the same weights. Prompts are longer than the windows, page sizes and chunk sizes
are small, so chunked prefill, paged KV and window retirement are all on the path.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from tests.helpers import engine_prompt_logits, random_hf_models

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
)


def _configs() -> dict:
    t = transformers
    sliding = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return {
        "llama": t.LlamaConfig(
            **COMMON, num_hidden_layers=3, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        ),
        "llama_tied": t.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=True),
        "qwen3": t.Qwen3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False),
        # Qwen2.5's biased q/k/v; sliding from layer 1 on (use_sliding_window, max_window_layers)
        "qwen2": t.Qwen2Config(**COMMON, num_hidden_layers=3, tie_word_embeddings=False,
                               use_sliding_window=True, sliding_window=6, max_window_layers=1),
        # Phi-4-mini's partial rotary; fused q|k|v and gate|up in the checkpoint; every layer
        # sliding (Phi-3-mini-4k's window, scaled down)
        "phi3": t.Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=6, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2,
                             tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75}),
        "ministral": t.MinistralConfig(**COMMON, num_hidden_layers=3, sliding_window=5,
                                       layer_types=sliding[:3], tie_word_embeddings=False),
        # SmolLM3: every 4th layer without rotary (NoPE)
        "smollm3": t.SmolLM3Config(**COMMON, num_hidden_layers=4, tie_word_embeddings=True,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2),
        # Gemma 2: alternating sliding/full layers, attention and final logits soft-capped
        "gemma2": t.Gemma2Config(**COMMON, num_hidden_layers=4, sliding_window=5,
                                 query_pre_attn_scalar=16, attn_logit_softcapping=4.0,
                                 final_logit_softcapping=3.0),
        "mistral": t.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=7),
        "gemma3": t.Gemma3TextConfig(
            **COMMON, num_hidden_layers=6, layer_types=sliding, sliding_window=5,
            query_pre_attn_scalar=24, rope_local_base_freq=10000.0, rope_theta=1e6,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        "gemma3_softcap": t.Gemma3TextConfig(
            **COMMON, num_hidden_layers=3, layer_types=sliding[:3], sliding_window=3,
            query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        ),
    }


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    return random_hf_models(_configs(), tmp_path_factory)


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("page_size,chunk", [(4, 7), (16, 64), (1, 5)])
def test_tiny_logits_match_hf(hf_folders, name, page_size, chunk):
    folder, ref = hf_folders[name]
    engine = Engine(
        model=str(folder), device="cpu", dtype="float32", page_size=page_size,
        max_num_batched_tokens=chunk, kv_cache_gb=0.01,
    )
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (40,), generator=gen).tolist()
    got = engine_prompt_logits(engine, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    err = (got - want).abs().max().item()
    assert err < 1e-3, f"{name}: max |logit diff| {err}"
    engine.core.memory.check_integrity()
    idle = engine.memory_stats()  # idle: only the prefix cache holds pages
    assert idle["pages_free"] + idle["cache_pages"] == idle["pages_total"]
    assert idle["pages_held_by_requests"] == 0


def test_dummy_load_format_from_config_alone(tmp_path):
    """--load-format dummy: random weights in real shapes from a config.json alone."""
    cfg = _configs()["gemma3"]
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(ValueError, match="dummy"):
        Engine(model=str(tmp_path), device="cpu")
    engine = Engine(model=str(tmp_path), device="cpu", load_format="dummy", kv_cache_gb=0.01)
    out = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 5 and out[0].text == ""  # no tokenizer: ids only


@pytest.mark.parametrize(
    "name,params_b",
    [("llama-3.1-8b", 8.0), ("gemma-3-27b", 27.0), ("gpt-oss-20b", 20.9),
     ("gpt-oss-120b", 116.8), ("qwen3-30b-a3b", 30.5)],
)
def test_shipped_shape_configs(name, params_b):
    """The shipped dummy shapes build with the right parameter counts (on meta, no memory)."""
    from swaserve.engine.engine import resolve_folder
    from swaserve.models.registry import model_class
    from swaserve.weights.loader import load_hf_config

    cfg = load_hf_config(resolve_folder(name))
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(n - params_b) / params_b < 0.1, n
