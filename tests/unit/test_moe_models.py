"""MoE models (Qwen3-MoE, gpt-oss) on tiny random configs equal transformers in float32: prompt
logits through the engine's real path (chunked prefill, paged KV, windows shorter than the
prompt), greedy tokens against `generate`, and every checkpoint layout the loader maps: Qwen3-MoE
per expert (what transformers 5 writes) and fused, gpt-oss interleaved and MXFP4 (loaded by
transformers itself, dequantising, as the reference). Dummy weights build and run.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from swaserve import Engine, SamplingParams
from swaserve.weights.mxfp4 import dequantize_mxfp4, join_mxfp4
from tests.helpers import engine_prompt_logits, save_random_hf_model

TOL = 2e-3
VOCAB = 128
GATE_UP_GAIN = 20.0
# gpt-oss-20b's rope, scaled down (original context 4096 -> 64)
YARN = {
    "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 64, "rope_theta": 150000.0,
}  # fmt: skip


def _configs() -> dict:
    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    return {
        # layer 1 dense (mlp_only_layers), 0 and 2 sparse; 8 experts, top-2, renormalised
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common,
            num_hidden_layers=3,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
        # sliding (window 8) / full alternating, 4 experts, top-2; I = 32 for MXFP4 blocks
        "gpt_oss": transformers.GptOssConfig(
            **common,
            num_hidden_layers=4,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters=dict(YARN),
        ),
    }


def _engine(folder, **kw) -> Engine:
    return Engine(
        model=str(folder), dtype="float32", device="cpu", page_size=4,
        max_num_batched_tokens=16, kv_cache_gb=0.01, **kw,
    )  # fmt: skip


def _prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_logits(engine: Engine, ref, n: int = 40) -> None:
    ids = _prompt(n)
    got = engine_prompt_logits(engine, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    err = (got - want).abs().max().item()
    assert err < TOL, f"max |logit diff| {err}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, transformers model, engine) on the same random weights."""
    out = {}
    for name, cfg in _configs().items():
        folder = tmp_path_factory.mktemp(name)
        ref = save_random_hf_model(cfg, folder)
        if name == "gpt_oss":  # gate/up past the SwiGLU clamp (+-7) on part of the entries
            with torch.no_grad():
                for layer in ref.model.layers:
                    layer.mlp.experts.gate_up_proj.mul_(GATE_UP_GAIN)
            ref.save_pretrained(folder)
        out[name] = (folder, ref, _engine(folder))
    return out


@pytest.mark.parametrize("name", list(_configs()))
def test_prompt_logits_match_hf(models, name):
    _, ref, engine = models[name]
    _check_logits(engine, ref)
    engine.core.memory.check_integrity()


@pytest.mark.parametrize("name", list(_configs()))
def test_greedy_tokens_match_hf_generate(models, name):
    _, ref, engine = models[name]
    ids = _prompt(20, seed=2)  # longer than gpt-oss's window
    out = engine.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True))  # fmt: skip
    with torch.no_grad():
        want = ref.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=16, do_sample=False, pad_token_id=0,
        )[0, len(ids) :].tolist()  # fmt: skip
    assert out[0].token_ids == want


