"""`--quantization fp8` with the fused Triton ops on (the GPU's default path), under the
interpreter on CPU: the q|k|v and gate|up Fp8Linears feed the rope/store prologue and the
activation kernel, the same logits and greedy tokens as the eager blocks; steps of at most
`gemv_rows` tokens run the decode GEMV on the e4m3 codes and scales with unquantised inputs
(weights-only fp8), checked against a plain engine on the dequantised checkpoint.
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
    hf_model = save_random_hf_model(cfg, tmp_path)
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
    got_logits, got_tokens = run()
    if arch == "llama":
        # steps of at most gemv_rows (8 on this width) tokens take the decode GEMV on the e4m3
        # codes with unquantised inputs; the first 16-token chunk takes the fp8 GEMMs, as eager
        assert model.model.gemv_rows == 8 and model.model.takes_gemv(1)
        assert (got_logits[:16] - want_logits[:16]).abs().max().item() < 1e-4
        # a prompt the engine has not cached (its earlier K/V came from the eager path)
        fresh = torch.randint(0, 128, (7,), generator=torch.Generator().manual_seed(2)).tolist()
        _check_gemv_steps(engine, hf_model, tmp_path, fresh)
    else:
        assert (got_logits - want_logits).abs().max().item() < 1e-4
        assert got_tokens == want_tokens
    engine.core.memory.check_integrity()


def _check_gemv_steps(engine, hf_model, folder, ids: list[int]) -> None:
    """Decode steps of one request on the GEMV path read the Fp8Linears' codes and scales with
    the inputs unquantised (weights-only fp8): their tokens and logprobs equal a plain engine
    (GEMV path too) on the checkpoint with every projection dequantised, codes * scale."""
    import copy

    from swaserve import Engine, SamplingParams
    from swaserve.ops import enable_fused_ops
    from swaserve.ops.fp8_linear import quantize_rows_torch
    from tests.helpers import engine_prompt_logits

    dq = copy.deepcopy(hf_model)
    with torch.no_grad():
        for layer in dq.model.layers:
            for part in (layer.self_attn, layer.mlp):
                for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"):  # fmt: skip
                    lin = getattr(part, name, None)
                    if lin is None:
                        continue
                    codes, scale = quantize_rows_torch(lin.weight)
                    lin.weight.copy_(codes.float() * scale)
    dq.save_pretrained(folder / "dequantised")
    plain = Engine(model=str(folder / "dequantised"), device="cpu", dtype="float32", page_size=4,
                   max_num_batched_tokens=16, kv_cache_gb=0.01, attention_backend="triton",
                   disable_fused_ops=True)  # fmt: skip
    enable_fused_ops(plain.core.model)
    assert plain.core.model.model.takes_gemv(1)
    # the 7-token prompt is one GEMV step on both engines (so are the decode steps)
    got_prompt, want_prompt = engine_prompt_logits(engine, ids), engine_prompt_logits(plain, ids)
    assert (got_prompt - want_prompt).abs().max().item() < 1e-4
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)
    got, want = (
        e.generate(prompt_token_ids=[ids], sampling_params=params)[0].outputs[0]
        for e in (engine, plain)
    )
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4
