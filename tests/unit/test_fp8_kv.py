"""FP8 KV cache on the real Gemma 3 270M: twice the tokens per byte, and greedy output that
mostly matches the unquantised cache (the rate is reported; the GPU run records it too)."""

from __future__ import annotations

import torch

from swaserve import Engine, SamplingParams

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at",
    "List three primary colors:", "The quick brown fox", "In 1492,", "My favourite food is",
]


def test_fp8_kv_capacity_and_greedy_match(gemma_engine):
    fp8 = Engine(model="gemma-3-270m", device="cpu", kv_cache_gb=1, kv_cache_dtype="fp8_e4m3")
    assert fp8.core.kv.kv.dtype == torch.float8_e4m3fn
    # Same byte budget: fp8 pages are a quarter of float32 pages, half of bf16 ones.
    ratio = fp8.memory_stats()["pages_total"] / gemma_engine.memory_stats()["pages_total"]
    assert ratio >= 3.8, ratio
    p = SamplingParams(max_tokens=32, temperature=0)
    want = [o.token_ids for o in gemma_engine.generate(PROMPTS, p)]
    got = [o.token_ids for o in fp8.generate(PROMPTS, p)]
    same = sum(a == b for a, b in zip(want, got))
    print(f"fp8 KV: {same}/{len(PROMPTS)} prompts identical for 32 greedy tokens")
    assert same >= len(PROMPTS) // 2
    fp8.core.memory.check_integrity()