def _rewrite(src, dst, convert) -> None:
    """Copy a HF folder, its tensors passed through `convert(dict) -> dict`."""
    shutil.copytree(src, dst)
    tensors = convert(load_file(dst / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_qwen3_moe_checkpoint_layouts(models, tmp_path):
    """transformers writes one Linear per expert (the Hub's layout); the fused in-memory
    layout loads too; a missing expert tensor fails loudly."""
    folder, ref, _ = models["qwen3_moe"]
    keys = set(load_file(folder / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.1.mlp.gate_proj.weight" in keys  # the dense layer

    def fuse(sd: dict) -> dict:
        out = {}
        for layer in (0, 2):
            p = f"model.layers.{layer}.mlp.experts"
            gate, up, down = (
                [sd.pop(f"{p}.{e}.{w}_proj.weight") for e in range(8)]
                for w in ("gate", "up", "down")
            )
            out[f"{p}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
            out[f"{p}.down_proj"] = torch.stack(down)
        return {**sd, **out}

    _rewrite(folder, tmp_path / "fused", fuse)
    _check_logits(_engine(tmp_path / "fused"), ref)

    hole = "model.layers.2.mlp.experts.5.up_proj.weight"
    _rewrite(folder, tmp_path / "holed", lambda sd: {k: v for k, v in sd.items() if k != hole})
    with pytest.raises(ValueError, match=r"missing \['model.layers.2.mlp.w13'\]"):
        _engine(tmp_path / "holed")


def _pack_random_mxfp4(sd: dict, gen: torch.Generator) -> dict:
    """Replace the expert weights [E, in, out] by random MXFP4 blocks and scales, stored as
    the released gpt-oss checkpoints store them: [E, out, in/32, 16] and [E, out, in/32]."""
    out = {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, i, o = v.shape
            out[k + "_blocks"] = torch.randint(0, 256, (e, o, i // 32, 16), generator=gen).byte()
            # 2^-3..2^0 times e2m1 values (up to 6): some gate/up entries pass the clamp
            out[k + "_scales"] = torch.randint(124, 128, (e, o, i // 32), generator=gen).byte()
        else:
            out[k] = v
    return out


def test_gpt_oss_mxfp4_checkpoint(models, tmp_path):
    folder, _, _ = models["gpt_oss"]
    dst = tmp_path / "mxfp4"
    _rewrite(folder, dst, lambda sd: _pack_random_mxfp4(sd, torch.Generator().manual_seed(3)))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (dst / "config.json").write_text(json.dumps(cfg))
    # transformers dequantises on CPU, keeping the experts in bfloat16 whatever `dtype` says:
    # exact for MXFP4 values, so casting to float32 after loses nothing.
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(dst), dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    ).float().eval()  # fmt: skip
    _check_logits(_engine(dst), ref)


def test_mxfp4_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=gen).byte()
    scales = torch.randint(100, 140, (3, 10, 4), generator=gen).byte()
    scales[0, 0, :2] = torch.tensor([0, 254])  # extreme exponents
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2), want)


def test_join_mxfp4_pairs_in_any_order():
    blocks = torch.randint(0, 256, (2, 3, 1, 16)).byte()
    scales = torch.full((2, 3, 1), 127).byte()
    stream = [("a_scales", scales), ("x", torch.ones(1)), ("a_blocks", blocks)]
    out = dict(join_mxfp4([*stream, ("b_blocks", blocks)], torch.float32))
    assert set(out) == {"x", "a", "b_blocks"}  # a lone half passes through, for the loader
    assert torch.equal(out["a"], dequantize_mxfp4(blocks, scales, torch.float32))


@pytest.mark.parametrize("name", list(_configs()))
def test_dummy_load(name, tmp_path):
    cfg = _configs()[name]
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(tmp_path)
    engine = Engine(model=str(tmp_path), device="cpu", load_format="dummy", kv_cache_gb=0.01)
    out = engine.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True))  # fmt: skip
    assert len(out[0].token_ids) == 5
    mlp = engine.core.model.model.layers[0].mlp
    assert mlp.w13.std() > 0.01 and mlp.router.weight.std() > 0.01
    if mlp.b13 is not None:
        assert not mlp.b13.any() and not mlp.b2.any() and not mlp.router.bias.any()


def test_released_shapes_on_meta():
    """gpt-oss-20b's and Qwen3-30B-A3B's configs build with their published parameter counts."""
    from swaserve.models.registry import model_class

    gpt_oss = transformers.GptOssConfig(
        num_hidden_layers=24, num_local_experts=32, vocab_size=201088, hidden_size=2880,
        intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
    )  # fmt: skip
    qwen3_moe = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8,
    )  # fmt: skip
    for cfg, billions in ((gpt_oss, 20.91), (qwen3_moe, 30.53)):
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
        n = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(n - billions) < 0.01, (type(model).__name__, n)


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_fused_flag_routes_to_fused_moe(gpt_oss):
    """`fused` hands the same routing, biases, activation and limit to `ops.fused_moe` (on CPU
    its torch reference): equal to the eager path."""
    from swaserve.models.moe import SparseMoE

    torch.manual_seed(0)
    kw = (
        dict(scoring="topk_softmax", router_bias=True, expert_bias=True, activation="swigluoai",
             limit=0.5)
        if gpt_oss
        else dict(scoring="softmax_topk", renormalize=True)
    )  # fmt: skip
    moe = SparseMoE(64, 32, 6, 2, **kw)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(9, 64)
    eager = moe(x)
    moe.fused = True
    assert torch.allclose(moe(x), eager, atol=1e-5)
