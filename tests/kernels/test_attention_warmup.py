"""The start-up attention warm-up (swaserve/attention/warmup.py): the kernel variants it compiles
cover those of realistic steps, and running it leaves the pool as it was but for the NULL page.

Variants are read from the launches themselves: the three Triton kernels of
`paged_attention.py` are replaced by recorders of their compile-time arguments (the same
recorder sees the warm-up's launches and the realistic steps'), so no kernel runs in the first
test; the second runs the real kernels under the interpreter.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

pytest.importorskip("triton")

import swaserve.attention.kernels.paged_attention as pa  # noqa: E402
from swaserve.attention.triton_backend import TritonBackend  # noqa: E402
from swaserve.attention.warmup import (  # noqa: E402
    WARM_STEPS,
    _each_launch,
    attention_kinds,
    warm_up_attention,
)
from swaserve.memory.groups import build_layout  # noqa: E402
from swaserve.memory.kv_pool import KVPool  # noqa: E402
from swaserve.models.blocks import Attention, AttentionSpec, Rotary  # noqa: E402

CPU = torch.device("cpu")
PAGE = 16
# full, window 512 (its decodes split), window 128 with sinks (gpt-oss-like: never split), and
# a second full layer (same kind as the first)
WINDOWS = [None, 512, 128, None]


def _model(dtype: torch.dtype, heads: int = 8, kv_heads: int = 2, head_dim: int = 16) -> nn.Module:
    layers = nn.ModuleList()
    for i, w in enumerate(WINDOWS):
        spec = AttentionSpec(i, heads, kv_heads, head_dim, head_dim**-0.5, window=w)
        rotary = Rotary(torch.ones(head_dim // 2))
        layers.append(Attention(spec, 32, rotary, sinks=w == 128))
    return layers.to(dtype)


def _engine_parts(kv_dtype: torch.dtype, num_pages: int = 8):
    layout = build_layout(WINDOWS)
    backend = TritonBackend(layout, PAGE, CPU)
    kv = KVPool(layout, num_pages, PAGE, 2, 16, kv_dtype, CPU)
    return backend, kv


class _Recorder:
    """Stands in for a `triton.jit` kernel: records each launch's compile-time arguments."""

    def __init__(self, name: str, seen: set) -> None:
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.add((self.name, tuple(sorted(kwargs.items()))))

        return launch


def _variants(monkeypatch, kinds, backend, kv, steps) -> set:
    seen: set = set()
    for name in ("_paged_attn_kernel", "_reduce_splits", "_store_kv_kernel"):
        monkeypatch.setattr(pa, name, _Recorder(name, seen))
    _each_launch(kinds, backend, kv, CPU, steps)
    return seen


def _realistic_steps(seed: int = 0, n: int = 90) -> list:
    """Decode-only steps of 1 to 600 requests; prompt chunks of 5 to 2,048 tokens over no or
    a long cached prefix, alone and beside decodes; contexts up to 8k. (Chunks of 2 to 4 tokens
    are left out: their tiles compile on first use.)"""
    rng = random.Random(seed)
    steps = []
    for i in range(n):
        kind = i % 3  # 0: decodes only, 1: chunks only, 2: both
        qlens, ctxs = [], []
        if kind != 1:
            b = rng.choice([1, 2, 8, 64, 300, 600]) if kind == 0 else rng.randint(1, 400)
            qlens += [1] * b
            ctxs += [rng.randint(1, 8000) for _ in range(b)]
        if kind != 0:
            for _ in range(rng.randint(1, 3)):
                qlens.append(rng.choice([rng.randint(5, 32), rng.randint(33, 2048)]))
                ctxs.append(rng.choice([0, rng.randint(1, 6000)]))
        steps.append((tuple(qlens), tuple(ctxs)))
    return steps


@pytest.mark.parametrize("heads", [4, 8, 16])  # GQA groups of 2 (Gemma 3), 4 (Llama), 8
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_warm_up_compiles_every_variant_of_realistic_steps(monkeypatch, kv_dtype, heads):
    model = _model(torch.bfloat16, heads=heads)
    kinds = attention_kinds(model)
    assert [a.spec.layer_id for a in kinds] == [0, 1, 2]  # layer 3 is layer 0's kind
    backend, kv = _engine_parts(kv_dtype)
    warmed = _variants(monkeypatch, kinds, backend, kv, WARM_STEPS)
    real = _variants(monkeypatch, kinds, backend, kv, _realistic_steps())
    missing = real - warmed
    assert not missing, sorted(missing)[:3]
    # both decode paths (split over keys and not) and both prefill paths (fresh, cached keys)
    attn = [dict(kw) for name, kw in real if name == "_paged_attn_kernel"]
    assert {(kw["SPLIT_KV"], kw["FRESH_NEW"]) for kw in attn if kw["BLOCK_M"] == 16}
    assert any(kw["SPLIT_KV"] for kw in attn) and any(not kw["SPLIT_KV"] for kw in attn)
    if kv_dtype == torch.bfloat16:
        big = {kw["FRESH_NEW"] for kw in attn if kw["BLOCK_M"] == 128}
        assert big == {True, False}


def test_warm_up_runs_and_leaves_the_pool_but_the_null_page():
    model = _model(torch.float32)
    backend, kv = _engine_parts(torch.float32)
    torch.manual_seed(0)
    kv.kv.copy_(torch.randn(kv.kv.shape))
    before = kv.kv.clone()
    steps = (((8,), (0,)), ((8,), (24,)), ((1, 8), (40, 0)), ((1,), (40,)))
    calls, seconds = warm_up_attention(model, backend, kv, CPU, steps=steps)
    assert calls == len(steps) * len(attention_kinds(model))
    assert seconds >= 0
    assert torch.equal(kv.kv[:, :, 1:], before[:, :, 1:])  # pages past the NULL page 0
    assert not torch.equal(kv.kv[:, :, 0], before[:, :, 0])  # the K/V stores went there
