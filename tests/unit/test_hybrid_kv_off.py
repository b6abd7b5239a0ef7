"""`disable_hybrid_kv_cache`: every layer keeps a full-length KV in one full group (the baseline
of the window-aware pool), yet each layer still attends with its own window, so outputs do not
change; under the same KV budget the window-aware pool holds more long requests at once."""

from __future__ import annotations

import pytest
import torch

from swaserve import Engine, SamplingParams
from swaserve.bench.memory import run_memory_bench
from swaserve.models.blocks import layer_windows
from tests.helpers import engine_prompt_logits, save_random_hf_model, tiny_gemma3_config

WINDOW = 24
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
KV_HEADS, HEAD_DIM, PAGE = 2, 16, 4
LONG = 160  # prompt tokens of the memory test: > 6 windows


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    cfg = tiny_gemma3_config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, layer_types=LAYER_TYPES,
        sliding_window=WINDOW, max_position_embeddings=512,
    )
    folder = tmp_path_factory.mktemp("gemma3_hybrid_off")
    return folder, save_random_hf_model(cfg, folder)


def _engine(folder, hybrid_off: bool, **kw) -> Engine:
    args = dict(device="cpu", dtype="float32", page_size=PAGE, max_num_batched_tokens=32,
                kv_cache_gb=0.01)
    return Engine(model=str(folder), disable_hybrid_kv_cache=hybrid_off, **{**args, **kw})


def _prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length + 7 * i,), generator=gen).tolist() for i in range(n)]


def _generate_tracking_peak(engine: Engine, prompts, params) -> tuple[list[list[int]], int]:
    """Greedy tokens, and the most requests decoding at once (running with the whole prompt
    computed, after a step): a request mid-prefill holds only part of its pages."""
    core, peak = engine.core, 0
    step = core.step

    def tracked():
        nonlocal peak
        out = step()
        running = core.scheduler.running
        peak = max(peak, sum(r.num_computed_tokens >= r.num_prompt_tokens for r in running))
        return out

    core.step = tracked
    try:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        core.step = step
    return [o.token_ids for o in outs], peak


def test_layout_is_one_full_group(gemma):
    folder, _ = gemma
    on, off = _engine(folder, False), _engine(folder, True)
    assert [g.kind for g in on.core.layout.groups].count("swa") >= 1
    groups = off.memory_stats()["groups"]
    assert len(groups) == 1 and groups[0]["kind"] == "full" and groups[0]["window"] is None
    assert groups[0]["layers"] == list(range(len(LAYER_TYPES)))
    assert off.core.layout.slots_per_page == len(LAYER_TYPES)
    # the model itself keeps its windows: the layers still attend within them
    assert layer_windows(off.core.hf_config) == layer_windows(on.core.hf_config)


def test_logits_and_greedy_tokens_unchanged(gemma):
    folder, ref = gemma
    ids = _prompts(1, 70, seed=3)[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    prompts = _prompts(3, 40)  # 40, 47, 54 tokens: all longer than the window
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    toks = {}
    for off in (False, True):
        e = _engine(folder, off)
        got = engine_prompt_logits(e, ids)
        assert (got - want).abs().max().item() < 1e-3, f"hybrid off={off}"
        toks[off] = [o.token_ids for o in e.generate(prompt_token_ids=prompts, sampling_params=p)]
        e.core.memory.check_integrity()
        assert e.memory_stats()["pages_held_by_requests"] == 0
    assert toks[False] == toks[True]


def test_window_aware_pool_holds_more_long_requests(gemma):
    folder, _ = gemma
    new, chunk = 24, 64
    ctx = LONG + new
    # Room for 2.5 requests of ctx tokens with every layer full (float32 K and V); the same
    # bytes for both layouts.
    kv_gb = 2.5 * ctx * len(LAYER_TYPES) * 2 * KV_HEADS * HEAD_DIM * 4 / 2**30
    prompts = [q[:LONG] for q in _prompts(6, LONG, seed=5)]
    p = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    toks, peak, pages, preempted = {}, {}, {}, {}
    for off in (False, True):
        e = _engine(folder, off, kv_cache_gb=kv_gb, disable_prefix_cache=True,
                    max_num_batched_tokens=chunk)
        pages[off] = e.memory_stats()["pages_total"]
        toks[off], peak[off] = _generate_tracking_peak(e, prompts, p)
        preempted[off] = e.core.scheduler.num_preemptions
        e.core.memory.check_integrity()
    assert toks[False] == toks[True]  # the all-full pool queues and preempts: same tokens
    # all full: 3 requests past LONG tokens need more pages than the pool has
    assert peak[True] <= 2 < peak[False], peak
    # A prompt waits until the full group has room for all of it: admitted in chunks without
    # that room it would be preempted before it ends and recomputed, over and over.
    assert preempted[True] == 0, preempted
    # the memory benchmark agrees: more concurrent requests of ctx tokens in the same bytes
    mb = run_memory_bench(layer_windows(e.core.hf_config), PAGE, KV_HEADS, HEAD_DIM, ctx,
                          kv_gb, chunk=chunk, dtype_bytes=4)
    assert mb["max_concurrent"] > mb["max_concurrent_all_full"] >= 1, mb
    assert mb["layout_all_full"]["num_groups"] == 1
    assert mb["layout_all_full"]["num_pages"] == pages[True] + 1  # + the NULL page
    assert mb["layout"]["num_pages"] == pages[False] + 1
