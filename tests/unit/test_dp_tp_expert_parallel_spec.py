"""N-gram speculation under `-dp 2 -tp 2 --enable-expert-parallel` on CPU (gloo): rank 0 of
each data-parallel rank drafts and accepts for its own requests, its tensor-parallel worker
forwards the same verify chunks, and every process's MoE decode workspace holds K + 1 tokens a
request (ep_tp.attach_worker sizes the workers' as the cores size theirs).

`max_num_seqs=2` makes that size bind: N = min(16, 2 x (1 + 3)) = 8, where a worker sized for
one token a request would pad its fixed-path collectives to 2 rows and the step would fail.
Against one process without speculation on a tiny random gpt-oss in float32: greedy tokens
equal on repetitive prompts, verify steps on both data-parallel ranks, some drafts accepted,
decode-only steps on the fixed path and none over the cap; then one data-parallel rank idle
while the other verifies. Every rank passes check_integrity(). Slow: a four-process engine.
"""

from __future__ import annotations

import pytest

from swaserve import Engine
from tests.helpers import save_random_hf_model
from tests.unit.test_dp_tp_expert_parallel import ENGINE, EP_TP, _configs
from tests.unit.test_expert_parallel import deadline
from tests.unit.test_expert_parallel_spec import PROMPTS, SPEC, _reference, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(one process without speculation, DP=2 x TP=2 + EP=4 with n-gram speculation)."""
    folder = tmp_path_factory.mktemp("gpt_oss_tp_spec")
    save_random_hf_model(_configs()["gpt_oss"], folder)
    one = Engine(model=str(folder), disable_fused_ops=True, **ENGINE)
    with deadline(180):
        four = Engine(model=str(folder), **EP_TP, **ENGINE, **SPEC, max_num_seqs=2)
    yield one, four
    four.core.shutdown()


def test_greedy_tokens_equal_one_process_without_speculation(engines):
    one, four = engines
    assert four.core.local.scheduler.decode_cap == 8
    reqs = [(f"s{i}", p, 24, i % 2) for i, p in enumerate(PROMPTS)]
    ref = _reference(one, reqs)
    got = run(four.core, reqs)
    for rid, *_ in reqs:
        assert got[rid][0] == ref[rid][0], rid
    verified = [sum(got[rid][1]["spec_verify_ct"] for rid, *_, r in reqs if r == rank)
                for rank in (0, 1)]  # fmt: skip
    assert min(verified) > 0, verified  # verify steps on both data-parallel ranks
    assert sum(got[rid][1]["spec_accepted_drafts"] for rid, *_ in reqs) > 0
    ranks = four.memory_stats()["ranks"]
    assert all(r["moe_decode_steps"] > 0 and r["moe_decode_over_cap"] == 0 for r in ranks)
    four.core.check_integrity()


def test_one_rank_idle_while_the_other_verifies(engines):
    """Only data-parallel rank 1 has a request: rank 0's core and worker run idle forwards in
    its verify steps."""
    one, four = engines
    reqs = [("v", PROMPTS[0], 30, 1)]
    got = run(four.core, reqs)
    tokens, spec = got["v"]
    assert tokens == _reference(one, reqs)["v"][0]
    assert spec["spec_verify_ct"] > 0
    four.core.check_integrity()
