"""--scheduling-policy priority (engine/scheduler.py, vLLM's): a request's priority (lower
first) then its arrival orders admission, the budget and preemption; under fcfs a priority is
refused. Outputs are those of an unpressured run whatever the order."""

from __future__ import annotations

import pytest

from swaserve import Engine, SamplingParams
from tests.unit.test_scheduler_pressure import (
    GREEDY,
    _engine,
    _prompts,
    folder,  # noqa: F401  (a tiny Gemma 3)
)


def _finish_order(eng: Engine, prompts, priorities, params=GREEDY) -> list[str]:
    core = eng.core
    for i, (p, pr) in enumerate(zip(prompts, priorities)):
        core.add_request(f"r{i}", p, SamplingParams(**{**params.__dict__, "priority": pr}))
    done = []
    while core.has_unfinished():
        for out in core.step():
            if out.finish_reason is not None:
                done.append(out.request_id)
        core.memory.check_integrity()
    return done


def test_admission_follows_priority_then_arrival(folder):  # noqa: F811
    """One request at a time (max_num_seqs 1): they finish in (priority, arrival) order; under
    fcfs in arrival order."""
    prompts = _prompts(5, 10)
    priorities = [0, 5, -1, 5, -1]
    with _engine(folder, scheduling_policy="priority", max_num_seqs=1) as eng:
        assert _finish_order(eng, prompts, priorities) == ["r2", "r4", "r0", "r1", "r3"]
    with _engine(folder, max_num_seqs=1) as eng:
        assert _finish_order(eng, prompts, [0] * 5) == [f"r{i}" for i in range(5)]


def test_preemption_takes_the_lowest_priority_and_outputs_do_not_change(folder):  # noqa: F811
    """A pool too small for every request's growth: the preempted ones are the lowest
    priority's (never the high-priority request), and every output equals an unpressured
    run's."""
    prompts = _prompts(6, 24, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with _engine(folder) as roomy:
        want = [o.outputs[0].token_ids for o in roomy.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]  # fmt: skip
    priorities = [3, 3, 3, 3, 3, -2]  # the last arrives last but matters most
    with _engine(folder, num_pages=64, scheduling_policy="priority",
                 schedule_conservativeness=0.0) as eng:
        core = eng.core
        preempted = []
        orig = core.scheduler._preempt

        def spy(req, batch):
            preempted.append(req.request_id)
            orig(req, batch)

        core.scheduler._preempt = spy
        order = _finish_order(eng, prompts, priorities, params)
        # the same pressure again, through generate: its tokens
        outs = eng.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=[
            SamplingParams(**{**params.__dict__, "priority": p}) for p in priorities])
        got = [o.outputs[0].token_ids for o in outs]
    assert preempted, "the pool was meant to be short"
    assert "r5" not in preempted and order[0] == "r5", (preempted, order)
    assert got == want


def test_a_priority_under_fcfs_is_refused(folder):  # noqa: F811
    with _engine(folder) as eng:
        with pytest.raises(ValueError, match="priority .* --scheduling-policy priority"):
            eng.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(priority=1),
                         use_tqdm=False)  # fmt: skip
        assert not eng.core.has_unfinished()
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=1.5)
