"""`--quantization fp8` with the fused Triton ops on (the GPU's default path), under the
interpreter on CPU: the q|k|v and gate|up Fp8Linears feed the rope/store prologue and the
activation kernel, the same logits and greedy tokens as the eager blocks, and the quantised
layers stay off the decode GEMV path (its kernel reads bf16 weights).
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")


@pytest.mark.skipif(_CUDA, reason="CPU engine test")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_triton_fp8_fused_model(tmp_path, arch):
    import transformers

    from swaserve import Engine, SamplingParams
    from swaserve.ops import enable_fused_ops
    from swaserve.ops.fp8_linear import Fp8Linear
    from tests.helpers import engine_prompt_logits, save_random_hf_model

    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                num_hidden_layers=3)  # fmt: skip
    if arch == "llama":
        cfg = transformers.LlamaConfig(**tiny, tie_word_embeddings=False)
    else:
        cfg = transformers.Gemma3TextConfig(
            **tiny, sliding_window=5, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
    save_random_hf_model(cfg, tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4, quantization="fp8",
        max_num_batched_tokens=16, kv_cache_gb=0.01, attention_backend="triton",
        disable_fused_ops=True,  # eager blocks: the test fuses them itself
    )  # fmt: skip
    model = engine.core.model
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run() -> tuple[torch.Tensor, list[int]]:
        logits = engine_prompt_logits(engine, ids)
        out = engine.generate(prompt_token_ids=[ids[:9]], sampling_params=greedy)
        return logits, out[0].outputs[0].token_ids

    want_logits, want_tokens = run()
    enable_fused_ops(model)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and layer.mlp.fused
    assert layer.self_attn.qkv_weight is None  # nothing merged again beside the fp8 modules
    if arch == "llama":
        assert model.model.gemv_rows > 0 and not model.model.takes_gemv(1)
    got_logits, got_tokens = run()
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    assert got_tokens == want_tokens
    engine.core.memory.check_integrity()
