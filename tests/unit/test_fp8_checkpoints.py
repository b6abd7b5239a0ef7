"""Checkpoints already in FP8 (swaserve/weights/fp8_checkpoint.py), written here from tiny random
transformers models: the projections' weights replaced in the safetensors by e4m3 codes and
scales in each format, config.json given the format's quantization_config. Float32 on the CPU.

The engine infers `quantization` from config.json and its Fp8Linear modules hold, per output
row, codes and scales that are the file's (per channel, per tensor: exactly, the scale
broadcast to rows) or the float32 dequantised blocks requantised per row (block-wise). Each
projection then follows the scheme on those codes with its input quantised per token, and the
logits follow transformers' model computing every converted projection so (tests/unit/
test_fp8_weights.py's checks, whose tolerances this reuses). Under tensor parallelism (2 ranks)
every rank holds its cut of those codes and scales, and the logits follow the reference that
quantises each row-parallel input slice on its own.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from swaserve import Engine, SamplingParams
from swaserve.ops.fp8_linear import Fp8Linear
from tests.helpers import (
    engine_prompt_logits,
    random_hf_models,
    random_prompts,
)
from tests.unit.test_fp8_weights import (
    COMMON,
    PROJECTIONS,
    ROW_PARALLEL,
    _assert_close_to_scheme,
    _e4m3,
)

E4M3 = torch.float8_e4m3fn
BLOCK = (32, 48)  # not the usual 128 x 128: several blocks a row, partial ones at the edges

_CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
_TENSOR = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}


def _compressed_tensors(weights: dict, static_inputs: bool) -> dict:
    inputs = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": "tensor" if static_inputs else "token",
        "dynamic": not static_inputs,
    }
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": inputs}},
    }  # fmt: skip


# name -> (model, weight scales, quantization_config, module prefixes kept in float32)
CASES = {
    "llama_channel": ("llama", "channel", _compressed_tensors(_CHANNEL, False), ()),
    "llama_tensor": ("llama", "tensor", _compressed_tensors(_TENSOR, True), ()),
    "llama_block": (
        "llama",
        "block",
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK),
            "modules_to_not_convert": ["lm_head", "model.layers.1.mlp"],
        },
        ("model.layers.1.mlp.",),
    ),  # fmt: skip
    "qwen3_channel": ("qwen3", "channel", _compressed_tensors(_CHANNEL, False), ()),
}


def _configs() -> dict:
    t = transformers
    return {
        "llama": t.LlamaConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False,
                               attention_bias=True),
        "qwen3": t.Qwen3Config(**COMMON, num_hidden_layers=2, tie_word_embeddings=False),
        # one KV head: replicated on both ranks under TP 2
        "llama_kv1": t.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, num_hidden_layers=2,
                                   tie_word_embeddings=False, attention_bias=True),
    }  # fmt: skip


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(E4M3)


def _quantize(w: torch.Tensor, kind: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(the file's tensors of the module by leaf name, then the codes and row scales [out, 1]
    the engine must hold, both float64) for the float32 weight `w` in format `kind`."""
    out, k = w.shape
    if kind == "channel":  # compressed-tensors per channel: weight_scale [out, 1] float32
        s = w.abs().amax(1, keepdim=True) / torch.tensor(448.0)
        q = _codes(w, s)
        return {"weight": q, "weight_scale": s}, q.double(), s.double()
    if kind == "tensor":  # per tensor, bfloat16 scale [1] (as RedHatAI's), static input scale
        s = (w.abs().amax() / torch.tensor(448.0)).to(torch.bfloat16).reshape(1)
        q = _codes(w, s.float())
        files = {"weight": q, "weight_scale": s, "input_scale": torch.tensor([0.05])}
        return files, q.double(), s.double().expand(out, 1)
    # fine-grained: weight_scale_inv per BLOCK, the last blocks partial; the engine's codes are
    # the dequantised float32 weight requantised per row
    b0, b1 = BLOCK
    grid = torch.zeros(-(-out // b0), -(-k // b1))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].abs().amax() / 448.0
    full = grid.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :k]
    q = _codes(w, full)
    rows, srow = _e4m3(q.float() * full)
    return {"weight": q, "weight_scale_inv": grid}, rows, srow


def _write_fp8(src, dst, case: str) -> dict:
    """The checkpoint in `src` as FP8 in `dst`; returns projection module name -> (codes, row
    scales) the engine must hold."""
    _, kind, qc, kept = CASES[case]
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    expected = {}
    for name in list(tensors):
        module, _, leaf = name.rpartition(".")
        is_proj = leaf == "weight" and module.rpartition(".")[2] in PROJECTIONS
        if not is_proj or module.startswith(kept):
            continue
        files, q, s = _quantize(tensors[name].float(), kind)
        tensors.update({f"{module}.{k}": v.contiguous() for k, v in files.items()})
        expected[module] = (q, s)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return expected


def _rows_forward(codes, scales, bias, x: torch.Tensor, shards: int = 1) -> torch.Tensor:
    """The scheme on given codes and row scales: inputs e4m3 per token, float64 sums; `shards`
    > 1: row parallelism, each slice of the input features quantised per token on its own
    against the same columns of the codes, the whole row's scale applied to every part."""
    lead, k = x.shape[:-1], x.shape[-1]
    y = 0.0
    for xs, cs in zip(x.reshape(-1, k).chunk(shards, -1), codes.chunk(shards, 1), strict=True):
        xq, sx = _e4m3(xs)
        y = y + (xq @ cs.T) * sx * scales.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*lead, -1)


