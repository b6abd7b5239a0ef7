"""The prefix cache inside the engine, on Gemma 3 270M (15 SWA layers of window 512, 3 full):
greedy outputs identical with the cache on and off, hit sizes, refused hits after SWA
eviction, the host tier under a device pool far smaller than the working set, and stats.

Prompts are random token ids (no accidental hits from other tests); every prompt length is
chosen so that its shared prefix ends mid-page (page size 16).

Requests held out of the forward while their prefix loads from the host tier (on CPU the
copies are synchronous: held by a forced `loads_pending`, or by loads emulated as landing
late, as on a CUDA side stream) run later with the same outputs; on a tiny random Gemma 3.
"""

from __future__ import annotations

import random

import pytest

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model, tiny_gemma3_config

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def gemma_off():
    return Engine(model="gemma-3-270m", device="cpu", kv_cache_gb=0.5, disable_prefix_cache=True)


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


def _gen(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
    engine.core.memory.check_integrity()
    return out


class ComputedTokens:
    """Counts the prompt tokens the engine computes per request (the scheduler's batches;
    decode steps, including one the overlap schedule may launch past the end, are not
    counted), and records every step's batch."""

    def __init__(self, engine: Engine) -> None:
        self.scheduler = engine.core.scheduler
        self.counts: dict[str, int] = {}
        self.steps: list[list[str]] = []  # request ids of each step's batch

    def __enter__(self) -> ComputedTokens:
        schedule = self._schedule = self.scheduler.schedule

        def counting():
            batch = schedule()
            self.steps.append([r.request_id for r in batch.requests])
            for req, n in zip(batch.requests, batch.num_new_tokens):
                prompt = max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
                self.counts[req.request_id] = self.counts.get(req.request_id, 0) + prompt
            return batch

        self.scheduler.schedule = counting
        return self

    def __exit__(self, *exc) -> None:
        self.scheduler.schedule = self._schedule

    def prompt_tokens(self, num_prompt_tokens: int) -> int:
        """Prompt tokens computed by the (one) request."""
        (n,) = self.counts.values()
        return n


@pytest.mark.parametrize("prefix_len", [100, 600, 1500])
def test_greedy_identical_with_cache_on_and_off(gemma_engine, gemma_off, prefix_len):
    rng = random.Random(prefix_len)
    prefix = [2] + _rand(rng, prefix_len - 1)
    first = prefix + _rand(rng, 20)
    _gen(gemma_engine, first)  # a miss: it fills the cache
    cases = [
        (prefix + _rand(rng, 37), prefix_len),  # the whole prefix, ending mid-page
        (prefix[: prefix_len // 2 + 3] + _rand(rng, 11), prefix_len // 2 + 3),  # mid-node
    ]
    for prompt, shared in cases:
        on = _gen(gemma_engine, prompt)
        off = _gen(gemma_off, prompt)
        assert on.token_ids == off.token_ids, f"shared {shared}"
        assert off.num_cached_tokens == 0
        # Mid-node hits need the window before the reuse point: it was never evicted here.
        assert on.num_cached_tokens == shared


def test_second_request_computes_only_the_rest_of_a_finished_prefix(gemma_engine):
    rng = random.Random(7)
    prefix = [2] + _rand(rng, 1499)
    _gen(gemma_engine, prefix + _rand(rng, 30))  # finished before the second one arrives
    second = prefix + _rand(rng, 25)
    with ComputedTokens(gemma_engine) as computed:
        out = _gen(gemma_engine, second)
    assert out.num_cached_tokens >= 1400
    assert out.num_cached_tokens == 1500
    assert computed.prompt_tokens(len(second)) == len(second) - out.num_cached_tokens
    stats = gemma_engine.memory_stats()
    assert stats["cache_hit_tokens"] >= 1500 and stats["cache_pages"] > 0


def test_hit_refused_when_swa_window_was_evicted(gemma_engine, gemma_off):
    rng = random.Random(11)
    first = [2] + _rand(rng, 1199)
    _gen(gemma_engine, first)
    cache = gemma_engine.core.cache
    # Force it: SWA pages outside each node's tail window become tombstones.
    assert cache.evict(10**9, swa_only=True) > 0
    gemma_engine.core.memory.check_integrity()
    mid = first[:800] + _rand(rng, 9)  # keys 289..799 are needed and partly gone
    on = _gen(gemma_engine, mid)
    assert on.num_cached_tokens < 800  # a shorter hit or a miss, never a wrong one
    assert on.token_ids == _gen(gemma_off, mid).token_ids
    end = first + _rand(rng, 9)  # the branch end kept its window: a full hit there
    assert _gen(gemma_engine, end).num_cached_tokens == 1200


def _conversations(engine: Engine, starts: list[list[int]], turns: list[list[list[int]]]):
    """Round-robin multi-turn chats: each turn's prompt is the conversation so far plus the
    new user tokens. Returns (outputs, total cached tokens)."""
    history = [list(s) for s in starts]
    outputs, cached = [], 0
    for turn in turns:
        for c, user in enumerate(turn):
            prompt = history[c] + user
            out = _gen(engine, prompt)
            outputs.append(out.token_ids)
            cached += out.num_cached_tokens
            history[c] = prompt + out.token_ids
    return outputs, cached


def test_host_tier_gives_more_hits_under_device_pressure(gemma_off, tmp_path):
    rng = random.Random(3)
    starts = [[2] + _rand(rng, 519) for _ in range(3)]
    turns = [[_rand(rng, 60) for _ in range(3)] for _ in range(2)]
    # ~450 device pages: one conversation's cached prefix is ~215 pages, three do not fit.
    small = dict(model="gemma-3-270m", device="cpu", kv_cache_gb=0.04, max_num_seqs=2)
    device_only = Engine(**small)
    ref, _ = _conversations(gemma_off, starts, turns)
    out_dev, hits_dev = _conversations(device_only, starts, turns)
    stats_dev = device_only.memory_stats()
    del device_only
    with_host = Engine(**small, host_cache_gb=0.25)
    out_host, hits_host = _conversations(with_host, starts, turns)
    stats = with_host.memory_stats()
    assert out_dev == ref and out_host == ref
    assert stats_dev["evictions"] > 0 and stats_dev["host_pages"] == 0
    assert stats["host_loads"] > 0 and stats["host_pages"] > 0
    assert hits_host > hits_dev, (hits_host, hits_dev)


def test_disk_tier_and_write_through(gemma_off, tmp_path):
    rng = random.Random(5)
    starts = [[2] + _rand(rng, 519) for _ in range(3)]
    turns = [[_rand(rng, 40) for _ in range(3)] for _ in range(2)]
    engine = Engine(
        model="gemma-3-270m",
        device="cpu",
        kv_cache_gb=0.04,
        max_num_seqs=2,
        host_cache_gb=0.01,
        host_cache_policy="write_through",
        disk_cache_dir=str(tmp_path),
    )
    ref, _ = _conversations(gemma_off, starts, turns)
    out, hits = _conversations(engine, starts, turns)
    stats = engine.memory_stats()
    assert out == ref and hits > 0
    assert stats["disk_pages"] > 0 and stats["host_loads"] > 0
    # reset_prefix_cache (vLLM's): every tier emptied, the pool whole, the same answers after
    assert engine.reset_prefix_cache()
    engine.core.memory.check_integrity()
    empty = engine.memory_stats()
    assert empty["cache_pages"] == empty["host_pages"] == empty["disk_pages"] == 0
    assert empty["pages_free"] == empty["pages_total"]
    again, _ = _conversations(engine, starts[:1], [t[:1] for t in turns])
    assert again == _conversations(gemma_off, starts[:1], [t[:1] for t in turns])[0]
    engine.core.cache.close()


def test_disabled_cache_and_stats_names(gemma_off):
    assert gemma_off.core.cache is None
    stats = gemma_off.memory_stats()
    for key in ("cache_pages", "host_pages", "cache_hit_tokens", "evictions", "host_loads"):
        assert stats[key] == 0
    with pytest.raises(ValueError, match="host_cache_policy"):
        Engine(model="gemma-3-270m", device="cpu", kv_cache_gb=0.01, host_cache_policy="x")


def test_prompt_logprobs_requests_skip_the_cache(gemma_engine):
    rng = random.Random(13)
    prompt = [2] + _rand(rng, 40)
    _gen(gemma_engine, prompt)
    out = _gen(gemma_engine, prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)


# ---- requests held for their loads (tiny random Gemma 3: 2 SWA layers of window 24, 1 full) --


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    cfg = tiny_gemma3_config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=1024, eos_token_id=1,
    )
    folder = tmp_path_factory.mktemp("tiny_gemma3_hold")
    save_random_hf_model(cfg, folder)
    return str(folder)


TINY_PAGE_BYTES = 2 * 16 * 2 * 16 * 4  # K and V of 16 tokens, 2 heads of 16, float32


def _tiny(folder: str, pages: int | None = None, **kw) -> Engine:
    kv = (pages or 2000) * TINY_PAGE_BYTES / 2**30
    return Engine(model=folder, device="cpu", kv_cache_gb=kv, **kw)


def _together(engine: Engine, starts, turns, params, long_prompts=()):
    """Multi-turn chats, each turn's prompts submitted together (one generate call), after a
    long-running request of that turn (`long_prompts`: it computes while others wait)."""
    history = [list(s) for s in starts]
    outputs = []
    for t, turn in enumerate(turns):
        prompts = [h + user for h, user in zip(history, turn)]
        extra = [long_prompts[t]] if long_prompts else []
        long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        outs = engine.generate(
            prompt_token_ids=extra + prompts,
            sampling_params=[long] * len(extra) + [params] * len(prompts),
        )
        engine.core.memory.check_integrity()
        outputs += [o.token_ids for o in outs]
        for c, out in enumerate(outs[len(extra) :]):
            history[c] = prompts[c] + out.token_ids
    return outputs


def test_request_held_for_loads_runs_later_with_same_output(tiny_gemma):
    """`loads_pending` forced true: the request is admitted but left out of the batches
    (alone: empty steps, the loop keeps polling), keeps its pages, then runs."""
    rng = random.Random(17)
    prefix = [2] + [rng.randrange(3, 256) for _ in range(70)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(n)] for n in (9, 30, 12)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = [
        o.token_ids
        for o in _tiny(tiny_gemma, disable_prefix_cache=True).generate(
            prompt_token_ids=prompts, sampling_params=params
        )
    ]
    engine = _tiny(tiny_gemma)
    engine.generate(prompt_token_ids=[prefix + [5] * 20], sampling_params=params)  # to cache
    cache, scheduler = engine.core.cache, engine.core.scheduler
    real = cache.loads_pending
    holds: dict[str, int] = {}  # request -> held steps left (the first one asked about)
    seen: list[tuple[str, int, bool]] = []  # (request, pages, running) while held

    def forced(rid: str) -> bool:
        if not holds:
            holds[rid] = 4
        if holds.get(rid, 0) > 0:
            holds[rid] -= 1
            running = any(r.request_id == rid for r in scheduler.running)
            seen.append((rid, len(engine.core.memory.page_table(rid)[2]), running))
            return True
        return real(rid)

    cache.loads_pending = forced
    # the scheduler asks per request only while some load is pending (has_pending_loads)
    cache.has_pending_loads = lambda: True
    try:
        for first, batch_prompts in ((0, prompts[:1]), (1, prompts[1:])):  # alone, with another
            holds.clear()
            seen.clear()
            with ComputedTokens(engine) as computed:
                outs = engine.generate(prompt_token_ids=batch_prompts, sampling_params=params)
            (rid,) = holds
            assert len(seen) == 4 and all(s == seen[0] for s in seen)
            assert seen[0][1] > 0 and seen[0][2], "held: running, with its pages"
            held_steps = [i for i, step in enumerate(computed.steps) if rid not in step][:4]
            assert held_steps == [0, 1, 2, 3]  # out of the first four batches, then in
            if len(batch_prompts) == 1:
                assert computed.steps[:4] == [[]] * 4  # nothing else to run: empty steps
            else:
                assert all(computed.steps[i] for i in range(4)), "the other one ran meanwhile"
            assert [o.num_cached_tokens for o in outs] == [71] * len(outs)
            assert [o.token_ids for o in outs] == ref[first : first + len(outs)]
            engine.core.memory.check_integrity()
            assert not engine.core.has_unfinished()
    finally:
        cache.loads_pending = real
        del cache.has_pending_loads


@pytest.mark.parametrize("lag", [1, 3])
def test_loads_landing_late_hold_requests_with_same_outputs(tiny_gemma, lag):
    """Several multi-turn chats at once under a device pool far smaller than their working
    set, with loads that land `lag` flushes late (the CUDA side stream, emulated): requests
    that hit host pages are held meanwhile, outputs are those of the cache-off engine."""
    rng = random.Random(lag)
    starts = [[2] + [rng.randrange(3, 256) for _ in range(150)] for _ in range(5)]
    turns = [[[rng.randrange(3, 256) for _ in range(40)] for _ in range(5)] for _ in range(3)]
    longs = [[2] + [rng.randrange(3, 256) for _ in range(30)] for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = _together(_tiny(tiny_gemma, disable_prefix_cache=True), starts, turns, params, longs)
    engine = _tiny(tiny_gemma, pages=90, max_num_seqs=3, host_cache_gb=0.01)
    engine.core.cache.mover.emulate_async(lag)
    out = _together(engine, starts, turns, params, longs)
    stats = engine.memory_stats()
    assert out == ref
    assert stats["host_loads"] > 0 and stats["host_load_waits"] > 0, stats
    assert stats["cache_hit_tokens"] > 0
    assert not engine.core.cache._inflight
