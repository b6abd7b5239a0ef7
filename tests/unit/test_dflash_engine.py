"""DFlash drafting through the real engine (issue 11): the drafter's context K/V live in the
unified pool, and

- every draft the engine proposes equals the reference drafter's (`dflash` 0.1.0) on the same
  committed tokens, with the target's hidden states from transformers: through chunked
  prefill, verify steps, prefix hits past both windows and preemption (a small pool);
- outputs are lossless: tokens, finish reasons and logprobs equal speculation off, with
  accepted drafts (the targets' heads are rigged so that random drafters agree often);
- the pool's integrity holds after every step.

Tiny float32 targets from test_dflash_reference: Qwen3 (full drafter layers) and Gemma 3
(window 6; a sliding drafter layer of window 4).
"""

from __future__ import annotations

import random

import pytest
import torch
from dflash.model import _draft_value, _raw_input_embeddings

from swaserve import Engine, SamplingParams
from swaserve.speculative.dflash_graphs import DrafterGraphs
from tests.helpers import check_integrity_every_step, on_dflash_proposals
from tests.unit.test_dflash_reference import MASK, _reference, _target

PAGE = 4


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def models(request, tmp_path_factory):
    """(target folder, drafter folder, HF target, reference drafter)."""
    target, ref = _target(request.param), _reference(request.param)
    root = tmp_path_factory.mktemp(f"dflash-engine-{request.param}")
    target.save_pretrained(root / "target")
    ref.save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter"), target, ref, request.param


def _engine(target: str, drafter: str | None, **kw) -> Engine:
    if drafter is not None:
        # every step drafts: the tests compare each draft (the gate: test_spec_gate.py)
        kw.update(speculative_algorithm="dflash", speculative_draft_model=drafter,
                  disable_adaptive_speculation=True)
    eng = Engine(model=target, device="cpu", dtype="float32", page_size=PAGE, **kw)
    return check_integrity_every_step(eng)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, MASK) for _ in range(14)]  # past both windows
    return [shared + [rng.randrange(3, MASK) for _ in range(n)] for n in (3, 9)] + [
        [rng.randrange(3, MASK) for _ in range(n)] for n in (5, 17)
    ]


@torch.no_grad()
def _reference_drafts(target, ref, tokens: list[int], c: int, k: int) -> list[int]:
    """The reference's k drafts for a request committed up to c (tokens[c] the last)."""
    hs = target(torch.tensor([tokens[:c]]), output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in ref.target_layer_ids], dim=-1)
    block = torch.tensor([[tokens[c]] + [MASK] * (ref.block_size - 1)])
    emb = _raw_input_embeddings(target, block, _draft_value(ref.config, "input_embedding_scale",
                                                            1.0))
    pos = torch.arange(c + ref.block_size)[None]
    hidden = ref(position_ids=pos, noise_embedding=emb, target_hidden=feats)[0]
    return ref.compute_logits(hidden[1 : k + 1], target.lm_head).argmax(-1).tolist()


@pytest.mark.parametrize("pool", ["roomy", "tight", "graph-inputs"])
def test_drafts_equal_reference_and_outputs_lossless(models, pool):
    """"graph-inputs": drafting through DrafterGraphs' static buffers (padded batch, widths
    padded to a power of two, stale table rows), run eagerly: on CPU nothing is captured."""
    target_dir, drafter_dir, target, ref, kind = models
    tight = {"qwen3": 0.00005, "gemma3": 0.00004}[kind]  # a few pages short: preemptions
    kw = dict(max_num_batched_tokens=12, kv_cache_gb=tight if pool == "tight" else 0.002,
              schedule_conservativeness=0)  # admit eagerly: the tight pool preempts
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=2)
    prompts = _prompts()
    off = _engine(target_dir, None, **kw)
    want = off.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    on = _engine(target_dir, drafter_dir, **kw)
    proposer = on.core.spec.dflash
    if pool == "graph-inputs":
        proposer.graphs = DrafterGraphs(proposer, on.core.kv, 4, on.core.max_model_len)
        assert proposer.graphs.shapes and not proposer.graphs.graphs
    seen: list[tuple[list[int], int, list[int]]] = []
    on_dflash_proposals(proposer, lambda r, d: seen.append(
        (r.tokens(0, r.num_tokens), r.num_computed_tokens, d)))
    fills = _count_draft_fills(on)
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert fills[0] > 0  # the drafts stayed on the device, into the verify's input ids
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        lg, lw = g.outputs[0].logprobs, w.outputs[0].logprobs
        assert max(abs(a.logprob - b.logprob) for a, b in zip(lg, lw)) < 1e-4
    assert seen
    for tokens, c, drafts in seen:
        assert drafts == _reference_drafts(target, ref, tokens, c, len(drafts)), (c, tokens)
    accepted = sum(o.spec_decoding["spec_accepted_drafts"] for o in got)
    assert accepted > 0
    if pool == "tight":  # the drafter's context is recomputed with the target's
        assert on.core.scheduler.num_preemptions > 0


def _count_draft_fills(engine: Engine) -> list[int]:
    """[n]: steps whose input ids took drafts on the device (Speculation.draft_fill)."""
    spec, count = engine.core.spec, [0]
    fill = spec.draft_fill

    def counted(*a):
        out = fill(*a)
        count[0] += out is not None
        return out

    spec.draft_fill = counted
    return count