def _reference(ref: torch.nn.Module, expected: dict, tp: int = 1) -> torch.nn.Module:
    ref = copy.deepcopy(ref)
    for name, (q, s) in expected.items():
        lin = ref.get_submodule(name)
        shards = tp if name.rpartition(".")[2] in ROW_PARALLEL else 1
        lin.forward = functools.partial(_rows_forward, q, s, lin.bias, shards=shards)
    return ref


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return random_hf_models(_configs(), tmp_path_factory)


def _engine(folder, **kw) -> Engine:
    return Engine(model=str(folder), device="cpu", dtype="float32", kv_cache_gb=0.01,
                  page_size=4, max_num_batched_tokens=16, **kw)  # fmt: skip


def _engine_modules(model, expected: dict) -> dict:
    """Fp8Linear of the engine -> (codes, row scales) it must hold, merged as it merges."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        groups = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
                  "self_attn.o_proj": ("o_proj",), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
                  "mlp.down_proj": ("down_proj",)}  # fmt: skip
        for attr, parts in groups.items():
            block, leaf = attr.split(".")
            names = [f"{p}{block}.{part}" for part in parts]
            module = getattr(layer.get_submodule(block), leaf, None)
            if names[0] not in expected:
                assert not isinstance(module, Fp8Linear), names  # kept in float32
                continue
            assert isinstance(module, Fp8Linear), names
            out[module] = (torch.cat([expected[n][0] for n in names]),
                           torch.cat([expected[n][1] for n in names]))  # fmt: skip
    return out


def _assert_holds(module: Fp8Linear, q: torch.Tensor, s: torch.Tensor) -> None:
    """`module` holds the codes `q` and row scales `s` [out, 1], bit for bit."""
    assert module.weight.dtype == E4M3
    assert torch.equal(module.weight.view(torch.uint8), q.to(E4M3).view(torch.uint8))
    assert torch.equal(module.weight_scale.double().reshape(-1, 1), s)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_checkpoint_loads_into_fp8_linears(folders, tmp_path, case):
    """quantization inferred; codes and row scales as the file says (exact, or the block
    requantisation); every projection follows the scheme on them, the logits follow the
    reference; lm_head and the modules kept out stay float32."""
    folder, ref = folders[CASES[case][0]]
    expected = _write_fp8(folder, tmp_path / "fp8", case)
    e = _engine(tmp_path / "fp8")
    assert e.core.config.quantization == "fp8" and e.core.fp8_checkpoint
    model = e.core.model
    assert not isinstance(model.lm_head, Fp8Linear)
    modules = _engine_modules(model, expected)
    assert len(modules) == 4 * 2 - (2 if CASES[case][3] else 0)
    for module, (q, s) in modules.items():
        _assert_holds(module, q, s)
    ids = random_prompts(128, [40], seed=5)[0]
    seen: list = []
    hooks = [m.register_forward_hook(lambda m, a, y: seen.append((m, a[0].clone(), y.clone())))
             for m in modules]  # fmt: skip
    try:
        got = engine_prompt_logits(e, ids)
    finally:
        for h in hooks:
            h.remove()
    assert {m for m, _, _ in seen} == set(modules)
    for module, x, y in seen:  # each projection: the scheme on its inputs, float32 noise
        q, s = modules[module]
        want = _rows_forward(q, s, module.bias, x.double())
        err = (y.double() - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item() + 1e-6, (module, err)
    with torch.no_grad():
        want = _reference(ref, expected)(torch.tensor([ids])).logits[0]
    _assert_close_to_scheme(got, want)
    e.core.memory.check_integrity()


def _with_config(folders, tmp_path, qc: dict):
    dst = tmp_path / "ckpt"
    shutil.copytree(folders["llama"][0], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_unsupported_quant_method_is_named(folders, tmp_path, method):
    folder = _with_config(folders, tmp_path, {"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match=f"quant_method '{method}'.*'fp8'.*compressed-tensors"):
        _engine(folder)


def test_compressed_tensors_int8_is_refused(folders, tmp_path):
    weights = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    folder = _with_config(folders, tmp_path, _compressed_tensors(weights, False))
    with pytest.raises(ValueError, match="8-bit int weights, not 8-bit float"):
        _engine(folder)


def test_conflicting_quantization_flag(folders, tmp_path):
    folder = tmp_path / "fp8"
    _write_fp8(folders["llama"][0], folder, "llama_channel")
    with pytest.raises(ValueError, match="--quantization fp8 conflicts.*'compressed-tensors'"):
        _engine(folder, quantization="fp8")
    with pytest.raises(ValueError, match="--quantization compressed-tensors needs a checkpoint"):
        _engine(folders["llama"][0], quantization="compressed-tensors")


def _rank_share(expected: dict, hf, rank: int, size: int) -> dict:
    """`expected` (the single process's codes and row scales per projection) as rank `rank` of
    `size` must hold it, the plan of swaserve/distributed/layers.py written out: q, gate and up
    its rows (codes and scales); k and v its KV heads' rows, or the one KV head its query heads
    read when there are fewer than ranks (replicated); o and down its columns of every row, and
    the whole scale vector (a row's scale covers all its columns)."""
    d, kv = hf.head_dim, hf.num_key_value_heads
    out = {}
    for name, (q, s) in expected.items():
        leaf = name.rpartition(".")[2]
        if leaf in ROW_PARALLEL:
            n = q.shape[1] // size
            out[name] = (q[:, rank * n : (rank + 1) * n], s)
            continue
        if leaf in ("k_proj", "v_proj") and kv < size:
            head = rank * kv // size
            lo, hi = head * d, (head + 1) * d
        else:
            n = q.shape[0] // size
            lo, hi = rank * n, (rank + 1) * n
        out[name] = (q[lo:hi], s[lo:hi])
    return out


@pytest.mark.parametrize("model", ["llama", "llama_kv1"])
@pytest.mark.parametrize("case", ["llama_channel", "llama_block"])
def test_fp8_checkpoint_tensor_parallel_shards(folders, tmp_path, case, model):
    """Every rank of TP 2 (planned and loaded without processes) holds its cut of the codes and
    row scales one process holds (`expected`, test_fp8_checkpoint_loads_into_fp8_linears): a
    block-scaled row is requantised whole, then cut, so nothing depends on the rank count.
    Row-parallel modules keep the group (bias on rank 0, all-reduce); one KV head is
    replicated."""
    from swaserve.distributed.parallel_state import TPGroup
    from swaserve.weights.loader import build_model, load_hf_config

    folder = tmp_path / "fp8"
    expected = _write_fp8(folders[model][0], folder, case)
    hf = load_hf_config(folder)
    for rank in range(2):
        tp = TPGroup.layout_only(rank, 2)
        m = build_model(hf, folder, torch.float32, torch.device("cpu"), False, 0, tp)
        modules = _engine_modules(m, _rank_share(expected, hf, rank, 2))
        assert len(modules) == 4 * 2 - (2 if CASES[case][3] else 0)
        for module, (q, s) in modules.items():
            _assert_holds(module, q, s)
        for layer in m.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module, row_parallel in ((attn.qkv_proj, False), (attn.o_proj, True),
                                         (getattr(mlp, "gate_up_proj", None), False),
                                         (mlp.down_proj, True)):  # fmt: skip
                if module in modules:
                    assert (module.tp is tp and module.reduce) if row_parallel else not module.tp


# TP 2 against TP 1 on an FP8 checkpoint: the weights are the same (the tests check), but the
# row-parallel projections' inputs are quantised per rank's slice, not per whole row (as under
# `--quantization fp8`). That moves these tiny models' logits by up to DRIFT (measured: 0.043
# and 0.033 on the 40-token prompt), while their top-2 margins are mostly under 0.1 (logits of
# std 0.3 over 128 tokens): free-running greedy sequences would part at the first near-tie, so
# TP 2's tokens are compared with TP 1 teacher-forced on TP 2's own sequence. Where every logit
# moves by less than DRIFT, TP 2's argmax trails TP 1's best by less than 2 DRIFT (so it is TP 1's
# argmax wherever TP 1's top-2 margin exceeds 2 DRIFT: the stable positions), and a token's
# logprob moves by less than 2 DRIFT.
DRIFT = 0.1


@pytest.mark.parametrize("case, model", [("llama_channel", "llama"), ("llama_block", "llama_kv1")])
def test_fp8_checkpoint_tensor_parallel_follows_the_scheme(folders, tmp_path, case, model):
    """TP 2 (gloo) on an FP8 checkpoint: rank 0's codes and row scales are its cut of the
    file's rows (one column- and one row-parallel projection). The prompt logits equal, within
    1e-4, the reference computing each row-parallel projection as two ranks do (each input
    slice quantised per token on its own, the whole row's scale), and are within DRIFT of
    TP 1's (not equal: TP 1 quantises each whole input row with one scale).
    Greedy decoding on TP 2, against TP 1 teacher-forced on its tokens (the comment above
    DRIFT): each token within 2 DRIFT of TP 1's best and its logprob within 2 DRIFT of TP 1's;
    nearly all of them TP 1's argmax (seen: 35 of 36 in each case, the other a tie to 8e-4)."""
    folder = tmp_path / "fp8"
    ref = folders[model][1]
    expected = _write_fp8(folders[model][0], folder, case)
    one = _engine(folder, disable_fused_ops=True)
    two = _engine(folder, tensor_parallel_size=2)
    try:
        assert two.core.fp8_checkpoint
        mine = _engine_modules(two.core.model, _rank_share(expected, two.core.hf_config, 0, 2))
        layer = two.core.model.model.layers[0]
        for module in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            _assert_holds(module, *mine[module])
        ids = random_prompts(128, [40], seed=3)[0]
        got = engine_prompt_logits(two, ids)
        with torch.no_grad():
            want = _reference(ref, expected, tp=2)(torch.tensor([ids])).logits[0]
        # float32 noise (seen: 3e-7): no activation of these seeds sits that near an e4m3
        # rounding boundary (`_assert_close_to_scheme` is the bound where one would). Online
        # quantisation on rank 1 of the block the file keeps unquantised moved them by 1e-2.
        assert (got - want).abs().max().item() < 1e-4
        assert (got - engine_prompt_logits(one, ids)).abs().max().item() < DRIFT
        prompts = random_prompts(128, [37, 9, 23], seed=5)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
        outs = two.generate(prompt_token_ids=prompts, sampling_params=params)
        agree = total = 0
        for prompt, out in zip(prompts, outs, strict=True):
            gen = out.outputs[0].token_ids
            assert len(gen) == 12
            # TP 1's log-probabilities at the positions that chose each generated token
            lp = torch.log_softmax(engine_prompt_logits(one, prompt + gen[:-1]).double(), -1)
            lp = lp[len(prompt) - 1 :]
            for i, (token, mine_lp) in enumerate(zip(gen, out.outputs[0].logprobs, strict=True)):
                assert lp[i].max().item() - lp[i, token].item() < 2 * DRIFT, (prompt, i)
                assert abs(mine_lp.logprob - lp[i, token].item()) < 2 * DRIFT, (prompt, i)
                agree += token == lp[i].argmax().item()
                total += 1
        assert agree >= 0.9 * total, (agree, total)
        two.core.memory.check_integrity()
    finally:
        two.core.shutdown()
