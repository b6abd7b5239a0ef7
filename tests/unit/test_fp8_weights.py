"""`--quantization fp8` (swaserve/ops/fp8_linear.py) against the scheme, on tiny random
checkpoints, float32 on the CPU:

    weights: e4m3 with one scale per output channel (max |row| -> 448), fixed at load;
    inputs:  e4m3 with one scale per token, each call;  y = s_x s_w (x8 . W8) [+ bias]

Two checks, since an activation within float32 noise of an e4m3 rounding boundary can round
the other way in any second implementation (one code, 12.5% of that element, then differs):
- each quantised projection, on the inputs it actually got inside the engine, equals the scheme
  computed here from transformers' unquantised weights (torch's own float8 cast, float64 sums)
  to float32 summation noise;
- end to end, the logits follow transformers' model with every projection computed by the
  scheme, within what such boundary cases move them, and differ from the unquantised model's.
Under tensor parallelism a row-parallel projection (o, down) is quantised per rank: each rank's
input slice and weight columns get their own scales, so the reference splits those the same way.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from swaserve.ops.fp8_linear import Fp8Linear
from tests.helpers import (
    engine_prompt_logits,
    random_hf_models,
    random_prompts,
)

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
)  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _configs() -> dict:
    t = transformers
    sliding = ["sliding_attention", "sliding_attention", "full_attention"]
    return {
        "llama": t.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False,
                               attention_bias=True),
        "qwen3": t.Qwen3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False),
        "gemma3": t.Gemma3TextConfig(**COMMON, num_hidden_layers=3, layer_types=sliding,
                                     sliding_window=5, query_pre_attn_scalar=16),
    }  # fmt: skip


def _e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `t` as (e4m3 values in float64, scales in float64): max |row| maps to 448, the
    scale and the division in float32, correctly rounded (the scheme's arithmetic)."""
    t = t.float()
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.tensor(448.0)
    q = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.double(), scale.double()


