"""Speculative decoding through the real engine (issue 11): lossless against speculation off.

A tiny random Gemma 3 (two sliding layers of window 8, one full) in float32 on CPU. Every
case compares tokens, finish reasons and logprobs (within 1e-5) with the same requests on the
engine without speculation, and checks the pool's integrity after every step. Drafters: the
n-gram drafter on repetitive prompts, and an oracle that proposes the reference continuation
with planted errors, so that full, partial and zero acceptances all happen (asserted).
"""

from __future__ import annotations

import random

import pytest

from swaserve import Engine, SamplingParams
from swaserve.engine.speculation import Speculation
from tests.helpers import check_integrity_every_step, save_random_hf_model, tiny_gemma3_config

WINDOW, PAGE = 8, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = tiny_gemma3_config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512, eos_token_id=1,
    )
    out = tmp_path_factory.mktemp("tiny_gemma3_spec")
    save_random_hf_model(cfg, out)
    return str(out)


def _engine(folder: str, spec: bool, **kw) -> Engine:
    kw.setdefault("kv_cache_gb", 0.01)
    if spec:
        kw.setdefault("speculative_algorithm", "ngram")
        kw.setdefault("speculative_num_draft_tokens", 3)
        # every step drafts: the tests count acceptances (the gate: test_spec_gate.py)
        kw.setdefault("disable_adaptive_speculation", True)
    eng = Engine(model=folder, device="cpu", page_size=PAGE, **kw)
    return check_integrity_every_step(eng)


@pytest.fixture(scope="module")
def off(folder):
    return _engine(folder, spec=False)


def _run(engine: Engine, prompts, params):
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert not engine.core.has_unfinished()
    return outs


def _same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        assert g.outputs[0].text == w.outputs[0].text
        if w.outputs[0].logprobs is not None:
            lg, lw = g.outputs[0].logprobs, w.outputs[0].logprobs
            assert [x.token_id for x in lg] == [x.token_id for x in lw]
            assert max((abs(a.logprob - b.logprob) for a, b in zip(lg, lw)), default=0) < 1e-5


def _histogram(outs) -> list[int]:
    h: list[int] = []
    for o in outs:
        for i, c in enumerate(o.spec_decoding["spec_accept_histogram"]):
            h.extend([0] * (i + 1 - len(h)))
            h[i] += c
    return h


def _check_counters(outs) -> None:
    for o in outs:
        s = o.spec_decoding
        h = s["spec_accept_histogram"]
        assert sum(h) == s["spec_verify_ct"]
        assert sum(i * c for i, c in enumerate(h)) == s["spec_accepted_drafts"]
        assert s["spec_accepted_drafts"] <= s["spec_proposed_drafts"]
        if s["spec_verify_ct"]:
            n = s["spec_verify_ct"]
            assert s["spec_accept_length"] == pytest.approx((s["spec_accepted_drafts"] + n) / n)
        else:
            assert s["spec_accept_length"] is None


def _repetitive(rng: random.Random, n: int, period: int, reps: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        unit = [rng.randrange(2, 64) for _ in range(period)]
        out.append(unit * reps + unit[: rng.randrange(period)])
    return out


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)


def test_ngram_greedy_batch_one_and_mixed_with_chunked_prefill(folder, off):
    rng = random.Random(0)
    prompts = _repetitive(rng, 4, 5, 6) + [[rng.randrange(2, 64) for _ in range(70)]]
    want = [_run(off, [p], GREEDY)[0] for p in prompts]
    alone = _engine(folder, spec=True)
    got = [_run(alone, [p], GREEDY)[0] for p in prompts]
    _same(got, want)
    # mixed: 16-token steps, so prompts are prefilled in chunks beside verify chunks
    mixed = _engine(folder, spec=True, max_num_batched_tokens=16)
    got = _run(mixed, prompts, GREEDY)
    _same(got, want)
    _check_counters(got)
    assert sum(o.spec_decoding["spec_accepted_drafts"] for o in got) > 0


