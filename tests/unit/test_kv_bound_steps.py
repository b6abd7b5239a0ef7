"""Prefill beside decodes under KV pressure (`kv_bound_step_tokens`, engine/scheduler.py): on
a tiny Gemma 3 whose pool holds a few requests while more wait, every step with decodes
carries at most max(page, R - decode tokens) prefill tokens, so later prompts are prefilled
in small chunks beside the decodes instead of in waves; a roomy pool, or a step with nothing
decoding, is never capped. Outputs equal an uncapped run, with the pool's invariants checked
after every step."""

from __future__ import annotations

from swaserve import SamplingParams
from swaserve.engine.scheduler import _decoding
from tests.unit.test_scheduler_pressure import PAGE, _engine, _prompts, folder  # noqa: F401

R = 24
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)


def _run(folder, num_pages: int, r: int):  # noqa: F811
    eng = _engine(folder, num_pages=num_pages)
    core = eng.core
    core.scheduler.kv_bound_step_tokens = r
    steps = []  # (decode tokens, prefill tokens, requests waiting when scheduled)
    schedule = core.scheduler.schedule

    def recorded():
        waiting = len(core.scheduler.waiting)
        decodes = [req for req in core.scheduler.running if _decoding(req)]
        batch = schedule()
        d = p = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            if req in decodes:
                d += n
            else:
                p += n
        steps.append((d, p, waiting))
        core.memory.check_integrity()
        return batch

    core.scheduler.schedule = recorded
    outs = eng.generate(prompt_token_ids=_prompts(10, 40, seed=3), sampling_params=PARAMS,
                        use_tqdm=False)  # fmt: skip
    core.memory.check_integrity()
    got = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    return got, steps, core.scheduler.num_preemptions


def test_kv_bound_steps_cap_prefill_beside_decodes(folder):  # noqa: F811
    want, free_steps, _ = _run(folder, 110, 0)
    got, steps, preempted = _run(folder, 110, R)
    assert [g[0] for g in got] == [w[0] for w in want]
    for (gt, gl), (_, wl) in zip(got, want):
        assert max(abs(a - b) for a, b in zip(gl, wl)) < 1e-4, gt
    # the pool holds ~4-5 of these requests (40 + expected output tokens), fewer than R
    capped = [(d, p) for d, p, waiting in steps if d and waiting]
    assert len(capped) > 10
    assert all(p <= max(PAGE, R - d) for d, p in capped), capped
    assert sum(p > 0 for _, p in capped) > 5, "no prefill rode beside the decodes"
    # uncapped, the same pool prefills whole prompts beside its decodes
    assert any(d and waiting and p > max(PAGE, R - d) for d, p, waiting in free_steps)
    assert preempted <= 2
    # a step with nothing decoding is never capped: the first one takes whole prompts
    assert steps[0][0] == 0 and steps[0][1] > R


def test_kv_bound_steps_leave_a_roomy_pool_alone(folder):  # noqa: F811
    # R = 4: the 110 pages hold more than 4 such requests, so no step is capped
    got, steps, _ = _run(folder, 110, 4)
    want, free_steps, _ = _run(folder, 110, 0)
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [s[:2] for s in steps] == [s[:2] for s in free_steps]
