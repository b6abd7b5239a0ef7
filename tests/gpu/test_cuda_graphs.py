"""GPU only (skipped elsewhere): decode through CUDA graphs equals eager decode, and the
engine equals transformers on a tiny random model in float32 on the GPU."""

from __future__ import annotations

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from tests.helpers import engine_prompt_logits, random_hf_models, tiny_gemma3_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


GEMMA4 = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8, head_dim=16,
    global_head_dim=32, sliding_window=24, max_position_embeddings=2048, pad_token_id=0,
    bos_token_id=1, eos_token_id=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfgs = {
        "llama": transformers.LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, num_hidden_layers=3,
            max_position_embeddings=2048, tie_word_embeddings=False,
        ),
        "gemma3": tiny_gemma3_config(),
        # the architectures added on the CPU (2026-12-05), first run on a GPU here
        "qwen2": transformers.Qwen2Config(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=2048,
            use_sliding_window=True, sliding_window=24, max_window_layers=1,
            tie_word_embeddings=False,
        ),
        "gemma2": transformers.Gemma2Config(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, num_hidden_layers=4,
            max_position_embeddings=2048, sliding_window=24, query_pre_attn_scalar=16,
            attn_logit_softcapping=8.0, final_logit_softcapping=5.0,
        ),
        "phi3": transformers.Phi3Config(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=2048,
            sliding_window=24, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.75},
        ),
        "smollm3": transformers.SmolLM3Config(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=2048,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ),
        # parallel block, weight-only LayerNorm, interleaved rotary permuted at load, NoPE full
        "cohere2": transformers.Cohere2Config(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=2048,
            sliding_window=24, logit_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                         "full_attention"],
        ),
        # muP multipliers: residual folded into o/down, embedding and logit scales, and the
        # attention scale, on the GEMV path too
        "granite": transformers.GraniteConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=2048,
            embedding_multiplier=3.0, residual_multiplier=0.3, attention_multiplier=0.2,
            logits_scaling=4.0, tie_word_embeddings=False,
        ),
        # post-norm layers: whole-projection q/k norms (OLMo 3), per-head and NoPE (EXAONE 4)
        "olmo3": transformers.Olmo3Config(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=2048,
            sliding_window=24, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        ),
        "exaone4": transformers.Exaone4Config(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
            num_key_value_heads=2, num_hidden_layers=4, max_position_embeddings=2048,
            sliding_window=24, sliding_window_pattern=2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        ),
        # Gemma 4: full layers of 32-dim heads and one KV head (k_eq_v) beside sliding layers
        # of 16-dim heads and two (two K/V widths in one pool), proportional rope; and the
        # edge shape: per-layer embeddings, the last layers sharing their source's K/V
        "gemma4": transformers.Gemma4TextConfig(
            **GEMMA4, num_hidden_layers=6, num_key_value_heads=2, attention_k_eq_v=True,
            num_global_key_value_heads=1, final_logit_softcapping=5.0,
            hidden_size_per_layer_input=0, num_kv_shared_layers=0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        ),
        "gemma4_edge": transformers.Gemma4TextConfig(
            **GEMMA4, num_hidden_layers=7, num_key_value_heads=1,
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
            num_kv_shared_layers=3, use_double_wide_mlp=True,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2
            + ["full_attention"],
        ),
        "gemma4_moe": transformers.Gemma4TextConfig(
            **GEMMA4, num_hidden_layers=3, num_key_value_heads=2, attention_k_eq_v=True,
            num_global_key_value_heads=1, hidden_size_per_layer_input=0, enable_moe_block=True,
            num_experts=8, top_k_experts=2, moe_intermediate_size=64,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    }
    return random_hf_models(cfgs, tmp_path_factory)


@pytest.mark.parametrize("name", ["llama", "gemma3", "gemma2", "phi3", "cohere2", "olmo3",
                                  "exaone4", "granite", "gemma4", "gemma4_edge", "gemma4_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_decode_equals_eager(tiny, name, dtype, request):
    if name == "granite" and dtype == "bfloat16":
        # A bf16 near-tie (benchmarks/RESULTS.md, 2026-12-06): token 37 of the 40-token prompt
        # differs (H200 and H100 alike, float32 equal). There the eager step ranks 117 over 14
        # by 0.001 (logprobs -5.30513, -5.30611); the graph bucket's summation order gives both
        # -5.306106, an exact tie that argmax breaks to the lower id. Not a bug: not strict,
        # so a pass is reported as XPASS.
        request.applymarker(pytest.mark.xfail(reason="bf16 near-tie, measured", strict=False))
    folder = tiny[name][0]
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    toks = {}
    for bs in (0, 8):
        e = Engine(model=str(folder), dtype=dtype, kv_cache_gb=0.05, cuda_graph_max_bs=bs,
                   attention_backend="triton")
        assert (e.core.runner.graphs is not None) == (bs > 0)
        toks[bs] = [o.token_ids for o in e.generate(prompt_token_ids=prompts, sampling_params=p)]
        e.core.memory.check_integrity()
    assert toks[0] == toks[8]


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen2", "gemma2", "phi3", "smollm3",
                                  "cohere2", "olmo3", "exaone4", "granite", "gemma4",
                                  "gemma4_edge", "gemma4_moe"])
def test_engine_logits_equal_transformers_on_gpu(tiny, name):
    folder, ref = tiny[name]
    e = Engine(model=str(folder), dtype="float32", kv_cache_gb=0.05, page_size=16,
               max_num_batched_tokens=32)
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    got = engine_prompt_logits(e, ids).cpu()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() < 2e-3


def test_overlap_logprobs_equal_sync(tiny):
    """Logprobs travel to the host with the step's tokens (non-blocking, pinned): with the
    overlap schedule on they equal the synchronous schedule's, alternatives included."""
    folder = tiny["llama"][0]
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    got = {}
    for off in (False, True):
        e = Engine(model=str(folder), dtype="float32", kv_cache_gb=0.05,
                   attention_backend="triton", disable_overlap_schedule=off)
        outs = e.generate(prompt_token_ids=prompts, sampling_params=p)
        got[off] = [[(lp.token_id, round(lp.logprob, 4), lp.rank,
                      [(t, round(v, 4)) for t, v in lp.top]) for lp in o.outputs[0].logprobs]
                    for o in outs]
        e.core.memory.check_integrity()
    assert got[False] == got[True]
    assert all(len(s) == 24 and len(s[0][3]) == 3 for s in got[False])
