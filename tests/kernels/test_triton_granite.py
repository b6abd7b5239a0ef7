"""Granite and GraniteSWA with the fused Triton ops on, on CPU under the Triton interpreter (as
test_triton_ops.py runs the other architectures), through the decode GEMV path
(`LlamaDecoderLayer.forward_gemv`, the head's GEMV in `compute_logits`): every muP multiplier
holds there too — the embedding scale ahead of the GEMV layers, residual_multiplier folded
into the o/down weights and biases the GEMV adds behind them, attention_multiplier as the
backend's scale, logits_scaling dividing the one-row head GEMV's logits — and GraniteSWA's sinks,
sliding and NoPE layers run through the Triton backend. Per-position logits and the decode
steps' logprobs equal transformers'; greedy tokens and logprobs equal the eager blocks'.

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
@pytest.mark.parametrize("name", ["granite", "granite_swa"])
def test_triton_gemv_path_granite(tmp_path, monkeypatch, name):
    import swaserve.ops.gemv as gemv_module
    from swaserve import Engine, SamplingParams
    from swaserve.ops import enable_fused_ops
    from tests.helpers import engine_prompt_logits, random_prompts, save_random_hf_model
    from tests.unit.test_models_granite import _configs

    cfg = _configs()[name]
    ref = save_random_hf_model(cfg, tmp_path)
    engine = Engine(
        model=str(tmp_path), device="cpu", dtype="float32", page_size=4,
        max_num_batched_tokens=16, kv_cache_gb=0.01, attention_backend="triton",
        disable_fused_ops=True,  # eager blocks, not CPU-packed ones: the test fuses them itself
        disable_prefix_cache=True,  # each run recomputes its prompts
    )  # fmt: skip
    model = engine.core.model
    ids = random_prompts(128, [23])[0]
    # one request (one-row decode steps: the head's GEMV too), then two (two-row steps)
    batches = [[ids[:9]], [ids[:11], ids[4:10]]]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)

    def run() -> tuple[torch.Tensor, list[list[tuple[int, float]]]]:
        logits = engine_prompt_logits(engine, ids)
        outs = []
        for b in batches:
            outs += engine.generate(prompt_token_ids=b, sampling_params=greedy)
        engine.core.memory.check_integrity()
        return logits, [[(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs] for o in outs]

    want_logits, want = run()
    enable_fused_ops(model)
    assert model.model.takes_gemv(1) and model.model.takes_gemv(2)
    calls: list[tuple[int, int]] = []  # (rows, output features) of each GEMV
    plain = gemv_module.gemv

    def spy(x, w, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append((x.shape[0], w.shape[0]))
        return plain(x, w, *args, **kwargs)

    monkeypatch.setattr(gemv_module, "gemv", spy)
    got_logits, got = run()
    # the layers' GEMVs ran at one and two rows (and on the prompt's last chunk of 7)
    assert {1, 2} <= {rows for rows, _ in calls}
    assert (1, cfg.vocab_size) in calls  # and the head's, on one row
    with torch.no_grad():
        hf = ref(torch.tensor([ids])).logits[0]
    assert (got_logits - hf).abs().max().item() < 1e-3
    assert (got_logits - want_logits).abs().max().item() < 1e-4
    prompts = [p for b in batches for p in b]
    for prompt, a, b in zip(prompts, got, want, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4
        # the decode steps' logprobs are transformers' (the divided logits' log-softmax)
        seq = prompt + [t for t, _ in a]
        with torch.no_grad():
            logp = ref(torch.tensor([seq])).logits[0].log_softmax(-1)
        for i, (token, lp) in enumerate(a):
            assert abs(logp[len(prompt) - 1 + i, token].item() - lp) < 1e-3
