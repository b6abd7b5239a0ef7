"""GPU only (skipped elsewhere): speculative decoding on CUDA (Triton attention over verify
chunks, CUDA graphs for decode and verify steps, sampling on the device): greedy tokens and
logprobs equal to speculation off, in float32, on a tiny random Gemma 3 with an oracle drafter
(the reference continuation with planted errors: full, partial and zero acceptances) and with
the n-gram drafter on repetitive prompts; a seeded request reproduces alone and in a batch."""

from __future__ import annotations

import random

import pytest
import torch

from swaserve import Engine, SamplingParams
from tests.helpers import save_random_hf_model, tiny_gemma3_config
from tests.unit.test_spec_engine import Oracle, _check_counters, _histogram, _repetitive

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    cfg = tiny_gemma3_config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, eos_token_id=1,
        max_position_embeddings=512,
    )
    out = tmp_path_factory.mktemp("gemma3_spec_cuda")
    save_random_hf_model(cfg, out)
    return str(out)


def _engine(folder: str, **kw) -> Engine:
    return Engine(model=folder, dtype="float32", page_size=16, kv_cache_gb=0.05,
                  cuda_graph_max_bs=8, disable_adaptive_speculation=True, **kw)


def test_greedy_equal_to_speculation_off_on_cuda(folder):
    rng = random.Random(0)
    prompts = _repetitive(rng, 6, 5, 8)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    off = _engine(folder)
    want = off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for drafter in ("ngram", "oracle"):
        on = _engine(folder, speculative_algorithm="ngram", speculative_num_draft_tokens=4)
        if drafter == "oracle":
            on.core.spec.drafter = Oracle({tuple(p): w.token_ids for p, w in zip(prompts, want)})
        graphs = on.core.runner.verify_graphs
        replays = []
        run_chunks = graphs.run_chunks
        graphs.run_chunks = lambda *a, r=replays, f=run_chunks: r.append(1) or f(*a)
        got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert replays, "no verify step ran through a CUDA graph"
        on.core.memory.check_integrity()
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, drafter
            d = max(abs(a.logprob - b.logprob)
                    for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs))
            assert d < 1e-4, (drafter, d)
        _check_counters(got)
        if drafter == "oracle":
            h = _histogram(got)
            assert h[0] > 0 and h[-1] > 0 and sum(h[1:-1]) > 0, h


def test_seeded_sampling_reproduces_on_cuda(folder):
    rng = random.Random(1)
    prompts = _repetitive(rng, 4, 4, 6)
    seeded = [SamplingParams(max_tokens=24, temperature=0.9, seed=5 + i, ignore_eos=True)
              for i in range(len(prompts))]
    eng = _engine(folder, speculative_algorithm="ngram")
    batch = eng.generate(prompt_token_ids=prompts, sampling_params=seeded, use_tqdm=False)
    for i, p in enumerate(prompts):
        alone = eng.generate(prompt_token_ids=[p], sampling_params=seeded[i], use_tqdm=False)[0]
        assert alone.token_ids == batch[i].token_ids


def test_gate_switching_between_verify_graphs_and_overlap_on_cuda(folder):
    """The gate's steps on CUDA: verify steps (read back at once, verify graphs) and plain
    steps (decode graphs, one step in flight) alternate; greedy tokens and logprobs stay those
    of speculation off."""
    from tests.unit.test_spec_gate import _Alternating

    rng = random.Random(2)
    prompts = _repetitive(rng, 5, 4, 7)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    want = _engine(folder).generate(prompt_token_ids=prompts, sampling_params=params,
                                    use_tqdm=False)
    on = Engine(model=folder, dtype="float32", page_size=16, kv_cache_gb=0.05,
                cuda_graph_max_bs=8, speculative_algorithm="ngram",
                speculative_num_draft_tokens=3)
    on.core.spec.gate = _Alternating()
    replays, in_flight = [], []
    graphs = on.core.runner.verify_graphs
    run_chunks = graphs.run_chunks
    graphs.run_chunks = lambda *a: replays.append(1) or run_chunks(*a)
    step = on.core.step

    def watched():
        outs = step()
        on.core.memory.check_integrity()
        in_flight.append(on.core.has_in_flight())
        return outs

    on.core.step = watched
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert replays and any(in_flight)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        d = max(abs(a.logprob - b.logprob)
                for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs))
        assert d < 1e-4, d
    assert sum(o.spec_decoding["spec_verify_ct"] for o in got) > 0
