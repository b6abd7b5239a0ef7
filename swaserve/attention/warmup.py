"""Compile the Triton attention kernel's launch variants at engine start, not in the first steps.

Triton compiles a kernel variant the first time a launch needs it: about 1-2 s each on the GPU
machine's host (sm_90a: Triton's passes plus ptxas). Decode CUDA graphs compile theirs at
capture; prefill chunks, mixed batches and eager decode steps compiled theirs inside the first
requests' steps (on the H200, a cold cache cost ~25 s of a timed run, 5,104 against 7,977
tok/s). `warm_up_attention` runs, once per kind of attention layer (heads, head size, window,
softcap, sinks), the launches of the step shapes the scheduler builds, through the backend's own
`prepare` and `forward`, so each variant is compiled exactly as a real step would compile it.

The variants compile in parallel first (Triton's AsyncCompileMode over a thread pool, the
launches in `compile_only` mode: its passes and ptxas run outside the GIL; 1.7x on two cores
here), then every launch runs once on the GPU, from the cache. Without that Triton API, or under
the interpreter, the launches compile one after the other as they run.

Every page table points at the NULL page alone: the K/V stores write page 0, which no query of
a real step ever reads (CUDA graph padding writes there too), and nothing else in the pool
changes. The attention outputs are discarded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import nn

from swaserve.attention.base import AttentionBackend, AttentionInputs
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.kv_pool import KVPool
from swaserve.models.blocks import Attention

log = logging.getLogger(__name__)

# (query_lens, context_lens) of the steps to warm, one attention launch (or two, for a mixed
# batch) per layer kind each. The tiles and paths they select are `paged_attention`'s; which
# variants realistic steps need is tested (tests/kernels/test_attention_warmup.py).
WARM_STEPS: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((256,), (0,)),  # a prompt chunk alone: the prefill tile, its own K/V read fresh
    ((1, 256), (4095, 0)),  # beside a decode: the chunk's keys from the cache, both split
    ((1, 256), (1023, 0)),  # beside a decode over fewer keys: the chunk unsplit
    ((1,) * 64 + (256,), (300,) * 64 + (0,)),  # beside many decodes: the decode tile unsplit
    ((1,), (4095,)),  # eager decode steps (above the graphs' batch sizes, or no graphs)
    ((1,) * 64, (300,) * 64),
) + tuple(
    step
    for q in (8, 16, 32)  # short prompts: the smaller tiles, and one query block (splits)
    for step in (
        ((q,), (0,)),  # alone: fresh
        ((q,), (4096 - q,)),  # over a long cached prefix (a prefix hit, a chunk's tail): split
        ((1, q), (4095, 0)),  # beside a decode: keys from the cache, unsplit
    )
)


def _act_dtype(attn: Attention) -> torch.dtype:
    """The dtype of the layer's activations: o_proj's weights', or its output's where the
    weights are quantised (ops/fp8_linear.Fp8Linear.out_dtype)."""
    return getattr(attn.o_proj, "out_dtype", None) or attn.o_proj.weight.dtype


def attention_kinds(model: nn.Module) -> list[Attention]:
    """The first attention layer of each kind that compiles to its own kernel variants."""
    kinds: dict[tuple, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            s = module.spec
            key = (s.num_heads, s.num_kv_heads, s.head_dim, bool(s.window), bool(s.softcap),
                   module.sinks is not None, _act_dtype(module))
            kinds.setdefault(key, module)
    return list(kinds.values())


def _parallel_compile() -> Callable | None:
    """Triton's AsyncCompileMode (3.4+; a private module), or None."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


@torch.inference_mode()
def warm_up_attention(
    model: nn.Module,
    backend: AttentionBackend,
    kv: KVPool,
    device: torch.device,
    steps: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = WARM_STEPS,
) -> tuple[int, float]:
    """Run `steps` through `backend` for every kind of `model`'s attention layers; returns
    (attention layer calls, seconds), and logs them."""
    start = time.perf_counter()
    kinds = attention_kinds(model)
    async_mode = _parallel_compile()
    if async_mode is not None:
        from swaserve.attention.kernels.paged_attention import compile_only

        workers = max(1, min(8, os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool, async_mode(pool), compile_only():
            _each_launch(kinds, backend, kv, device, steps)
    calls = _each_launch(kinds, backend, kv, device, steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    log.info("attention warm-up: %d layer kinds x %d step shapes in %.1f s",
             len(kinds), len(steps), seconds)
    return calls, seconds


def _each_launch(
    kinds: list[Attention],
    backend: AttentionBackend,
    kv: KVPool,
    device: torch.device,
    steps: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...],
) -> int:
    empty = torch.empty(0, dtype=torch.int64, device=device)
    calls = 0
    for query_lens, context_lens in steps:
        pages = -(-max(q + c for q, c in zip(query_lens, context_lens)) // backend.page_size)
        table = np.zeros((len(query_lens), pages), dtype=np.int32)  # the NULL page only
        inputs = AttentionInputs(
            list(query_lens), list(context_lens), arrays=[table] * backend.layout.num_groups
        )
        tokens = sum(query_lens)
        positions = torch.zeros(tokens, dtype=torch.int64, device=device)  # for the rotary
        fb = ForwardBatch(empty, positions, backend, backend.prepare(inputs), kv)
        for attn in kinds:
            s = attn.spec
            q_dim, kv_dim = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
            # q, k, v as the model has them: strided views of one projection output
            qkv = torch.zeros(tokens, q_dim + 2 * kv_dim, dtype=_act_dtype(attn),
                              device=device)
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
            backend.forward(
                q.view(tokens, s.num_heads, s.head_dim),
                k.view(tokens, s.num_kv_heads, s.head_dim),
                v.view(tokens, s.num_kv_heads, s.head_dim),
                s, attn.sinks, fb, prologue=attn.prologue(backend),
            )
            calls += 1
    return calls
