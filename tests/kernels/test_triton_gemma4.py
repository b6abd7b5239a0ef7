"""Gemma 4 with the fused Triton ops on, on CPU under the Triton interpreter: the Triton
attention backend reading a pool whose layers have two K/V widths (full layers' 32-dim heads
in two unit slots, sliding layers' 16-dim ones), the fused q/k prologue with V normed before the
store, shared-KV layers attending to their source's cache (`kv_stored`), merged q/k/v (k_proj
loaded as v_proj too under `attention_k_eq_v`), and the fused MoE kernel (gelu) beside the
dense MLP. Per-position logits equal transformers' and the eager blocks'; greedy tokens equal
the eager blocks'.

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
@pytest.mark.parametrize("name", ["edge", "moe"])  # dense: its k_eq_v is in moe too
def test_triton_fused_ops_gemma4(tmp_path, name):
    from swaserve import Engine
    from swaserve.models.gemma4 import Gemma4Attention
    from swaserve.ops import enable_fused_ops
    from tests.helpers import logits_and_greedy, random_prompts
    from tests.unit.test_models_gemma4 import _config, _save

    ref = _save(_config(name), tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4,
        max_num_batched_tokens=16, kv_cache_gb=0.01, attention_backend="triton",
        disable_fused_ops=True,  # eager blocks, not CPU-packed ones: the test fuses them itself
    )  # fmt: skip
    model = engine.core.model
    ids = random_prompts(128, [23])[0]
    want_logits, want_tokens = logits_and_greedy(engine, ids)
    enable_fused_ops(model)
    attn = next(m for m in model.modules() if isinstance(m, Gemma4Attention))
    assert attn.qkv_weight is not None and attn.fused
    assert attn.prologue(engine.core.runner.backend) is not None
    got_logits, got_tokens = logits_and_greedy(engine, ids)
    with torch.no_grad():
        hf = ref(torch.tensor([ids])).logits[0]
    assert (want_logits - hf).abs().max().item() < 1e-3
    assert (got_logits - hf).abs().max().item() < 1e-3
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    assert got_tokens == want_tokens
    engine.core.memory.check_integrity()
