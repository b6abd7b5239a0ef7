"""Speculative decoding (the n-gram drafter) under data-parallel attention + expert-parallel
MoE, 2 ranks on CPU (gloo): each rank drafts for its own requests and its verify steps join
the MoE exchange like any forward (the decode-only ones on the fixed-shape path); a rank
without requests joins them with idle forwards.

Against one process without speculation on a tiny random gpt-oss (sliding layers, sinks,
router and expert biases) in float32: greedy tokens equal, on repetitive prompts so that
drafts are proposed (and some accepted) on both ranks; then one rank idle for every step of
the other's verifying request, both ways round. Every rank's pool passes check_integrity().
"""

from __future__ import annotations

import pytest

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model
from tests.unit.test_expert_parallel import ENGINE, EP, _configs, counting_idle_forwards, deadline

# every step drafts: the tests count verify steps (the gate has its own tests)
SPEC = dict(speculative_algorithm="ngram", speculative_num_draft_tokens=3,
            disable_adaptive_speculation=True)
# repetitive prompts: the n-gram drafter finds their suffixes again
PROMPTS = [[3, 4, 5, 6, 7] * 4, [9, 8, 7] * 5, [20, 21, 22, 23] * 3 + [20, 21], [40, 41] * 7]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(one process without speculation, DP=2 + EP=2 with n-gram speculation)."""
    folder = tmp_path_factory.mktemp("gpt_oss_spec")
    save_random_hf_model(_configs()["gpt_oss"], folder)
    one = Engine(model=str(folder), disable_fused_ops=True, **ENGINE)
    with deadline(120):
        two = Engine(model=str(folder), **EP, **ENGINE, **SPEC)
    yield one, two
    two.core.shutdown()


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def run(core, requests: list[tuple]) -> dict:
    """Requests [(id, prompt ids, max tokens, dp rank)] on an EngineCore (rank ignored) or a
    DPExpertCore, stepped until done: {id: (tokens, the last spec counters or None)}."""
    tokens: dict[str, list[int]] = {}
    spec: dict[str, dict | None] = {}
    for rid, ids, n, rank in requests:
        extra = {"dp_rank": rank} if hasattr(core, "local") else {}
        core.add_request(rid, ids, _params(n), **extra)
        tokens[rid], spec[rid] = [], None
    with deadline(120):
        while core.has_unfinished():
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
                spec[o.request_id] = o.spec or spec[o.request_id]
    return {rid: (tokens[rid], spec[rid]) for rid in tokens}


def _reference(one: Engine, requests: list[tuple]) -> dict:
    out = {}
    for r in requests:
        out.update(run(one.core, [r]))
    return out


def test_greedy_tokens_equal_one_process_without_speculation(engines):
    one, two = engines
    reqs = [(f"s{i}", p, 24, i % 2) for i, p in enumerate(PROMPTS)]
    ref = _reference(one, reqs)
    got = run(two.core, reqs)
    for rid, _, _, _ in reqs:
        assert got[rid][0] == ref[rid][0], rid
    verified = [sum(got[rid][1]["spec_verify_ct"] for rid, *_, r in reqs if r == rank)
                for rank in (0, 1)]  # fmt: skip
    assert min(verified) > 0, verified  # verify steps on both ranks
    assert sum(got[rid][1]["spec_accepted_drafts"] for rid, *_ in reqs) > 0
    ranks = two.memory_stats()["ranks"]
    assert all(r["moe_decode_steps"] > 0 and r["moe_decode_over_cap"] == 0 for r in ranks)
    two.core.check_integrity()


@pytest.mark.parametrize("busy", [1, 0])
def test_one_rank_idle_while_the_other_verifies(engines, busy):
    """Only rank `busy` has a request: the other joins every one of its steps, verify steps
    included, with an idle forward (counted on rank 0 when it is the idle one)."""
    one, two = engines
    reqs = [("v", PROMPTS[0], 30, busy)]
    ref = _reference(one, reqs)
    with counting_idle_forwards(two.core) as idle:
        got = run(two.core, reqs)
    tokens, spec = got["v"]
    assert tokens == ref["v"][0]
    assert spec["spec_verify_ct"] > 0
    if busy == 1:  # rank 0 idle in every step: prefill, then each verify or decode step
        assert len(idle) >= 1 + spec["spec_verify_ct"]
    else:
        assert not idle
    two.core.check_integrity()


def test_cap_below_a_verify_step_is_refused(tmp_path):
    """A cap below K + 1 could never run a verify on the fixed path: an error at start."""
    folder = tmp_path / "m"
    save_random_hf_model(_configs()["gpt_oss"], folder)
    with deadline(120), pytest.raises(ValueError, match=r"--moe-decode-max-tokens-per-rank 3 is "
                                      r"below one verify step's 4 tokens"):  # fmt: skip
        Engine(model=str(folder), **EP, **ENGINE, **SPEC, moe_decode_max_tokens_per_rank=3)
