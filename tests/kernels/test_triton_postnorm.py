"""The post-norm family (OLMo 2/3, EXAONE 4: swaserve/models/olmo.py) with the fused Triton ops
on, under the interpreter on CPU: the same logits and greedy tokens as the eager blocks.

OLMo's q/k norms span the whole projections, so they run as plain RMSNorm kernels before the
Triton backend's rope/store prologue, which then only rotates; EXAONE 4's per-head norms ride in
the prologue, and its NoPE global layers rotate by zero frequencies.
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from swaserve.models.blocks import Attention, GatedMLP, RMSNorm, Rotary  # noqa: E402
from tests.kernels.test_triton_ops import _check_merge_keeps_state  # noqa: E402

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_hidden_layers=3,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _configs() -> dict:
    import transformers as t

    return {
        "olmo2": t.Olmo2Config(**TINY),
        "olmo3": t.Olmo3Config(
            **TINY, sliding_window=5, layer_types=LAYER_TYPES,
            rope_scaling={"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": 64},
        ),
        "exaone4": t.Exaone4Config(**TINY, sliding_window=5, layer_types=LAYER_TYPES),
    }  # fmt: skip


@pytest.mark.skipif(_CUDA, reason="CPU engine test")
@pytest.mark.parametrize(
    "name,backend",
    [("olmo2", "torch"), ("olmo2", "triton"), ("olmo3", "triton"), ("exaone4", "triton")],
)
def test_triton_postnorm_fused_model(tmp_path, name, backend):
    from swaserve import Engine, SamplingParams
    from swaserve.ops import enable_fused_ops
    from tests.helpers import engine_prompt_logits, save_random_hf_model

    save_random_hf_model(_configs()[name], tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4,
        max_num_batched_tokens=16, kv_cache_gb=0.01, attention_backend=backend,
        disable_fused_ops=True,  # eager blocks, not CPU-packed ones: the test fuses them itself
    )  # fmt: skip
    model = engine.core.model
    switched = sum(isinstance(m, (RMSNorm, Rotary, GatedMLP, Attention)) for m in model.modules())
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run() -> tuple[torch.Tensor, list[int]]:
        logits = engine_prompt_logits(engine, ids)
        out = engine.generate(prompt_token_ids=[ids[:9]], sampling_params=greedy)
        return logits, out[0].outputs[0].token_ids

    want_logits, want_tokens = run()
    _check_merge_keeps_state(model, lambda m: enable_fused_ops(m) == switched)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    prologue = attn.prologue(engine.core.runner.backend)
    assert (prologue is not None) == (backend == "triton")
    if prologue is not None:  # whole-projection norms stay out of the prologue
        assert (prologue.q_norm is None) == (name != "exaone4")
    got_logits, got_tokens = run()
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    assert got_tokens == want_tokens
    assert enable_fused_ops(model, enabled=False) == switched
    eager_logits, eager_tokens = run()
    assert torch.equal(eager_logits, want_logits) and eager_tokens == want_tokens
