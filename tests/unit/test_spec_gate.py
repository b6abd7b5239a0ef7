"""The speculation gate (speculative/gate.py): per batch size, draft only where drafting's
measured tokens per second beat plain decoding's, re-measuring the other way now and then;
and in the engine, turning drafting off for a step never changes greedy tokens, while seeded
sampling requests keep drafting (DESIGN §9.1: their tokens must not depend on the batch)."""

from __future__ import annotations

import random

from swaserve import Engine, SamplingParams
from swaserve.speculative import gate as gate_mod
from swaserve.speculative.gate import DraftGate, bucket_of
from tests.helpers import check_integrity_every_step
from tests.unit.test_spec_engine import GREEDY, PAGE, _repetitive, folder  # noqa: F401


def _drive(gate: DraftGate, steps: int, batch: int, on: tuple[float, float],
           off: tuple[float, float]) -> int:
    """`steps` steps at `batch`, drafting costing on = (tokens per request, seconds) a step
    and plain decoding off; returns how many steps drafted."""
    drafted = 0
    for _ in range(steps):
        d = gate.choose(batch)
        tokens, seconds = on if d else off
        gate.record(batch, d, round(tokens * batch), seconds)
        drafted += d
    return drafted


def test_buckets_grow_by_sqrt_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 6, 8, 11, 16)] == [0, 2, 3, 4, 5, 6, 7, 8]
    assert bucket_of(5) == bucket_of(6) and bucket_of(128) != bucket_of(64)


def test_warm_up_measures_both_ways_then_keeps_the_winner():
    g = DraftGate()
    choices = []
    for _ in range(2 * gate_mod.WARMUP):
        d = g.choose(1)
        choices.append(d)
        g.record(1, d, 3 if d else 1, 0.002 if d else 0.001)  # drafting: 1.5x the rate
    assert choices == [True] * gate_mod.WARMUP + [False] * gate_mod.WARMUP
    assert _drive(g, 200, 1, (3, 0.002), (1, 0.001)) >= 195  # explores off a few times


def test_a_losing_drafter_costs_little_and_a_change_is_noticed():
    g = DraftGate()
    # under load drafting commits 1.6 tokens a request in 4x the time: it loses 2.5x
    steps = 4000
    drafted = _drive(g, steps, 128, (1.6, 0.012), (1.0, 0.003))
    assert drafted <= gate_mod.WARMUP + 0.01 * steps  # exploration only
    assert g.stats()[128]["drafts"] is False and g.stats()[128]["interval"] == gate_mod.EXPLORE_MAX
    # the same drafter wins at batch 1, in its own bucket
    assert _drive(g, 100, 1, (1.6, 0.0012), (1.0, 0.0011)) >= 90
    # traffic turns easy (acceptance 4 at 128): within one exploration interval it drafts
    late = _drive(g, gate_mod.EXPLORE_MAX + 50, 128, (4.0, 0.008), (1.0, 0.003))
    assert late >= 40 and g.stats()[128]["drafts"] is True


def test_a_bucket_where_drafts_are_rarely_found_stops_drafting():
    g = DraftGate()
    # batch 1: drafts found and accepted (2.5 tokens a step for 1.5x the time)
    assert _drive(g, 60, 1, (2.5, 0.0015), (1.0, 0.001)) >= 50
    # batch 32: the drafter finds almost nothing, and a step that tried costs 1.3x (no
    # overlap): the bucket's own yield (1.1), not the one batch 1 measured, decides
    assert _drive(g, 400, 32, (1.1, 0.0013), (1.0, 0.001)) <= 2 * gate_mod.WARMUP + 12
    assert g.stats()[32]["drafts"] is False
    assert g.stats()[1]["yield"] >= 2.0 and g.stats()[1]["drafts"] is True  # kept its own


def test_drafts_found_only_after_the_first_steps_still_turn_drafting_on():
    """Batch 1, an answer that starts in its own words and then quotes the prompt: the first
    drafting steps find nothing (1 token for 1.1x the time), later ones commit 2.5 tokens for
    1.2x. The gate must not decide from the first steps, nor let them weigh on for long."""
    g = DraftGate()
    first = _drive(g, 2 * gate_mod.WARMUP, 1, (1.0, 0.0011), (1.0, 0.001))
    assert first == gate_mod.WARMUP
    assert _drive(g, 200, 1, (2.5, 0.0012), (1.0, 0.001)) >= 180
    assert g.stats()[1]["drafts"] is True


def test_slow_first_verify_steps_do_not_turn_drafting_off():
    """On a GPU the first verify step of each new shape captures a graph or compiles a kernel
    (0.3 s here, against ~1 ms steps). Drafting wins 1.6x at batch 1 otherwise: the gate must
    still draft in the second half (it drafted 2 of those 500 steps before OUTLIER)."""
    g = DraftGate()
    slow = {2, 5, 9, 17, 40, 41, 80}  # drafting steps that hit a new shape
    late = n = 0
    for i in range(1000):
        d = g.choose(1)
        if d:
            tok, sec = (2.5, 0.0012) if n % 2 == 0 else (1, 0.0011)
            sec = 0.3 if n in slow else sec
            n += 1
        else:
            tok, sec = 1, 0.001
        g.record(1, d, tok, sec)
        late += d and i >= 500
    assert late >= 450


