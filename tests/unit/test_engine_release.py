"""A dropped Engine frees its KV pool by reference counting alone.

Each engine start moves the objects alive into the collector's frozen generation
(swaserve/engine/gc_heap.py), which is never collected: a reference cycle among an engine's
objects keeps them, and its KV pool, for the life of the process. The prefix cache registered
its own bound methods with the memory manager it holds, so `del llm` kept the pool (68.7 GiB
on the H200: tests/gpu/test_memory_profile.py's second engine found no memory left)."""

from __future__ import annotations

import gc
import weakref

import pytest
import transformers

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=1024,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("release")
    save_random_hf_model(cfg, path)
    return str(path)


@pytest.mark.parametrize(
    "extra",
    [{}, {"disable_prefix_cache": True}, {"host_cache_gb": 0.01},
     {"speculative_algorithm": "ngram"}],
    ids=["default", "no-prefix-cache", "host-tier", "ngram"],
)  # fmt: skip
def test_a_dropped_engine_frees_its_kv_pool(folder, extra):
    eng = Engine(model=folder, device="cpu", dtype="float32", kv_cache_gb=0.01, **extra)
    repeat = [5, 6, 7, 8] * 12  # the n-gram drafter finds drafts in it
    out = eng.generate(prompt_token_ids=[repeat, repeat[:20]],
                       sampling_params=SamplingParams(max_tokens=8, temperature=0))  # fmt: skip
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
    refs = {"engine": weakref.ref(eng), "core": weakref.ref(eng.core),
            "kv pool": weakref.ref(eng.core.kv), "pages": weakref.ref(eng.core.kv.pages),
            "memory": weakref.ref(eng.core.memory)}  # fmt: skip
    gc.disable()  # reference counting only: a cycle would survive in the frozen generation
    try:
        del eng, out
        alive = [name for name, ref in refs.items() if ref() is not None]
    finally:
        gc.enable()
    assert not alive, f"kept after the engine was dropped: {alive}"


def _start(folder):
    return Engine(model=folder, device="cpu", dtype="float32", kv_cache_gb=0.01)


def test_shutdown_frees_what_a_cycle_would_keep(folder):
    """A cycle planted among an engine's start-up objects survives `del` and `gc.collect()`
    (the frozen generation); `shutdown()`, here through a `with` block, frees it."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    kept = _start(folder)
    kept.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=greedy)
    kept_pool = weakref.ref(kept.core.kv)
    kept.core.kv.planted_cycle = kept.core
    del kept
    gc.collect()
    assert kept_pool() is not None, "the planted cycle was collected: the test shows nothing"

    with _start(folder) as eng:
        out = eng.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=greedy)
        assert len(out[0].outputs[0].token_ids) == 4
        pool = weakref.ref(eng.core.kv)
        eng.core.kv.planted_cycle = eng.core
    assert pool() is None and kept_pool() is None  # both: the release collects the whole heap
    with pytest.raises(RuntimeError, match="was shut down"):
        eng.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=greedy)
    with pytest.raises(RuntimeError, match="was shut down"):
        eng.memory_stats()
    eng.shutdown()  # a second one does nothing
