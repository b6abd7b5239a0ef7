"""DFlash speculation under data-parallel attention + expert-parallel MoE on CPU (gloo), float32:
`-dp 2 --enable-expert-parallel` and `-dp 2 -tp 2 --enable-expert-parallel`.

Each data-parallel rank drafts for its own requests with its own (dense) drafter, no collective
of the expert-parallel group in it; its verify forwards join the MoE exchange like any forward,
and a rank without requests joins them with idle forwards. The drafter's context K/V come from
the target's kept `target_layer_ids` outputs of the rank's own forward (here layers 0 and 2,
both after a sparse MoE layer), on the fixed-shape decode path too. With -tp 2 the DFlash TP
machinery (DRAFT and CONTEXT on the step wire) runs inside each rank's group, and every process
sizes its MoE decode workspace for K + 1 tokens a request (`num_draft_tokens`).

- fast: K for either drafter, one function for the cores and the workers;
- slow: greedy tokens equal one process without speculation; per request the spec metrics
  (verify steps, accepted drafts, histogram) and rank 0's drafts equal one process with the same
  drafter (each request drafts from its own tokens alone, so the rank it runs on changes
  nothing); both ranks verify, drafts accepted, decode-only steps on the fixed path and none
  over the cap; `max_num_seqs=2` makes the workspace size bind (N = min(16, 2 x (1 + 3)) = 8,
  where a worker sized for one token a request would pad its collectives to 2 rows);
- slow: one rank idle for every step of the other's drafting request (rank 0's idle forwards
  counted), tokens and metrics as above.

Every rank's pool passes check_integrity(). The target is the EP tests' tiny Qwen3-MoE (a dense
layer among two sparse ones), the drafter test_dflash_reference's, both with its rigged head
(tokens 1 and 2 win by a sign, so random drafters agree often).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from swaserve import Engine
from swaserve.config import EngineConfig
from swaserve.distributed.ep_tp import attach_worker
from swaserve.engine.speculation import num_draft_tokens
from swaserve.speculative.dflash_config import dflash_config_from_dict
from tests.helpers import save_random_hf_model, tiny_moe_config
from tests.unit.test_dflash_engine import _prompts
from tests.unit.test_dflash_reference import _drafter_raw, _reference, _rig_head, _target_config
from tests.unit.test_expert_parallel import counting_idle_forwards, deadline
from tests.unit.test_expert_parallel_spec import _reference as one_by_one
from tests.unit.test_expert_parallel_spec import run

# the drafter's sizes for the target's (tiny_moe_config): its kept layers 0 and 2 (sparse)
DRAFTER = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_target_layers=3, target_layer_ids=(0, 2))  # fmt: skip
ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16,
              kv_cache_gb=0.01, disable_fused_ops=True)  # fmt: skip
SPEC = dict(speculative_algorithm="dflash", disable_adaptive_speculation=True)  # every step
EP = dict(data_parallel_size=2, enable_expert_parallel=True, max_num_seqs=2)
LAYOUTS = {"dp2": EP, "dp2-tp2": dict(EP, tensor_parallel_size=2)}


# ---- fast ---------------------------------------------------------------------------------------


def test_dflash_under_expert_parallel_is_accepted():
    EngineConfig(**EP, speculative_algorithm="dflash")
    EngineConfig(**LAYOUTS["dp2-tp2"], speculative_algorithm="dflash")


def test_num_draft_tokens_for_either_drafter():
    cfg = dflash_config_from_dict(_drafter_raw("qwen3"), _target_config())  # block_size 4

    def k(**kw) -> int:  # a config as the cores and workers hold it: its budget set
        return num_draft_tokens(EngineConfig(**{"max_num_batched_tokens": 16, **kw}), cfg)

    assert k() == 0
    assert k(speculative_algorithm="ngram") == 4
    assert k(speculative_algorithm="ngram", speculative_num_draft_tokens=7) == 7
    assert k(speculative_algorithm="dflash") == 3
    assert k(speculative_algorithm="dflash", speculative_num_draft_tokens=2) == 2
    # within the token budget: a verify chunk is K + 1 tokens
    assert k(speculative_algorithm="dflash", max_num_batched_tokens=3) == 2
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        k(speculative_algorithm="dflash", speculative_num_draft_tokens=4)


def test_a_worker_sizes_its_workspace_for_dflash_verifies():
    """ep_tp.attach_worker: K + 1 tokens a request with DFlash's K, as its core does."""
    cfg = dflash_config_from_dict(_drafter_raw("qwen3"), _target_config())

    class _EP:
        def attach(self, model, tp):
            pass

        def enable_decode_workspace(self, rows):
            self.rows = rows

    ep = _EP()
    config = EngineConfig(**SPEC, max_num_seqs=2, max_num_batched_tokens=16)
    attach_worker(ep, None, None, config, cfg)
    assert ep.rows == 8  # min(16, 2 x (1 + 3))


# ---- slow: the engines --------------------------------------------------------------------------


