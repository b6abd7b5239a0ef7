"""Cohere2 (Command R7B, Command A) on a tiny random config against transformers.

The model's specifics are all on the path: the weight-only LayerNorm, the parallel block
(h + attn(x) + mlp(x)), the interleaved rotary of sliding layers (turned into the engine's
half-split rotary by permuting q/k rows at load), NoPE full layers, `logit_scale` on tied
embeddings. Prompts are longer than the window, pages and chunks are small, so chunked
prefill, paged KV and window retirement run too.
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
    random_prompts,
    save_random_hf_model,
)

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
ENGINE = dict(device="cpu", dtype="float32", kv_cache_gb=0.01)


def tiny_cohere2_config(**overrides) -> transformers.Cohere2Config:
    args = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, layer_norm_eps=1e-5,
        sliding_window=5, layer_types=LAYERS, logit_scale=2.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    args.update(overrides)
    # head_dim is hidden / heads (16): Cohere2Config sets it so itself
    return transformers.Cohere2Config(num_hidden_layers=len(args["layer_types"]), **args)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cohere2")
    return folder, save_random_hf_model(tiny_cohere2_config(), folder)


@pytest.mark.parametrize("page_size,chunk", [(4, 7), (16, 64), (1, 5)])
def test_cohere2_logits_match_hf(hf_model, page_size, chunk):
    folder, ref = hf_model
    engine = Engine(model=str(folder), page_size=page_size, max_num_batched_tokens=chunk, **ENGINE)
    assert_logits_match_hf(engine, ref)


@pytest.mark.parametrize("disable_fused_ops", [False, True])
def test_cohere2_greedy_equals_hf_generate(hf_model, disable_fused_ops):
    """Greedy tokens of the engine (CPU-packed weights and the screened greedy head, or the
    eager blocks) equal `generate` of transformers, past the window."""
    folder, ref = hf_model
    engine = Engine(
        model=str(folder), page_size=4, max_num_batched_tokens=16,
        disable_fused_ops=disable_fused_ops, **ENGINE,
    )  # fmt: skip
    prompts = random_prompts(128, [11, 20, 3], seed=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    for ids, out in zip(prompts, outs, strict=True):
        x = torch.tensor([ids])
        with torch.no_grad():  # an explicit mask: token 0 in a prompt is not padding
            want = ref.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8,
                do_sample=False, pad_token_id=0,
            )[0, len(ids):].tolist()  # fmt: skip
        assert out.token_ids == want


def test_cohere2_interleaved_rotary_is_permuted_half_rotary():
    """The load-time permutation's identity: half-split rotary of the permuted vector is the
    permuted interleaved rotary, for every position."""
    from swaserve.models.blocks import Rotary
    from swaserve.models.cohere2 import interleaved_to_half

    d = 16
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.arange(9)
    q = torch.randn(9, 2, d, generator=torch.Generator().manual_seed(0))
    ang = pos[:, None].float() * inv[None]
    cos = ang.cos().repeat_interleave(2, -1)[:, None]
    sin = ang.sin().repeat_interleave(2, -1)[:, None]
    rot = torch.stack([-q[..., 1::2], q[..., ::2]], dim=-1).flatten(-2)
    interleaved = q * cos + rot * sin
    perm = interleaved_to_half(d)
    half, _ = Rotary(inv)(pos, q[..., perm], q[..., perm])
    torch.testing.assert_close(half, interleaved[..., perm])


def test_cohere2_greedy_head_only_for_exact_scales():
    """The CPU greedy screen picks the raw head's argmax: it serves a positive power-of-two
    `logit_scale` only (others can tie or reverse the scaled logits' argmax)."""
    from swaserve.ops import greedy_head

    if not greedy_head.screen_available():
        pytest.skip("no AVX512-BF16 screen on this CPU")
    cfg = tiny_cohere2_config()
    with torch.device("meta"):
        from swaserve.models.cohere2 import Cohere2ForCausalLM

        model = Cohere2ForCausalLM(cfg)
    for scale in (0.3, -2.0, 0.0):
        model.logit_scale = scale
        assert greedy_head.greedy_head_for(model) is None, scale


def test_cohere2_tensor_parallel_equals_tp1(hf_model):
    """TP = 2 (gloo, 2 ranks): attention and MLP partial sums all-reduced once per layer
    together; greedy tokens, logprobs and every prompt position's logits equal TP = 1."""
    folder, _ = hf_model

    def reduces_once(two: Engine) -> None:
        layer = two.core.model.model.layers[0]
        assert layer._tp and not layer.self_attn.o_proj.reduce and not layer.mlp.down_proj.reduce

    kw = dict(model=str(folder), page_size=4, max_num_batched_tokens=16, **ENGINE)
    assert_tp2_equals_tp1(kw, max_tokens=10, check=reduces_once)


def test_cohere2_gguf_equals_its_weights(tmp_path, monkeypatch):
    """A tiny Cohere2 written as llama.cpp's `cohere2` GGUF (q/k rows as HF stores them, every
    4th layer full, LayerNorm eps and logit scale in the metadata) loads with the logits of
    the transformers model it came from."""
    gguf = pytest.importorskip("gguf")
    from swaserve.weights.builtin import builtin_gguf
    from swaserve.weights.gguf import read_metadata
    from tests.unit.test_gguf import SMOLLM, _write_tiny_gguf

    vocab = len(read_metadata(gguf.GGUFReader(builtin_gguf(SMOLLM)))["tokenizer.ggml.tokens"])
    pattern = ["sliding_attention"] * 3 + ["full_attention"]  # llama.cpp's fixed one
    cfg = tiny_cohere2_config(vocab_size=vocab, layer_types=pattern, logit_scale=0.25)
    ref = save_random_hf_model(cfg, tmp_path / "hf")
    ref.config.rms_norm_eps = 1e-6  # the writer's llama key; cohere2 reads the LayerNorm's
    extra = {"attention.layer_norm_epsilon": cfg.layer_norm_eps, "logit_scale": 0.25}
    _write_tiny_gguf(tmp_path / "tiny-cohere2.gguf", "cohere2", ref, SMOLLM, extra)
    monkeypatch.setenv("SWASERVE_CACHE", str(tmp_path / "cache"))
    engine = Engine(model=str(tmp_path / "tiny-cohere2.gguf"), page_size=4, **ENGINE)
    try:
        hf = engine.core.hf_config
        assert hf.architectures == ["Cohere2ForCausalLM"] and hf.logit_scale == 0.25
        assert hf.layer_types == ref.config.layer_types and hf.sliding_window == 5
        ids = engine.tokenizer("The capital of France is " * 3).input_ids  # past the window
        got = engine_prompt_logits(engine, ids)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        assert (got - want).abs().max().item() < 1e-4
    finally:
        engine.shutdown()
