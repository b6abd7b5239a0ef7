"""OpenAI's `logit_bias` (SamplingParams.logit_bias): validated, carried over msgpack, added to
the logits before penalties and sampling, and equal to transformers' `sequence_bias` on the
same weights (greedy, with prompts past Gemma 3's window, biased and unbiased rows in one
batch, n-gram speculation on). vLLM's `allowed_token_ids`, a mask of the same kind, too.
The server's side: tests/e2e/test_server.py::test_logit_bias."""

from __future__ import annotations

import msgpack
import pytest
import torch

from swaserve import Engine, SamplingParams
from swaserve.engine.limits import PromptError, check_vocab_ids
from swaserve.sampling.sampler import Sampler, SamplingRow
from tests.helpers import check_integrity_every_step, save_random_hf_model, tiny_gemma3_config


def test_params_normalise_validate_and_cross_msgpack():
    p = SamplingParams(logit_bias={"5": 1, 7: -100.0})
    assert p.logit_bias == {5: 1.0, 7: -100.0}
    wire = msgpack.unpackb(msgpack.packb(p.to_dict()), raw=False)  # string map keys only
    assert SamplingParams.from_dict(wire).logit_bias == {5: 1.0, 7: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad, what in [({"a": 1}, "keys"), ({-1: 1}, "keys"), ({"٣": 1}, "keys"),
                      ({5: 100.5}, "values"), ({5: float("nan")}, "values"),
                      ({5: True}, "values"), ([1, 2], "map")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"logit_bias.*{what}"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(PromptError, match="logit_bias must name token ids below .* 256, got 256"):
        check_vocab_ids(SamplingParams(logit_bias={3: 1, 256: 1}), 256)


def test_sampler_adds_the_bias_per_row():
    torch.manual_seed(0)
    V = 64
    logits = torch.randn(4, V)
    top = logits.argmax(-1).tolist()
    rows = [
        SamplingRow(SamplingParams(temperature=0, logit_bias={top[0]: -100}), None, [1], []),
        SamplingRow(SamplingParams(temperature=0), None, [1], []),  # untouched beside them
        SamplingRow(SamplingParams(temperature=1.0, seed=3, logit_bias={9: 100}),
                    torch.Generator().manual_seed(3), [1], []),  # fmt: skip
        SamplingRow(SamplingParams(temperature=0, logit_bias={11: 2.5}), None, [1], []),
    ]
    want = logits.clone()
    want[0, top[0]] -= 100
    want[2, 9] += 100
    want[3, 11] += 2.5
    out = Sampler()(logits, rows).token_ids.tolist()
    assert out[0] == want[0].argmax().item() != top[0]
    assert out[1] == top[1] and out[2] == 9 and out[3] == want[3].argmax().item()
    target = Sampler().target_logits(logits, rows)  # what drafts are verified against
    for i in (0, 1, 3):
        torch.testing.assert_close(target[i], want[i], rtol=0, atol=0)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("logit-bias-gemma3")
    model = save_random_hf_model(tiny_gemma3_config(), folder)
    model.generation_config.eos_token_id = None  # ignore_eos on both sides
    return str(folder), model


@torch.no_grad()
def _hf_greedy(model, prompt: list[int], n: int, bias: dict[int, float] | None) -> list[int]:
    seq = {(t,): b for t, b in bias.items()} if bias else None
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, sequence_bias=seq)  # fmt: skip
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_sequence_bias(gemma):
    folder, model = gemma
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 40, 31)]
    n = 10
    plain = [_hf_greedy(model, p, n, None) for p in prompts]
    biases = [
        {plain[0][0]: -3.0, plain[0][3]: -100.0, 17: 1.5},  # moves its first token
        None,  # an unbiased row in the same batch
        {plain[2][0]: -100.0, **{t: 2.0 for t in range(100, 120)}},
    ]
    want = [_hf_greedy(model, p, n, b) for p, b in zip(prompts, biases)]
    assert want[0] != plain[0] and want[2] != plain[2], "the biases change nothing: no test"
    for extra in ({}, {"speculative_algorithm": "ngram", "disable_adaptive_speculation": True}):
        eng = check_integrity_every_step(
            Engine(model=folder, device="cpu", dtype="float32", kv_cache_gb=0.02, page_size=8,
                   max_num_batched_tokens=24, **extra))  # fmt: skip
        # no logprobs: a biased row alone must take the CPU engine off its plain greedy head
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logit_bias=b)
                  for b in biases]  # fmt: skip
        got = eng.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in got] == want, extra
        if extra:
            assert sum(o.spec_decoding["spec_verify_ct"] for o in got) > 0
        eng.shutdown()


def test_engine_refuses_ids_past_the_vocabulary(gemma):
    folder, _ = gemma
    with Engine(model=folder, device="cpu", dtype="float32", kv_cache_gb=0.01) as eng:
        with pytest.raises(ValueError, match="logit_bias must name token ids below"):
            eng.generate(prompt_token_ids=[[5, 6]],
                         sampling_params=SamplingParams(max_tokens=2, logit_bias={256: 1}))


def test_allowed_token_ids(gemma):
    """Only the allowed ids are sampled (greedy: the best of them by the raw logits, which
    transformers gives with every other id biased by -inf), beside an unrestricted row."""
    folder, model = gemma
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (7, 33)]
    allowed = [40, 41, 42, 200]
    ban = {t: -1e9 for t in range(256) if t not in allowed}
    want = _hf_greedy(model, prompts[0], 6, ban)
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    with Engine(model=folder, device="cpu", dtype="float32", kv_cache_gb=0.02) as eng:
        params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                 allowed_token_ids=allowed),
                  SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True,
                                 allowed_token_ids=[7, 9])]  # fmt: skip
        got = eng.generate(prompt_token_ids=prompts + prompts[:1], sampling_params=params,
                           use_tqdm=False)  # fmt: skip
        plain = eng.generate(prompt_token_ids=prompts[1:], sampling_params=params[1],
                             use_tqdm=False)  # fmt: skip
        with pytest.raises(ValueError, match="allowed_token_ids must name token ids below"):
            eng.generate(prompt_token_ids=[[5]], sampling_params=SamplingParams(
                allowed_token_ids=[256]))
    assert got[0].outputs[0].token_ids == want
    assert got[1].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert set(got[2].outputs[0].token_ids) <= {7, 9}
