"""An engine freezes its start-up heap for the garbage collector (swaserve/engine/gc_heap.py):
full collections in the step loop then skip it; an engine dropped later is still freed (it
holds no reference cycles), and a second engine in the process only freezes what is new."""

from __future__ import annotations

import gc
import weakref

import pytest

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model, tiny_gemma3_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = tiny_gemma3_config(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             query_pre_attn_scalar=8, sliding_window=4,
                             layer_types=["sliding_attention", "full_attention"],
                             max_position_embeddings=256, eos_token_id=1)
    out = tmp_path_factory.mktemp("tiny_gc")
    save_random_hf_model(cfg, out)
    return str(out)


def test_startup_heap_frozen_and_dropped_engines_freed(folder):
    first = Engine(model=folder, device="cpu", kv_cache_gb=0.001)
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # torch, the model, the engine: out of every collection
    ref = weakref.ref(first)
    del first  # frozen, but freed by reference counting: no cycle keeps an engine
    assert ref() is None
    second = Engine(model=folder, device="cpu", kv_cache_gb=0.001)
    assert gc.get_freeze_count() > frozen // 2
    walked = len(gc.get_objects())  # what a full collection walks: not the frozen heap
    assert walked < gc.get_freeze_count() // 4, (walked, gc.get_freeze_count())
    out = second.generate(prompt_token_ids=[[5, 6, 7]],
                          sampling_params=SamplingParams(max_tokens=4, temperature=0,
                                                         ignore_eos=True))
    assert len(out[0].token_ids) == 4
