"""GPU only (skipped elsewhere): DFlash drafting on CUDA with every graph path on (decode,
verify and piecewise graphs hand the target's layer outputs to the drafter): every draft
equals the `dflash` reference's, and outputs equal speculation off, in float32."""

from __future__ import annotations

import pytest
import torch

from swaserve import Engine, SamplingParams

# The reference (25 kB, pure Python) is not on the GPU machine unless carried: skip, naming it,
# rather than break the collection of tests/gpu.
pytest.importorskip("dflash", reason="the dflash reference package (pip install --no-deps dflash)")
from tests.helpers import on_dflash_proposals  # noqa: E402
from tests.unit.test_dflash_engine import _prompts, _reference_drafts, models  # noqa: E402,F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_dflash_with_cuda_graphs_equals_reference(models):  # noqa: F811
    target_dir, drafter_dir, target, ref, _ = models
    kw = dict(device="cuda", dtype="float32", page_size=4, kv_cache_gb=0.01,
              max_num_batched_tokens=12, cuda_graph_max_bs=4)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    off = Engine(model=target_dir, **kw)
    want = off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    on = Engine(model=target_dir, speculative_algorithm="dflash",
                speculative_draft_model=drafter_dir, disable_adaptive_speculation=True, **kw)
    runner = on.core.runner
    assert runner.graphs is not None and runner.piecewise is not None
    assert runner.verify_graphs is not None
    seen = []
    on_dflash_proposals(on.core.spec.dflash, lambda r, d: seen.append(
        (r.tokens(0, r.num_tokens), r.num_computed_tokens, d)))
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    on.core.memory.check_integrity()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for tokens, c, drafts in seen:
        expect = _reference_drafts(target, ref, tokens, c, len(drafts))
        assert drafts == expect, (c, tokens)
    assert sum(o.spec_decoding["spec_accepted_drafts"] for o in got) > 0