class Oracle:
    """Proposes the reference continuation, with a planted error in draft 2 of every third
    step and in draft 1 of every fifth: full, partial and zero acceptances."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], errors: bool = True) -> None:
        self.refs = refs
        self.errors = errors
        self.calls = 0

    def propose(self, tokens, k: int) -> list[int]:
        for prompt, ref in self.refs.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                pos = len(tokens) - len(prompt)
                drafts = list(ref[pos : pos + k])
                self.calls += 1
                if not self.errors:
                    return drafts
                if self.calls % 5 == 0 and drafts:
                    drafts[0] = (drafts[0] + 1) % 64
                elif self.calls % 3 == 0 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 64
                return drafts
        return []


def _with_oracle(engine: Engine, prompts, want, errors: bool = True) -> Oracle:
    oracle = Oracle({tuple(p): w.token_ids for p, w in zip(prompts, want)}, errors)
    spec: Speculation = engine.core.spec
    spec.drafter = oracle
    return oracle


def test_oracle_full_partial_and_zero_acceptance_through_prefix_hits_and_preemption(folder, off):
    rng = random.Random(1)
    shared = [rng.randrange(2, 64) for _ in range(3 * WINDOW + 3)]  # hits past the window
    prompts = [shared + [rng.randrange(2, 64) for _ in range(n)] for n in (5, 9, 2, 14)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    want = [_run(off, [p], params)[0] for p in prompts]
    eng = _engine(folder, spec=True, speculative_num_draft_tokens=4)
    _with_oracle(eng, prompts, want)
    first = _run(eng, prompts[:1], params)
    rest = _run(eng, prompts[1:], params)  # hits on the first's cached prefix
    got = first + rest
    _same(got, want)
    assert all(o.num_cached_tokens > WINDOW for o in rest)
    _check_counters(got)
    h = _histogram(got)
    assert h[0] > 0 and h[-1] > 0 and len(h) == 5 and sum(h[1:-1]) > 0, h
    # a pool small enough that requests are preempted and recomputed
    tight = _engine(folder, spec=True, speculative_num_draft_tokens=4,
                    kv_cache_gb=_pool_gb(folder, 34), max_num_batched_tokens=32,
                    schedule_conservativeness=0)
    _with_oracle(tight, prompts, want)
    got = _run(tight, prompts, params)
    assert tight.core.scheduler.num_preemptions > 0
    _same(got, want)


def _pool_gb(folder: str, pages: int) -> float:
    from swaserve.memory.groups import build_layout
    from swaserve.memory.manager import page_bytes

    bpp = page_bytes(build_layout([WINDOW, WINDOW, None]), PAGE, 1, 8, 4)
    return (pages + 0.5) * bpp / 2**30


def test_stops_inside_an_accepted_block_and_short_max_tokens(folder, off):
    rng = random.Random(2)
    prompts = _repetitive(rng, 3, 4, 5)
    base = [_run(off, [p], GREEDY)[0] for p in prompts]
    eng = _engine(folder, spec=True, speculative_num_draft_tokens=4)
    for p, b in zip(prompts, base):
        toks = b.token_ids
        cases = [
            SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[toks[5]], logprobs=0),
            SamplingParams(max_tokens=24, temperature=0, stop=[b.text[6:9]] if b.text else None),
        ] + [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 2, 3)]
        for params in cases:
            want = _run(off, [p], params)
            _with_oracle(eng, [p], [b])  # drafts run through the stop
            got = _run(eng, [p], params)
            _same(got, want)
            _check_counters(got)
    # The stop token arrives inside an accepted block: several tokens in the finishing step.
    # first occurrences past the first token, not first in a block of 1 + 4 (the oracle makes
    # no error here: every block is accepted whole)
    p, b, j = next(
        (p, b, j) for p, b in zip(prompts, base) for j in range(2, 24)
        if b.token_ids[j] not in b.token_ids[:j] and (j - 1) % 5 and b.token_ids[j] != 1
    )
    stop = b.token_ids[j]
    params = SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop], ignore_eos=True)
    _with_oracle(eng, [p], [b], errors=False)
    core = eng.core
    core.add_request("stop-in-block", p, params)
    last = None
    while core.has_unfinished():
        for out in core.step():
            last = out
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert len(last.new_token_ids) > 1 and last.spec["spec_accepted_drafts"] > 0
    # max_tokens 1: no verify step at all, and null ratios (the fallback)
    one = _run(eng, prompts[:1], SamplingParams(max_tokens=1, temperature=0))
    assert one[0].spec_decoding["spec_verify_ct"] == 0
    assert one[0].spec_decoding["spec_accept_length"] is None


def test_aborts_mid_verify_free_everything(folder, off):
    rng = random.Random(3)
    prompts = _repetitive(rng, 4, 3, 8)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = _run(off, prompts, params)
    eng = _engine(folder, spec=True)
    core = eng.core
    for i, p in enumerate(prompts):
        core.add_request(f"a{i}", p, params)
    got: dict[str, list[int]] = {f"a{i}": [] for i in range(len(prompts))}
    finished, steps = set(), 0
    while core.has_unfinished():
        for out in core.step():
            got[out.request_id] += out.new_token_ids
            if out.finish_reason:
                finished.add(out.request_id)
        steps += 1
        if steps == 4:
            core.abort_requests(["a1", "a3"])
    assert finished == {"a0", "a2"}
    for i in (0, 2):
        assert got[f"a{i}"] == want[i].token_ids
    core.cache.evict(10**9)
    assert core.memory.pool.num_free == core.memory.pool.capacity


def test_seeded_sampling_reproduces_alone_and_in_a_batch(folder):
    rng = random.Random(4)
    prompts = _repetitive(rng, 4, 4, 6)
    seeded = [SamplingParams(max_tokens=20, temperature=0.8, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    eng = _engine(folder, spec=True)
    batch = _run(eng, prompts, seeded)
    again = _engine(folder, spec=True, max_num_batched_tokens=8)
    for i, p in enumerate(prompts):
        alone = _run(again, [p], seeded[i])[0]
        assert alone.token_ids == batch[i].token_ids
    assert sum(o.spec_decoding["spec_verify_ct"] for o in batch) > 0


def test_penalties_and_min_tokens_see_the_drafts_before_each_row(folder, off):
    """Greedy requests with penalties or min_tokens verify through the sampler's rows (each
    row sees the drafts before it as outputs); plain greedy ones skip the rows. Both, in one
    batch, equal speculation off, with drafts accepted."""
    rng = random.Random(11)
    prompts = _repetitive(rng, 4, 4, 6)
    params = [
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, logprobs=1),
        SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.7,
                       frequency_penalty=0.3),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=12, stop_token_ids=[5, 9]),
        GREEDY,
    ]
    want = _run(off, prompts, params)
    eng = _engine(folder, spec=True, speculative_num_draft_tokens=4)
    _with_oracle(eng, prompts, want)
    got = _run(eng, prompts, params)
    _same(got, want)
    _check_counters(got)
    assert all(o.spec_decoding["spec_accepted_drafts"] > 0 for o in got)
