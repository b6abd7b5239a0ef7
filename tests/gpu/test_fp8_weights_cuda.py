"""GPU only (skipped elsewhere; FP8 GEMMs need sm89+): `--quantization fp8` on CUDA.

- One Fp8Linear on CUDA (`_scaled_mm`, row-wise scales, bf16 out) equals the same module on
  the CPU (float32 out) within one bf16 rounding, odd row counts and a bias included;
- a tiny bf16 model with fp8 weights: graph decode equals eager decode, and its prompt logits
  follow the scheme's float32 reference (tests/unit/test_fp8_weights.py) within bf16 noise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from swaserve.ops.fp8_linear import Fp8Linear
from tests.helpers import engine_prompt_logits, random_prompts, save_random_hf_model
from tests.unit.test_fp8_weights import COMMON, fp8_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 tensor cores (sm89+)",
    ),
]


@pytest.mark.parametrize("rows", [1, 3, 64, 517])
def test_fp8_linear_cuda_equals_cpu(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(4096, 1024, generator=gen), torch.randn(4096, generator=gen)
    x = torch.randn(rows, 1024, generator=gen).bfloat16()
    cpu = Fp8Linear(w, b, torch.float32)
    cuda = Fp8Linear(w.cuda(), b.cuda(), torch.bfloat16)
    assert torch.equal(cuda.weight.cpu().view(torch.uint8), cpu.weight.view(torch.uint8))
    want = cpu(x.float())
    got = cuda(x.cuda()).float().cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, 4096)
    # The CUDA module keeps its bias in bf16 and rounds its output to bf16, and Hopper's FP8
    # tensor cores accumulate a dot product with fewer bits than float32 (the CPU side sums
    # exact products in float32). So within a few bf16 roundings of the bias, the product and
    # the result, plus 2^-12 of the dot product's absolute terms (H200, 2026-12-06: errors up to
    # 0.005 on outputs near 0 whose 1,024 terms summed to ~650 in magnitude)
    terms = want.abs() + b.abs() + (want - b).abs()
    mag = x.float().abs() @ w.abs().T
    assert ((got - want).abs() <= terms * 2**-7 + mag * 2**-12 + 1e-3).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_fp8")
    cfg = transformers.LlamaConfig(**COMMON, num_hidden_layers=3, tie_word_embeddings=False)
    return folder, save_random_hf_model(cfg, folder)


def test_fp8_graph_decode_equals_eager_and_follows_the_scheme(tiny):
    folder, ref = tiny
    prompts = random_prompts(128, [5, 40, 17])
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    toks = {}
    for bs in (0, 8):
        e = Engine(model=str(folder), dtype="bfloat16", kv_cache_gb=0.05, quantization="fp8",
                   cuda_graph_max_bs=bs)  # fmt: skip
        assert isinstance(e.core.model.model.layers[0].mlp.down_proj, Fp8Linear)
        toks[bs] = [o.outputs[0].token_ids for o in e.generate(prompt_token_ids=prompts,
                                                               sampling_params=p)]
        e.core.memory.check_integrity()
    assert toks[0] == toks[8]
    ids = random_prompts(128, [40], seed=5)[0]
    got = engine_prompt_logits(e, ids).float().cpu()
    with torch.no_grad():
        want = fp8_reference(copy.deepcopy(ref))(torch.tensor([ids])).logits[0]
    err = (got - want).abs()
    assert err.mean().item() < 3e-2 and err.max().item() < 0.25, (err.mean(), err.max())