def _fp8_forward(lin: torch.nn.Linear, shards: int, x: torch.Tensor) -> torch.Tensor:
    """`lin` as --quantization fp8 computes it; `shards` > 1 quantises each of that many slices
    of the input features on its own and sums the partial products (row parallelism)."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = 0.0
    for xs, ws in zip(x.reshape(-1, k).chunk(shards, -1), lin.weight.chunk(shards, 1)):
        xq, sx = _e4m3(xs)
        wq, sw = _e4m3(ws)
        y = y + (xq @ wq.T) * sx * sw.T
    if lin.bias is not None:
        y = y + lin.bias.double()
    return y.to(x.dtype).reshape(*lead, -1)


def fp8_reference(model: torch.nn.Module, tp: int = 1) -> torch.nn.Module:
    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                lin = getattr(part, name, None)
                if lin is not None:
                    shards = tp if name in ROW_PARALLEL else 1
                    lin.forward = functools.partial(_fp8_forward, lin, shards)
    return model


def _assert_close_to_scheme(
    got: torch.Tensor, want: torch.Tensor, plain: torch.Tensor | None = None
) -> None:
    """Equal up to float32 noise, except where that noise moved an activation across an e4m3
    rounding boundary: the later positions then differ too (seen: mean 2.7e-5 and 1.8e-3, max
    2.7e-3 and 9.3e-2). Quantisation itself moves these logits by ~1e-2 on average (`plain`,
    the unquantised model's), so the end-to-end bound says the wiring is the scheme's; each
    projection's exactness is `_assert_projections_follow_the_scheme`'s."""
    err = (got - want).abs()
    assert err.mean().item() < 5e-3 and err.max().item() < 0.2, (err.mean(), err.max())
    if plain is not None:
        assert (got - plain).abs().mean().item() > 2e-3


def _original_weights(engine_layer, ref_layer) -> dict:
    """Fp8Linear of the engine's layer -> (weight, bias) of transformers' unquantised layer."""
    a, m, ra, rm = engine_layer.self_attn, engine_layer.mlp, ref_layer.self_attn, ref_layer.mlp

    def cat(*lins):
        biases = [lin.bias for lin in lins]
        return (torch.cat([lin.weight for lin in lins]),
                None if biases[0] is None else torch.cat(biases))  # fmt: skip

    return {
        a.qkv_proj: cat(ra.q_proj, ra.k_proj, ra.v_proj), a.o_proj: cat(ra.o_proj),
        m.gate_up_proj: cat(rm.gate_proj, rm.up_proj), m.down_proj: cat(rm.down_proj),
    }  # fmt: skip


def _assert_projections_follow_the_scheme(engine: Engine, ref: torch.nn.Module, ids: list[int]):
    """Every quantised projection's output, on the inputs it got in the engine's prefill, equals
    the scheme on transformers' weights to float32 summation noise (the codes are the same)."""
    model = engine.core.model
    originals: dict = {}
    for layer, ref_layer in zip(model.model.layers, ref.model.layers, strict=True):
        originals.update(_original_weights(layer, ref_layer))
    seen: list = []

    def record(module, args, out):
        seen.append((module, args[0].detach().clone(), out.detach().clone()))

    hooks = [m.register_forward_hook(record) for m in originals]
    try:
        engine_prompt_logits(engine, ids)
    finally:
        for h in hooks:
            h.remove()
    assert {m for m, _, _ in seen} == set(originals)  # every projection ran quantised
    for module, x, y in seen:
        weight, bias = originals[module]
        xq, sx = _e4m3(x.reshape(-1, x.shape[-1]))
        wq, sw = _e4m3(weight.detach())
        want = (xq @ wq.T) * sx * sw.T + (0.0 if bias is None else bias.detach().double())
        err = (y.reshape(want.shape).double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item() + 1e-6, (module, err)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return random_hf_models(_configs(), tmp_path_factory)


def _logits(ref: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", list(_configs()))
@pytest.mark.parametrize("packed", [False, True])
def test_fp8_logits_equal_the_schemes_reference(folders, name, packed):
    """A 40-token prompt past the window, chunked prefill over pages of 4: each projection
    follows the scheme exactly on its inputs, the logits follow transformers' model computing
    every projection by the scheme, and differ from the unquantised model's (the test sees fp8).
    `packed`: the CPU's default path, which packs the head (and would pack the projections:
    quantised ones stay as they are)."""
    folder, ref = folders[name]
    e = Engine(
        model=str(folder), device="cpu", dtype="float32", kv_cache_gb=0.01, page_size=4,
        max_num_batched_tokens=16, quantization="fp8", disable_fused_ops=not packed,
    )  # fmt: skip
    attn = e.core.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    ids = random_prompts(128, [40], seed=5)[0]
    got = engine_prompt_logits(e, ids)
    plain = _logits(ref, ids)
    import copy

    want = _logits(fp8_reference(copy.deepcopy(ref)), ids)
    _assert_close_to_scheme(got, want, plain)
    _assert_projections_follow_the_scheme(e, ref, ids)
    e.core.memory.check_integrity()


def test_fp8_tensor_parallel_quantises_each_rank_slice(folders):
    """TP = 2 (gloo): q/k/v and gate/up are cut by output channel (scales unchanged), o and down
    by input feature, each rank quantising its own slice; prompt logits equal the reference
    computing it so, and greedy tokens come out of both ranks' all-reduce."""
    import copy

    folder, ref = folders["llama"]
    two = Engine(model=str(folder), device="cpu", dtype="float32", kv_cache_gb=0.01,
                 page_size=4, max_num_batched_tokens=16, quantization="fp8",
                 tensor_parallel_size=2)  # fmt: skip
    try:
        o = two.core.model.model.layers[0].self_attn.o_proj
        assert isinstance(o, Fp8Linear) and o.tp is not None and o.reduce
        ids = random_prompts(128, [40], seed=5)[0]
        want = _logits(fp8_reference(copy.deepcopy(ref), tp=2), ids)
        _assert_close_to_scheme(engine_prompt_logits(two, ids), want)
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        out = two.generate(prompt_token_ids=random_prompts(128, [9, 17]), sampling_params=params)
        assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
        two.core.memory.check_integrity()
    finally:
        two.core.shutdown()


def test_fp8_bad_flag_values():
    from swaserve.config import EngineConfig

    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
