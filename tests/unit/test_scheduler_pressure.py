"""Scheduling under memory pressure on a tiny Gemma 3 (three SWA layers, one full): long
prompts start in shorter chunks when a whole chunk's pages do not fit at once, admission keeps
the running requests' next pages free (no admit-then-preempt churn) and, by default, their
expected output's pages too (no preemption at all for requests that ignore EOS), and a
request that can never fit, even alone, is aborted instead of looping. Outputs always equal
an unpressured run."""

from __future__ import annotations

import random

import pytest

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model, tiny_gemma3_config

PAGE = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = tiny_gemma3_config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=1024,
    )
    out = tmp_path_factory.mktemp("tiny_gemma3_pressure")
    save_random_hf_model(cfg, out)
    return out


def _engine(folder, num_pages: int | None = None, **kw) -> Engine:
    eng = Engine(model=str(folder), device="cpu", page_size=PAGE, kv_cache_gb=0.05,
                 max_num_batched_tokens=256, **kw)
    if num_pages is not None:  # same engine, a pool of exactly num_pages
        core = eng.core
        kw_pool = dict(layout=core.layout, page_size=PAGE, num_pages=num_pages,
                       watermark_pages=core.memory.watermark_pages)
        from swaserve.engine.scheduler import Scheduler
        from swaserve.memory.kv_pool import KVPool
        from swaserve.memory.manager import MemoryManager
        from swaserve.memory.radix_cache import build_prefix_cache

        core.kv = KVPool(core.layout, num_pages, PAGE, core.kv.kv.shape[4], core.kv.kv.shape[5],
                         core.kv.dtype, core.device)
        core.runner.kv = core.kv
        core.memory = MemoryManager(**kw_pool)
        core.cache = build_prefix_cache(core.config, core.memory, core.kv)
        core.scheduler = Scheduler(core.memory, core.config.max_num_seqs,
                                   core.config.max_num_batched_tokens, core.cache,
                                   core.config.schedule_conservativeness,
                                   core.config.scheduling_policy)
    return eng


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 128) for _ in range(length)] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_long_prompt_starts_in_shorter_chunks(folder):
    prompts = _prompts(1, 200)
    want = [o.token_ids for o in _engine(folder).generate(prompt_token_ids=prompts,
                                                         sampling_params=GREEDY)]
    eng = _engine(folder, num_pages=110)
    groups = len(eng.core.layout.groups)
    assert groups == 4
    # A whole 200-token chunk needs 50 pages in each of the 4 groups at once; chunked, the
    # SWA groups keep ~3 pages each after retirement.
    assert eng.core.memory.pages_to_cover(0, 200) > 110
    got = eng.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in got] == want
    assert got[0].outputs[0].finish_reason == "length"
    eng.core.memory.check_integrity()


def test_pressure_preempts_a_bounded_number_of_times(folder):
    prompts = _prompts(6, 60, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _engine(folder).generate(prompt_token_ids=prompts,
                                                         sampling_params=params)]
    preempted = {}
    for conservativeness in (0.0, 1.0):
        eng = _engine(folder, num_pages=120, disable_prefix_cache=True,
                      schedule_conservativeness=conservativeness)
        got = [o.token_ids for o in eng.generate(prompt_token_ids=prompts,
                                                 sampling_params=params)]
        assert got == want
        eng.core.memory.check_integrity()
        preempted[conservativeness] = eng.core.scheduler.num_preemptions
    # Each request ends with 25 full-group pages plus SWA pages: the pool holds about three at
    # once. Admitted eagerly, some are preempted (recompute keeps outputs equal), but admission
    # keeps the running requests' next pages free: no admit-preempt livelock.
    assert 0 < preempted[0.0] <= 2 * len(prompts)
    # With the growth reserve (the new-token ratio of each running request's remaining output),
    # fewer requests are admitted only to be preempted and recomputed.
    assert preempted[1.0] < preempted[0.0], preempted


def test_decode_growth_estimate(folder):
    """What admission expects a running request to add: its min_tokens due plus the new-token
    ratio of the rest (clipped), whether or not it ignores EOS; the ratio decays while steps
    run and rises on a preemption."""
    from swaserve.engine import scheduler as sch
    from swaserve.engine.request import Request

    s = _engine(folder).core.scheduler

    def req(**kw) -> Request:
        return Request("r", [5] * 10, SamplingParams(**kw), max_tokens=kw.get("max_tokens", 100))

    s.new_token_ratio = 0.5
    assert s.expected_new_tokens(req(max_tokens=100, ignore_eos=True)) == 50
    assert s.expected_new_tokens(req(max_tokens=100)) == 50
    assert s.expected_new_tokens(req(max_tokens=100, min_tokens=20)) == 20 + 40
    r = req(max_tokens=10**6)
    assert s.expected_new_tokens(r) == sch.CLIP_MAX_NEW_TOKENS // 2
    r.output_token_ids = [7] * (10**6)
    assert s.expected_new_tokens(r) == 0  # done
    s.conservativeness = 0.0
    assert s.expected_new_tokens(req(max_tokens=100, ignore_eos=True)) == 0
    s.conservativeness = 1.0
    # decay over scheduled steps, never below the floor; a preemption raises it
    eng = _engine(folder)
    s = eng.core.scheduler
    eng.generate(prompt_token_ids=_prompts(2, 10), sampling_params=GREEDY)
    assert sch.MIN_NEW_TOKEN_RATIO <= s.new_token_ratio < sch.INIT_NEW_TOKEN_RATIO
    s.new_token_ratio = sch.MIN_NEW_TOKEN_RATIO
    victim = Request("v", [5] * 4, GREEDY, max_tokens=12)
    s.running.append(victim)
    s._preempt(victim, sch.ScheduledBatch())
    assert s.new_token_ratio >= sch.INIT_NEW_TOKEN_RATIO
    s.waiting.clear()


def test_request_that_never_fits_alone_is_aborted(folder):
    eng = _engine(folder, num_pages=40)
    long_prompt, short = _prompts(1, 300)[0], _prompts(1, 10, seed=3)[0]
    outs = eng.generate(prompt_token_ids=[long_prompt, short], sampling_params=GREEDY)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].token_ids) == 12
    eng.core.memory.check_integrity()
    assert not eng.core.has_unfinished()
