"""DFlash speculation under tensor parallelism on CPU (gloo), 2 ranks, float32: the drafter
sharded like the target, every drafter forward and context K/V store run on both ranks
(swaserve/distributed/dflash_tp.py).

- fast: each rank's drafter shard is its slices of the full drafter's tensors (the target's
  split: KV heads split, or replicated when fewer than T);
- slow: `-tp 2` proposes the very drafts one process proposes with the same drafter, so
  tokens, logprobs and the spec metrics (verify steps, accepted drafts, histogram) equal one
  process's, and tokens and logprobs equal speculation off; through chunked prefill and a
  prefix hit, the pool's integrity checked after every step;
- slow: with FP8 KV the drafter's pool layers' scales, calibrated per rank and agreed, are one
  process's, and greedy tokens equal one process's.

Targets and drafters are test_dflash_reference's tiny ones, reshaped: a Qwen3 target with
one KV head (replicated on both ranks) and a vocabulary of 49, a Gemma 3 target (window 6,
a sliding drafter layer of window 4) with two KV heads (split) and a vocabulary of 51.
"""

from __future__ import annotations

import faulthandler
import random

import pytest
import torch

from swaserve import SamplingParams
from swaserve.distributed.layers import shard_drafter
from swaserve.distributed.parallel_state import TPGroup
from swaserve.speculative.dflash_model import DFlashDrafter, load_dflash_drafter
from tests.helpers import on_dflash_proposals
from tests.unit.test_dflash_engine import _engine, _prompts
from tests.unit.test_dflash_reference import MASK, _reference, _target

SHAPES = {"qwen3": dict(vocab_size=49, num_key_value_heads=1),
          "gemma3": dict(vocab_size=51, num_key_value_heads=2)}  # fmt: skip
DEADLINE_S = 300  # a hung collective ends the run with every thread's traceback


@pytest.fixture(scope="module", params=list(SHAPES))
def folders(request, tmp_path_factory):
    """(target folder, drafter folder, kind)."""
    kind = request.param
    root = tmp_path_factory.mktemp(f"dflash-tp-{kind}")
    _target(kind, **SHAPES[kind]).save_pretrained(root / "target")
    _reference(kind, **SHAPES[kind]).save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter"), kind


def test_drafter_shards_are_slices_of_the_full_tensors(folders):
    target_dir, drafter_dir, kind = folders
    hf = _target(kind, **SHAPES[kind]).config
    full = dict(load_dflash_drafter(drafter_dir, hf, "cpu", torch.float32).named_parameters())
    for rank in range(2):
        tp = TPGroup.layout_only(rank, 2)
        shard = load_dflash_drafter(drafter_dir, hf, "cpu", torch.float32, tp)
        with torch.device("meta"):
            cuts = shard_drafter(DFlashDrafter(shard.cfg), tp)
        assert any(k.endswith("o_proj.weight") for k in cuts)
        for name, p in shard.named_parameters():
            want = cuts[name].take(full[name]) if name in cuts else full[name]
            assert torch.equal(p, want), (rank, name)
        attn = shard.layers[0].self_attn
        assert attn.num_heads == 2 and attn.num_kv_heads == max(1, hf.num_key_value_heads // 2)


def _recording(engine) -> list:
    """Every (committed tokens, c, drafts) rank 0's proposer returns, in order."""
    seen: list = []
    on_dflash_proposals(engine.core.spec.dflash, lambda r, d: seen.append(
        (r.tokens(0, r.num_tokens), r.num_computed_tokens, d)))
    return seen


@pytest.mark.slow
def test_tp2_drafts_tokens_and_metrics_equal_one_process(folders):
    target_dir, drafter_dir, kind = folders
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    kw = dict(max_num_batched_tokens=12, kv_cache_gb=0.002)  # chunked prefill
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)
    rng = random.Random(1)
    first = _prompts()
    # then prompts that share the first ones' prefixes past both windows: prefix hits
    second = [p[:15] + [rng.randrange(3, MASK) for _ in range(4)] for p in first[:2]]
    outs = {}
    two = _engine(target_dir, drafter_dir, tensor_parallel_size=2, **kw)
    try:
        assert two.core.spec.dflash.graphs is None
        seen_two = _recording(two)
        outs["two"] = [two.generate(prompt_token_ids=p, sampling_params=params, use_tqdm=False)
                       for p in (first, second)]
    finally:
        two.core.shutdown()
        faulthandler.cancel_dump_traceback_later()
    one = _engine(target_dir, drafter_dir, **kw)
    seen_one = _recording(one)
    off = _engine(target_dir, None, **kw)
    for name, eng in (("one", one), ("off", off)):
        outs[name] = [eng.generate(prompt_token_ids=p, sampling_params=params, use_tqdm=False)
                      for p in (first, second)]

    assert seen_two and seen_two == seen_one  # the same drafts, step by step
    for batch in range(2):
        for a, b, c in zip(outs["one"][batch], outs["two"][batch], outs["off"][batch],
                           strict=True):
            for x in (a, c):
                assert b.token_ids == x.token_ids
                assert b.outputs[0].finish_reason == x.outputs[0].finish_reason
                lb, lx = b.outputs[0].logprobs, x.outputs[0].logprobs
                assert max(abs(p.logprob - q.logprob) for p, q in zip(lb, lx)) < 1e-4
            assert b.spec_decoding == a.spec_decoding
            assert b.num_cached_tokens == a.num_cached_tokens
    assert all(o.num_cached_tokens >= 12 for o in outs["two"][1])  # hits past both windows
    assert sum(o.spec_decoding["spec_accepted_drafts"] for o in outs["two"][0]) > 0


@pytest.mark.slow
def test_tp2_fp8_kv_scales_and_tokens_equal_one_process(folders):
    """FP8 KV: each rank calibrates the drafter's pool layers on its own heads (the target's
    calibration forward on both ranks), and the largest over the ranks is one process's scale;
    greedy tokens then equal one process's. With a host tier too: each worker builds its tiers
    (their page counts agree) before its drafter (its scales agree), in rank 0's order."""
    target_dir, drafter_dir, _ = folders
    kw = dict(max_num_batched_tokens=12, kv_cache_gb=0.002, kv_cache_dtype="fp8_e4m3",
              host_cache_gb=0.001)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = _prompts()
    faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    two = _engine(target_dir, drafter_dir, tensor_parallel_size=2, **kw)
    try:
        scales_two = (two.core.kv.k_scales, two.core.kv.v_scales)
        got = two.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        two.core.shutdown()
        faulthandler.cancel_dump_traceback_later()
    one = _engine(target_dir, drafter_dir, **kw)
    for a, b in zip((one.core.kv.k_scales, one.core.kv.v_scales), scales_two, strict=True):
        assert b == pytest.approx(a, rel=1e-4)
    want = one.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.spec_decoding["spec_accepted_drafts"] for o in got) > 0
