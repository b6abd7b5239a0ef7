"""The overlap schedule (step N+1 launched before step N's tokens are read back) changes
nothing a user can see: the same tokens, logprobs and finish reasons as the synchronous
loop, through stops, penalties, preemption, aborts and prefix-cache hits, with memory
consistent afterwards and no placeholder leaking into outputs or the cache."""

from __future__ import annotations

import random

import pytest

from swaserve import Engine, SamplingParams
from swaserve.engine.request import PLACEHOLDER
from tests.helpers import save_random_hf_model, tiny_gemma3_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = tiny_gemma3_config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        sliding_window=12, max_position_embeddings=256, eos_token_id=3,
    )
    out = tmp_path_factory.mktemp("tiny_gemma3")
    save_random_hf_model(cfg, out)
    return out


def _engine(folder, overlap: bool, **kw) -> Engine:
    kw.setdefault("kv_cache_gb", 0.002)
    return Engine(
        model=str(folder), device="cpu", page_size=4, max_num_batched_tokens=48,
        disable_overlap_schedule=not overlap, **kw,
    )


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4, 128) for _ in range(30)]
    return [
        (shared if i % 2 else []) + [rng.randrange(4, 128) for _ in range(rng.randrange(3, 50))]
        for i in range(n)
    ]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=20, temperature=0),
        SamplingParams(max_tokens=1, temperature=0),
        SamplingParams(max_tokens=15, temperature=0.8, seed=7, logprobs=2),
        SamplingParams(max_tokens=25, temperature=0, stop_token_ids=[5, 6, 7, 8, 9]),
        SamplingParams(max_tokens=12, temperature=0, min_tokens=10),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=18, temperature=0, prompt_logprobs=1),
        SamplingParams(max_tokens=22, temperature=1.0, top_k=5, seed=3),
    ]


def _run(engine: Engine, prompts, params):
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    core = engine.core
    core.memory.check_integrity()
    assert not core.has_unfinished() and not core.requests
    for o in outs:
        assert PLACEHOLDER not in o.outputs[0].token_ids
    return [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason,
         [(lp.token_id, round(lp.logprob, 5)) for lp in (o.outputs[0].logprobs or [])])
        for o in outs
    ]


def test_overlap_matches_sync_loop(folder):
    prompts, params = _prompts(8), _params()
    sync = _engine(folder, False)
    # Stop tokens taken from a probe run, so stops (and min_tokens holding one back) happen
    # while a later step is in flight.
    probe = _run(sync, prompts, params)
    params[3] = SamplingParams(max_tokens=25, temperature=0, stop_token_ids=[probe[3][0][6]])
    params[4] = SamplingParams(max_tokens=12, temperature=0, min_tokens=4,
                               stop_token_ids=[probe[4][0][1], probe[4][0][5]])
    want = _run(sync, prompts, params)
    got = _run(_engine(folder, True), prompts, params)
    assert got == want
    assert any(reason == "stop" for _, reason, _ in got)  # stops happen mid-overlap


def test_overlap_with_penalties_preemption_and_cache(folder):
    """Penalties force read-back before scheduling; a tiny pool forces preemption of requests
    whose last token is still in flight; the second round hits the prefix cache."""
    prompts = _prompts(6, seed=1)
    params = [SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3,
                             presence_penalty=0.5)] * 2 + [
        SamplingParams(max_tokens=24, temperature=0)] * 4
    runs = {}
    for overlap in (False, True):
        engine = _engine(folder, overlap, kv_cache_gb=0.00008, schedule_conservativeness=0)
        first = _run(engine, prompts, params)
        second = _run(engine, prompts, params)
        runs[overlap] = (first, second, engine.core.scheduler.num_preemptions)
        stats = engine.memory_stats()
        assert stats["cache_hit_tokens"] > 0
        _check_cache_has_no_placeholder(engine)
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][2] > 0  # the pool was tight enough to preempt


def test_abort_while_in_flight(folder):
    engine = _engine(folder, True)
    core = engine.core
    prompts = _prompts(3, seed=2)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, SamplingParams(max_tokens=40, temperature=0))
    seen = 0
    while seen < 5:
        seen += sum(len(o.new_token_ids) for o in core.step())
    assert core.has_in_flight()
    core.abort_requests(["r0", "r1"])
    while core.has_unfinished():
        for o in core.step():
            assert o.request_id == "r2"
    core.memory.check_integrity()
    assert engine.memory_stats()["pages_held_by_requests"] == 0


def _check_cache_has_no_placeholder(engine: Engine) -> None:
    cache = engine.core.cache
    stack = [cache.root]
    while stack:
        node = stack.pop()
        assert PLACEHOLDER not in list(node.key)
        stack.extend(node.children.values())


def test_no_step_past_max_tokens(folder, monkeypatch):
    """A request whose last token is in flight is not scheduled again: every request computes
    its prompt and max_tokens - 1 generated tokens, as without overlap (a step launched past
    max_tokens would compute a token that is thrown away; a whole step when a batch ends
    together)."""
    from swaserve.engine.core import EngineCore

    computed = []
    orig = EngineCore._launch

    def launch(self, batch):
        computed.append(sum(batch.num_new_tokens))
        return orig(self, batch)

    monkeypatch.setattr(EngineCore, "_launch", launch)
    prompts = _prompts(4, seed=3)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = sum(len(p) + 5 - 1 for p in prompts)
    for overlap in (False, True):
        computed.clear()
        outs = _run(_engine(folder, overlap, disable_prefix_cache=True), prompts, params)
        assert all(len(tokens) == 5 for tokens, _, _ in outs)
        assert sum(computed) == want, (overlap, computed)