def test_step_time_average_clips_and_restarts():
    m = gate_mod._Mean()
    m.add_time(0.001, 0.3)
    m.add_time(1.0, 0.3)  # a one-off: counts as OUTLIER x the average
    assert abs(m.value - 0.001 * (1 + 0.5 * (gate_mod.OUTLIER - 1))) < 1e-12
    m = gate_mod._Mean()
    m.add_time(0.3, 0.3)  # the very first step was slow: the next normal one restarts
    m.add_time(0.001, 0.3)
    assert m.value == 0.001 and m.samples == 1


def test_mean_starts_as_the_plain_mean():
    m = gate_mod._Mean()
    for x in (1.0, 2.0, 3.0):
        m.add(x, 0.02)
    assert abs(m.value - 2.0) < 1e-12
    m.add(10.0, 0.02, weight=3)  # three samples at once
    assert abs(m.value - (6.0 + 30.0) / 6) < 1e-12


def _engine(folder: str, **kw) -> Engine:  # noqa: F811
    eng = Engine(model=folder, device="cpu", page_size=PAGE, kv_cache_gb=0.01,
                 speculative_algorithm="ngram", speculative_num_draft_tokens=3, **kw)
    return check_integrity_every_step(eng)


class _Never(DraftGate):
    """A gate whose measurements always say drafting loses."""

    def choose(self, batch_size: int) -> bool:
        return False


def test_engine_gate_off_keeps_greedy_tokens_and_seeded_requests_draft(folder):  # noqa: F811
    rng = random.Random(7)
    prompts = _repetitive(rng, 4, 4, 6)
    off = Engine(model=folder, device="cpu", page_size=PAGE, kv_cache_gb=0.01)
    want = off.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    eng = _engine(folder)
    eng.core.spec.gate = _Never()
    got = eng.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        lg, lw = g.outputs[0].logprobs, w.outputs[0].logprobs
        assert max(abs(a.logprob - b.logprob) for a, b in zip(lg, lw)) < 1e-5
        assert g.spec_decoding["spec_verify_ct"] == 0  # greedy: never drafted
        assert g.spec_decoding["spec_accept_length"] is None
    # seeded sampling requests draft whatever the gate says, and their tokens are those of
    # an engine that drafts at every step, alone and in a batch with greedy requests
    seeded = [SamplingParams(max_tokens=20, temperature=0.8, seed=30 + i, ignore_eos=True)
              for i in range(2)]
    mixed = eng.generate(prompt_token_ids=prompts, use_tqdm=False,
                         sampling_params=seeded + [GREEDY, GREEDY])
    always = _engine(folder, disable_adaptive_speculation=True)
    for i in range(2):
        alone = always.generate(prompt_token_ids=[prompts[i]], sampling_params=seeded[i],
                                use_tqdm=False)[0]
        assert mixed[i].token_ids == alone.token_ids
        assert mixed[i].spec_decoding["spec_verify_ct"] > 0
    assert [o.token_ids for o in mixed[2:]] == [w.token_ids for w in want[2:]]
    assert all(o.spec_decoding["spec_verify_ct"] == 0 for o in mixed[2:])


def test_engine_gate_measures_real_steps(folder):  # noqa: F811
    rng = random.Random(8)
    prompts = _repetitive(rng, 3, 4, 6)
    eng = _engine(folder)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    eng.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    stats = eng.core.spec.gate.stats()
    assert stats[3]["on_samples"] >= gate_mod.WARMUP  # 3 requests decoding together
    assert stats[3]["off_samples"] >= gate_mod.WARMUP
    assert stats[3]["on_seconds"] > 0 and stats[3]["off_seconds"] > 0 and stats[3]["yield"] >= 1
    eng.core.memory.check_integrity()


class _Alternating(DraftGate):
    """Drafting on two steps, off the third: every transition between verify steps (read
    back at once) and overlapped plain steps (one in flight) happens many times."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def choose(self, batch_size: int) -> bool:
        self.calls += 1
        return self.calls % 3 != 0


def test_engine_switching_between_drafting_and_overlap_is_lossless(folder):  # noqa: F811
    rng = random.Random(9)
    prompts = _repetitive(rng, 4, 4, 6) + [[rng.randrange(2, 64) for _ in range(21)]]
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=15, temperature=0, stop_token_ids=[7]),
              GREEDY, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]
    off = Engine(model=folder, device="cpu", page_size=PAGE, kv_cache_gb=0.01)
    want = off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    eng = _engine(folder, max_num_batched_tokens=16)  # chunked prefill
    eng.core.spec.gate = _Alternating()
    assert eng.core.overlap
    in_flight = 0
    step = eng.core.step

    def counting_step():
        nonlocal in_flight
        outs = step()
        in_flight += eng.core.has_in_flight()
        return outs

    eng.core.step = counting_step
    got = eng.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if w.outputs[0].logprobs:
            lg, lw = g.outputs[0].logprobs, w.outputs[0].logprobs
            assert max(abs(a.logprob - b.logprob) for a, b in zip(lg, lw)) < 1e-5
    assert sum(o.spec_decoding["spec_verify_ct"] for o in got) > 0
    assert sum(o.spec_decoding["spec_accepted_drafts"] for o in got) > 0
    assert in_flight > 0  # plain steps overlapped
    assert not eng.core.has_unfinished()
