"""Prefill ahead (`prefill_ahead_tokens`, engine/scheduler.py) on a tiny Gemma 3 whose pool
holds a few requests while more wait: one prompt at a time is prefilled beside the decodes
in chunks of at most max(page, R - decode tokens), parked in the prefix cache (its pages
evicted to the host tier when room is needed) and admitted again as a hit once it has room to
decode. Outputs and logprobs equal a run without it; nobody is preempted (ahead admission
plans every running request's remaining tokens); the pool's and the cache's invariants hold
after every step; a config without a host tier is refused."""

from __future__ import annotations

import pytest

from swaserve import Engine, SamplingParams
from swaserve.engine.scheduler import Scheduler, _decoding
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager
from swaserve.memory.radix_cache import build_prefix_cache
from tests.unit.test_scheduler_pressure import PAGE, _prompts, folder  # noqa: F401

R = 24
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)


def _engine(folder, num_pages: int, ahead: int) -> Engine:  # noqa: F811
    """An engine over a pool of exactly num_pages, with a host tier; `ahead`: R (0: off)."""
    eng = Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=0.05,
                 max_num_batched_tokens=256, host_cache_gb=0.01)  # fmt: skip
    core = eng.core
    core.kv = KVPool(core.layout, num_pages, PAGE, core.kv.kv.shape[4], core.kv.kv.shape[5],
                     core.kv.dtype, core.device)  # fmt: skip
    core.runner.kv = core.kv
    core.memory = MemoryManager(core.layout, PAGE, num_pages, core.memory.watermark_pages)
    core.cache = build_prefix_cache(core.config, core.memory, core.kv)
    core.scheduler = Scheduler(core.memory, core.config.max_num_seqs,
                               core.config.max_num_batched_tokens, core.cache,
                               prefill_ahead_tokens=ahead)  # fmt: skip
    return eng


def _run(folder, ahead: int):  # noqa: F811
    eng = _engine(folder, 110, ahead)
    core = eng.core
    sched = core.scheduler
    steps = []  # (decode tokens, ahead tokens, ahead requests running, parked waiting)
    schedule = sched.schedule

    def recorded():
        decodes = [req for req in sched.running if _decoding(req)]
        batch = schedule()
        d = a = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req in decodes:
                d += n
            elif req.ahead:
                a += n
        steps.append((d, a, sum(r.ahead for r in sched.running),
                      sum(r.parked for r in sched.waiting)))  # fmt: skip
        core.memory.check_integrity()
        core.cache.check_integrity()
        return batch

    sched.schedule = recorded
    outs = eng.generate(prompt_token_ids=_prompts(10, 40, seed=3), sampling_params=PARAMS,
                        use_tqdm=False)  # fmt: skip
    core.memory.check_integrity()
    core.cache.check_integrity()
    got = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs],
            o.outputs[0].finish_reason) for o in outs]  # fmt: skip
    assert all(o.num_cached_tokens == 0 for o in outs)  # distinct prompts: a park is no hit
    return got, steps, sched, core.cache.stats()


def test_prefill_ahead_parks_prompts_and_changes_no_output(folder):  # noqa: F811
    want, _, plain, _ = _run(folder, 0)
    got, steps, sched, stats = _run(folder, R)
    for (gt, gl, gf), (wt, wl, wf) in zip(got, want, strict=True):
        assert gt == wt and gf == wf == "length"
        assert max(abs(a - b) for a, b in zip(gl, wl)) < 1e-4
    assert plain.num_parks == 0
    assert sched.num_parks >= 2, steps
    assert sched.num_preemptions == 0
    assert all(n <= 1 for _, _, n, _ in steps), "more than one prompt prefilled ahead at once"
    ahead = [(d, a) for d, a, _, _ in steps if a]
    assert ahead and all(a <= max(PAGE, R - d) for d, a in ahead), ahead
    assert any(d for d, _ in ahead), "no prompt was prefilled beside decodes"
    assert any(p for _, _, _, p in steps), "no prompt waited parked"
    assert stats["cache_hits"] >= sched.num_parks  # each parked prompt came back as a hit
    assert stats["host_stores"] and stats["host_loads"], stats  # some by way of the host
    assert not sched.running and not sched.waiting


def test_prefill_ahead_needs_a_host_tier(folder):  # noqa: F811
    with pytest.raises(ValueError, match="prefill_ahead_tokens.*host-cache-gb"):
        Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=0.05,
               prefill_ahead_tokens=R)  # fmt: skip
    with pytest.raises(ValueError, match="prefill_ahead_tokens"):
        Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=0.05,
               host_cache_gb=0.01, disable_prefix_cache=True, prefill_ahead_tokens=R)  # fmt: skip


def test_parks_reach_prometheus_as_a_counter():
    """The core's running total of parks becomes swaserve:num_parked_prompts_total, and
    /v1/memory's num_parks (server/app.memory_view)."""
    from prometheus_client import generate_latest

    from swaserve.server.app import memory_view
    from swaserve.server.metrics import Metrics

    m = Metrics()
    for total in (3, 5, 5):
        stats = {"num_running": 1, "num_waiting": 2, "num_parks": total,
                 "memory": {"pages_held_by_requests": 0, "pages_total": 100}}  # fmt: skip
        m.update_core_stats(stats)
    assert "swaserve:num_parked_prompts_total 5.0" in generate_latest(m.registry).decode()
    assert memory_view(stats)["num_parks"] == 5
