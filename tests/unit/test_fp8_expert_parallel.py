"""FP8 KV under data-parallel attention + expert-parallel MoE, 2 ranks on CPU (gloo), float32,
with a DFlash drafter (its pool layers are calibrated too).

Each data-parallel rank calibrates its own pool at start (engine/kv_calibration.py): the same
seeded tokens on every rank, their MoE layers through the exchange, so every rank's per-layer K
and V scales (target and drafter layers) must equal one process's exactly; rank 1's are read
from its own process (its pool's scales written to a file before it serves). And the same
prompts served on either rank (all on one rank at a time, so each rank schedules them as one
process does) give one process's greedy tokens, logprobs within 1e-4 and draft acceptances.

Why the batches matter: with FP8 KV a prefill chunk attends to its own keys at full precision
and to earlier chunks' keys quantised, so a request's logits depend on where its chunk
boundaries fall, i.e. on what else shares the step's token budget. Requests spread over ranks
by load are chunked unlike one process serving all of them, and near-ties (logprob gaps of
1e-4..1e-2 on random weights) can then flip greedy tokens on any rank; one process shows the
same serving a prompt alone or in a batch. That is FP8's precision, not a disagreement between
ranks, and is what these tests rule out.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from swaserve import Engine, SamplingParams
from tests.unit.test_dflash_ep import ENGINE, EP, SPEC, save_moe_target_and_drafter
from tests.unit.test_expert_parallel import deadline, drive

FP8 = dict(ENGINE, kv_cache_dtype="fp8_e4m3", **SPEC)
TOL = 1e-4


def _recording_rank(out: str, rank: int, spec_json: str) -> None:
    """A data-parallel rank's process (ep_worker.worker_main) that writes its pool's FP8
    scales [k_scales, v_scales] to `out` once its core is built, before serving."""
    from swaserve.distributed import ep_worker

    serve = ep_worker.serve_steps

    def record_then_serve(core, wire, rank: int) -> None:  # noqa: ANN001
        Path(out).write_text(json.dumps([core.kv.k_scales, core.kv.v_scales]))
        serve(core, wire, rank)

    ep_worker.serve_steps = record_then_serve
    ep_worker.worker_main(rank, spec_json)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(one process, DP=2 + EP=2, rank 1's scales file), FP8 KV calibrated, DFlash on both."""
    from swaserve.distributed import ep_worker
    from swaserve.distributed.launch import spawn_ranks

    root = tmp_path_factory.mktemp("fp8-ep")
    target, drafter = save_moe_target_and_drafter(root)
    scales = root / "rank1-scales.json"

    def spawn_recording(config, folder, host, port):  # noqa: ANN001
        target_fn = functools.partial(_recording_rank, str(scales))
        return spawn_ranks(config, folder, host, port, range(1, 2), target_fn, "dp")

    with pytest.MonkeyPatch.context() as mp, deadline(240):
        mp.setattr(ep_worker, "spawn_workers", spawn_recording)
        two = Engine(model=target, **FP8, **EP, speculative_draft_model=drafter)
    one = Engine(model=target, **FP8, max_num_seqs=2, speculative_draft_model=drafter)
    yield one, two, scales
    two.core.shutdown()


def test_every_rank_calibrates_one_process_scales(engines):
    one, two, scales_file = engines
    two.memory_stats()  # rank 1 answers: it is serving, so its scales are written
    want = [one.core.kv.k_scales, one.core.kv.v_scales]
    assert len(want[0]) == 5  # 3 target layers, 2 drafter layers
    assert [two.core.local.kv.k_scales, two.core.local.kv.v_scales] == want
    assert json.loads(scales_file.read_text()) == want


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("rank", [1, 0])
def test_prompts_on_either_rank_equal_one_process(engines, rank):
    """Prompts of their own per rank (no prefix hit from the other case), all on `rank`: they
    share its steps as they share one process's (both max_num_seqs=2, 16-token steps)."""
    one, two, _ = engines
    gen = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (23, 5, 30, 17)]
    reqs = [(f"r{rank}-{i}", p, _params(12), rank) for i, p in enumerate(prompts)]
    want, got = _with_spec(one.core, reqs), _with_spec(two.core, reqs)
    for rid, *_ in reqs:
        (tokens, lps, spec), (tokens1, lps1, spec1) = got[rid], want[rid]
        assert tokens == tokens1, rid
        assert max(abs(a - b) for a, b in zip(lps, lps1, strict=True)) < TOL, rid
        assert spec["spec_accepted_drafts"] == spec1["spec_accepted_drafts"], rid
    assert sum(got[rid][2]["spec_accepted_drafts"] for rid, *_ in reqs) > 0
    two.core.check_integrity()


def _with_spec(core, requests: list[tuple]) -> dict:
    """`drive` plus each request's last spec counters: {id: (tokens, logprobs, spec)}."""
    spec: dict = {}
    step = core.step

    def recording_step():
        outs = step()
        for o in outs:
            spec[o.request_id] = o.spec or spec.get(o.request_id)
        return outs

    core.step = recording_step
    try:
        out = drive(core, requests)
    finally:
        del core.step
    return {rid: (out[rid][0], out[rid][1], spec[rid]) for rid in out}
