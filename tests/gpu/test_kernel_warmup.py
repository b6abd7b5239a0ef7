"""GPU only (skipped elsewhere): after an engine's start (its attention warm-up,
swaserve/attention/warmup.py), steps of realistic shapes compile no new attention kernel
variant: prefill chunks alone and over prefix hits, mixed batches, eager decode steps above
the graphs' batch sizes, with bf16 and fp8 KV, on a model with full and sliding layers."""

from __future__ import annotations

import random

import pytest
import torch

import swaserve.attention.kernels.paged_attention as pa
from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model, tiny_gemma3_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _compiled() -> int:
    """Attention kernel variants compiled in this process (Triton's per-device caches)."""
    return sum(
        len(caches[0])
        for kernel in (pa._paged_attn_kernel, pa._reduce_splits)
        for caches in kernel.device_caches.values()
    )


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    save_random_hf_model(tiny_gemma3_config(max_position_embeddings=8192), folder)
    return str(folder)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(1500)]  # prefix hits far past the window
    prompts = [shared + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))]
               for _ in range(4)]
    prompts += [[rng.randrange(3, 250) for _ in range(rng.randrange(5, 3000))]
                for _ in range(40)]
    return prompts


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_no_attention_compile_after_start(gemma, kv_cache_dtype):
    e = Engine(model=gemma, kv_cache_gb=0.5, page_size=16, max_num_batched_tokens=1024,
               cuda_graph_max_bs=8, kv_cache_dtype=kv_cache_dtype)
    after_start = _compiled()
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = e.generate(prompt_token_ids=_prompts(), sampling_params=p, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert _compiled() == after_start, "a step compiled an attention variant the warm-up missed"
    e.core.shutdown()