def save_moe_target_and_drafter(root: Path) -> tuple[str, str]:
    """The tiny Qwen3-MoE target (its head rigged) and its DFlash drafter, saved under `root`:
    (target folder, drafter folder). Also tests/e2e/test_dflash_ep_server.py's."""
    target = save_random_hf_model(tiny_moe_config(tie_word_embeddings=False), root / "target")
    _rig_head(target)
    target.save_pretrained(root / "target")
    _reference("qwen3", **DRAFTER).save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(target folder, drafter folder)."""
    return save_moe_target_and_drafter(tmp_path_factory.mktemp("dflash-ep"))


@pytest.fixture(scope="module")
def singles(folders):
    """(one process without speculation, one process with the same drafter)."""
    target, drafter = folders
    off = Engine(model=target, **ENGINE)
    one = Engine(model=target, **ENGINE, **SPEC, speculative_draft_model=drafter)
    return off, one


@pytest.fixture(scope="module", params=list(LAYOUTS))
def many(request, folders):
    """The expert-parallel engine of one layout (one alive at a time)."""
    target, drafter = folders
    with deadline(240):
        eng = Engine(model=target, **ENGINE, **SPEC, **LAYOUTS[request.param],
                     speculative_draft_model=drafter)  # fmt: skip
    yield eng
    eng.core.shutdown()


def _recording(core) -> dict:
    """request id -> [(c, drafts)] of every drafter call of `core`'s proposer (rank 0's). Under
    expert parallelism also: no collective of the expert-parallel group (each runs under
    `ep.guard`: the agreement, every MoE layer's exchange) inside a drafter call."""
    seen: dict = {}
    proposer, ep = core.spec.dflash, core.ep
    propose = proposer.propose_on_device  # the host and the device paths both come here
    inside = [False]
    if ep is not None:
        guard = ep.guard

        def guarded():
            assert not inside[0], "an expert-parallel collective inside a drafter forward"
            return guard()

        ep.guard = guarded

    def recorded(reqs, ks, memory, kv):
        inside[0] = True
        try:
            ids = propose(reqs, ks, memory, kv)
        finally:
            inside[0] = False
        for r, k, d in zip(reqs, ks, ids.tolist()):
            seen.setdefault(r.request_id, []).append((r.num_computed_tokens, d[:k]))
        return ids

    proposer.propose_on_device = recorded
    return seen


def _check(got: dict, off: dict, one: dict, reqs: list[tuple]) -> None:
    for rid, *_ in reqs:
        assert got[rid][0] == off[rid][0] == one[rid][0], rid
        assert got[rid][1] == one[rid][1], rid  # verify steps, accepted drafts, histogram


@pytest.mark.slow
def test_tokens_and_drafts_equal_one_process(many, singles):
    off, one = singles
    reqs = [(f"s{i}", p, 20, i % 2) for i, p in enumerate(_prompts())]  # chunked prefill
    seen_one = _recording(one.core)
    want_off, want_one = one_by_one(off, reqs), one_by_one(one, reqs)
    seen_many = _recording(many.core.local)
    got = run(many.core, reqs)
    _check(got, want_off, want_one, reqs)
    assert set(seen_many) == {"s0", "s2"}  # rank 0's requests: the same drafts, step by step
    assert all(seen_many[rid] == seen_one[rid] for rid in seen_many)
    verified = [sum(got[rid][1]["spec_verify_ct"] for rid, *_, r in reqs if r == rank)
                for rank in (0, 1)]  # fmt: skip
    assert min(verified) > 0, verified  # verify steps on both ranks
    assert sum(got[rid][1]["spec_accepted_drafts"] for rid, *_ in reqs) > 0
    assert many.core.local.scheduler.decode_cap == 8
    ranks = many.memory_stats()["ranks"]
    assert all(r["moe_decode_steps"] > 0 and r["moe_decode_over_cap"] == 0 for r in ranks)
    many.core.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("busy", [1, 0])
def test_one_rank_idle_while_the_other_drafts(many, singles, busy):
    """Only rank `busy` has a request: the other joins each of its steps (prefill, verify) with
    an idle forward, and drafts nothing."""
    off, one = singles
    reqs = [("v", _prompts()[1], 30, busy)]  # 23 tokens: two prefill chunks; accepts vary
    seen_one = _recording(one.core)
    want_off, want_one = one_by_one(off, reqs), one_by_one(one, reqs)
    seen_many = _recording(many.core.local)
    with counting_idle_forwards(many.core) as idle:
        got = run(many.core, reqs)
    _check(got, want_off, want_one, reqs)
    spec = got["v"][1]
    assert spec["spec_verify_ct"] > 0 and spec["spec_accepted_drafts"] > 0
    if busy == 1:  # rank 0 idle in every step: prefill chunks, then each verify step
        assert len(idle) >= 2 + spec["spec_verify_ct"] and not seen_many
    else:  # rank 1 idle; rank 0's verify steps padded to the workspace's 8 rows
        assert not idle and seen_many["v"] == seen_one["v"]
    many.core.check_integrity()