def test_drafts_come_to_the_host_for_penalties(models):
    """A live request with a penalty reads its drafts' values before each verify row: the
    step's drafts come to the host, and outputs still equal speculation off."""
    target_dir, drafter_dir = models[:2]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=0.5)
    prompts = _prompts()[:2]
    want = _engine(target_dir, None).generate(prompt_token_ids=prompts, sampling_params=params,
                                              use_tqdm=False)
    on = _engine(target_dir, drafter_dir)
    fills = _count_draft_fills(on)
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert fills[0] == 0 and sum(o.spec_decoding["spec_verify_ct"] for o in got) > 0


def test_bad_dflash_setups_are_clear_errors(models, tmp_path):
    target_dir, drafter_dir = models[:2]
    with pytest.raises(ValueError, match="needs --speculative-draft-model"):
        Engine(model=target_dir, device="cpu", speculative_algorithm="dflash")
    with pytest.raises(ValueError, match="does not exist"):
        Engine(model=target_dir, device="cpu", speculative_algorithm="dflash",
               speculative_draft_model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="speculative-num-draft-tokens 9"):
        Engine(model=target_dir, device="cpu", speculative_algorithm="dflash",
               speculative_draft_model=drafter_dir, speculative_num_draft_tokens=9)


def test_dflash_with_fp8_kv(models):
    """FP8 KV: the drafter's pool layers get scales calibrated on its own context K/V (not the
    1e-6 floor of a layer the target's pass never writes); drafts are accepted, and greedy
    tokens equal FP8 KV without speculation (a verify chunk reads its own keys at full
    precision where a decode reads them from the cache: logprobs agree only roughly)."""
    target_dir, drafter_dir, _, _, kind = models
    kw = dict(max_num_batched_tokens=12, kv_cache_gb=0.002, kv_cache_dtype="fp8_e4m3")
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=1)
    prompts = _prompts()
    want = _engine(target_dir, None, **kw).generate(prompt_token_ids=prompts,
                                                    sampling_params=params, use_tqdm=False)
    on = _engine(target_dir, drafter_dir, **kw)
    kv = on.core.kv
    layers = on.core.spec.dflash.pool_layer_ids
    target_scales = kv.k_scales[: layers[0]]
    for i in layers:
        k, v = kv.layer_scales(i)
        assert 1e-5 < k < 10 and 1e-5 < v < 10, (i, k, v)
    assert min(target_scales) > 1e-5
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids, kind
        d = max(abs(a.logprob - b.logprob) for a, b in zip(g.outputs[0].logprobs,
                                                             w.outputs[0].logprobs))
        assert d < 0.25, d  # measured 0.09 on these random tiny models
    assert sum(o.spec_decoding["spec_accepted_drafts"] for o in got) > 0


def test_drafter_of_another_kv_shape(models, tmp_path):
    """A drafter whose heads differ from the target's (head_dim 16 and 1 KV head against the
    target's 8 and 2): its layers take their own K/V shape in the pool (two widths in one
    page size); drafts equal the reference's and outputs stay lossless."""
    target_dir, _, target, _, kind = models
    ref = _reference(kind, head_dim=16, num_key_value_heads=1)
    ref.save_pretrained(tmp_path)
    kw = dict(max_num_batched_tokens=12, kv_cache_gb=0.002)
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=1)
    prompts = _prompts()
    want = _engine(target_dir, None, **kw).generate(prompt_token_ids=prompts,
                                                    sampling_params=params, use_tqdm=False)
    on = _engine(target_dir, str(tmp_path), **kw)
    layout, proposer = on.core.layout, on.core.spec.dflash
    assert layout.kv_shapes is not None
    assert {layout.kv_shapes[i] for i in proposer.pool_layer_ids} == {(1, 16)}
    seen: list[tuple[list[int], int, list[int]]] = []
    on_dflash_proposals(proposer, lambda r, d: seen.append(
        (r.tokens(0, r.num_tokens), r.num_computed_tokens, d)))
    got = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        d = max(abs(a.logprob - b.logprob) for a, b in zip(g.outputs[0].logprobs,
                                                             w.outputs[0].logprobs))
        assert d < 1e-4
    assert seen
    for tokens, c, drafts in seen:
        assert drafts == _reference_drafts(target, ref, tokens, c, len(drafts)), (c, tokens)


def test_device_tokens_in_chunks():
    """Packed positions of a step's tokens -> a verify graph's rows of q per request."""
    from swaserve.engine.forward_batch import DeviceTokens

    ids = torch.arange(100, 112)
    # chunks of 3, 1 and 4 tokens: packed 0-2, 3, 4-7; drafts at packed 1, 2 and 5, 6, 7
    fill = DeviceTokens([1, 2, 5, 6, 7], [0, 1, 4, 5, 6], ids).in_chunks([3, 1, 4], q=5)
    assert fill.dst == [1, 2, 11, 12, 13]
    input_ids = torch.zeros(15, dtype=torch.long)
    fill.apply(input_ids)
    assert input_ids.tolist() == [0, 100, 101] + [0] * 8 + [104, 105, 106] + [0]
