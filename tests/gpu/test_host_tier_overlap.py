"""GPU only (skipped elsewhere): prefix hits on pages offloaded to the host (and disk) tier load
back on a side stream while other requests compute. A tiny random Gemma 3 (2 SWA layers of
window 24, 1 full) with a device pool far smaller than the working set of several multi-turn
conversations submitted together, next to a long-running request: greedy tokens equal the
cache-off engine's, pages are loaded back, and requests are held out of the forward while
their loads are in flight (on CUDA a hit that needs loads is always held at least in the step
that admits it: its loads are issued after that step's schedule) while the batch still runs
other requests."""

from __future__ import annotations

import random

import pytest
import torch

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model, tiny_gemma3_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PAGE_BYTES = 2 * 16 * 2 * 16 * 4  # one page id: K and V of 16 tokens, 2 heads of 16, float32


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    cfg = tiny_gemma3_config()
    folder = tmp_path_factory.mktemp("gemma3_host_tier")
    save_random_hf_model(cfg, folder)
    return str(folder)


def _engine(folder: str, **kw) -> Engine:
    kw.setdefault("kv_cache_gb", 4000 * PAGE_BYTES / 2**30)
    return Engine(model=folder, dtype="float32", page_size=16, cuda_graph_max_bs=8, seed=0, **kw)


class Watch:
    """Per step: was a request held for its loads, and how many requests ran."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[tuple[bool, int]] = []
        scheduler, cache = engine.core.scheduler, engine.core.cache
        schedule, pending = scheduler.schedule, cache.loads_pending
        self.held = False

        def watched_pending(rid: str) -> bool:
            out = pending(rid)
            self.held |= out
            return out

        def watched_schedule():
            self.held = False
            batch = schedule()
            self.steps.append((self.held, len(batch)))
            return batch

        cache.loads_pending = watched_pending
        scheduler.schedule = watched_schedule


def _conversations(engine: Engine, seed: int) -> list[list[int]]:
    """8 conversations of ~600 tokens, 3 turns, each turn submitted together after a long
    request that decodes for 200 steps while the others hit, wait and run."""
    rng = random.Random(seed)
    history = [[2] + [rng.randrange(3, 256) for _ in range(600)] for _ in range(8)]
    short = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    outputs = []
    for _ in range(3):
        prompts = [h + [rng.randrange(3, 256) for _ in range(50)] for h in history]
        background = [2] + [rng.randrange(3, 256) for _ in range(40)]
        outs = engine.generate(
            prompt_token_ids=[background] + prompts,
            sampling_params=[long] + [short] * len(prompts),
        )
        engine.core.memory.check_integrity()
        outputs += [o.token_ids for o in outs]
        history = [p + o.token_ids for p, o in zip(prompts, outs[1:])]
    return outputs


@pytest.mark.parametrize("tiers", ["host", "host+disk"])
def test_host_loads_overlap_compute_and_keep_outputs(tiny_gemma, tiers, tmp_path):
    ref = _conversations(_engine(tiny_gemma, disable_prefix_cache=True), seed=1)
    # ~320 device pages: one conversation caches ~45 (full pages + SWA tail windows), the
    # working set is ~8 x 50 + the running requests: most hits come back from the host.
    kw = dict(kv_cache_gb=320 * PAGE_BYTES / 2**30, max_num_seqs=4)
    if tiers == "host":
        kw.update(host_cache_gb=0.01)
    else:  # a small host tier in front of the disk, written through
        kw.update(
            host_cache_gb=150 * PAGE_BYTES / 2**30,
            host_cache_policy="write_through",
            disk_cache_dir=str(tmp_path),
            disk_cache_gb=0.01,
        )
    engine = _engine(tiny_gemma, **kw)
    watch = Watch(engine)
    out = _conversations(engine, seed=1)
    stats = engine.memory_stats()
    overlapped = sum(1 for held, n in watch.steps if held and n)
    print(
        f"\n[{tiers}] host_loads={stats['host_loads']} host_load_waits={stats['host_load_waits']}"
        f" steps={len(watch.steps)} held-with-compute={overlapped}"
        f" held-alone={sum(1 for held, n in watch.steps if held and not n)}"
        f" hits={stats['cache_hits']} hit_tokens={stats['cache_hit_tokens']}"
        f" evictions={stats['evictions']} stores={stats['host_stores']}"
        f" disk_pages={stats['disk_pages']} preemptions={engine.core.scheduler.num_preemptions}"
    )
    assert out == ref
    assert stats["host_loads"] > 0
    assert stats["host_load_waits"] > 0  # guaranteed: every hit that loads is held once
    assert overlapped > 0  # a held request's step still ran the others
    if tiers == "host+disk":
        assert stats["disk_pages"] > 0
    engine.core.cache.close()
