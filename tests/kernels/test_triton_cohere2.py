"""Cohere2 with the fused Triton ops on, on CPU under the Triton interpreter (as
test_triton_ops.py runs the other architectures): merged q/k/v and gate/up projections, the
rotary fused into the Triton backend's K/V store (rope_store.py) on the q/k rows permuted at
load (interleaved -> half-split rotary), zero-frequency rotary on the NoPE layers. The weight-only
LayerNorm stays torch. Per-position logits equal transformers' and the eager blocks'; greedy
tokens equal the eager blocks'.

Set SWASERVE_TEST_TRITON_CUDA=1 to skip it (the CPU engine test of a CUDA run).
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
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_triton_fused_ops_cohere2(tmp_path, backend):
    from swaserve import Engine, SamplingParams
    from swaserve.models.blocks import Attention
    from swaserve.ops import enable_fused_ops
    from tests.helpers import engine_prompt_logits, random_prompts, save_random_hf_model
    from tests.unit.test_models_cohere2 import tiny_cohere2_config

    cfg = tiny_cohere2_config(layer_types=["sliding_attention", "full_attention"] * 2)
    ref = save_random_hf_model(cfg, tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4,
        max_num_batched_tokens=16, kv_cache_gb=0.01, attention_backend=backend,
        disable_fused_ops=True,  # eager blocks, not CPU-packed ones: the test fuses them itself
    )  # fmt: skip
    model = engine.core.model
    ids = random_prompts(128, [23])[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run() -> tuple[torch.Tensor, list[int]]:
        logits = engine_prompt_logits(engine, ids)
        out = engine.generate(prompt_token_ids=[ids[:9]], sampling_params=greedy)
        return logits, out[0].outputs[0].token_ids

    want_logits, want_tokens = run()
    # per layer: Rotary, Attention, GatedMLP (its LayerNorms are not RMSNorm)
    assert enable_fused_ops(model) == 4 * 3
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    assert attn.qkv_weight is not None and attn.fused
    assert (attn.prologue(engine.core.runner.backend) is not None) == (backend == "triton")
    got_logits, got_tokens = run()
    with torch.no_grad():
        hf = ref(torch.tensor([ids])).logits[0]
    assert (got_logits - hf).abs().max().item() < 1e-3
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    assert got_tokens == want_tokens
