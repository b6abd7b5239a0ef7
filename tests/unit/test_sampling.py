"""SamplingParams validation, the sampler's masks/penalties/seeds, and raw logprobs (CPU)."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.sampling.logprobs import compute_logprobs
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.sampler import (
    Sampler,
    SamplingRow,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    row_argmax,
)

EOS = 2


def row(prompt=(), output=(), generator=None, **kw) -> SamplingRow:
    params = SamplingParams(**kw)
    if params.seed is not None and generator is None:
        generator = make_generator(params.seed, "cpu")
    return SamplingRow(params, generator, list(prompt), list(output))


def rand_logits(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


# ---- SamplingParams -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("n", 0),
        ("n", True),
        ("min_tokens", -1),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("seed", "42"),
        ("seed", 1.5),
        ("seed", 2**64),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 7),
        ("ignore_eos", 1),
    ],
)
def test_params_reject_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_min_tokens_beyond_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)
    SamplingParams(min_tokens=100)  # max_tokens None: the engine decides


def test_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.max_tokens is None
    assert p.logprobs is None and p.prompt_logprobs is None and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    # Edges of the allowed ranges.
    SamplingParams(top_p=1.0, min_p=1.0, logprobs=0, prompt_logprobs=20, temperature=0)
    SamplingParams(frequency_penalty=-2, presence_penalty=2, repetition_penalty=0.01, seed=-1)


def test_params_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # below SAMPLING_EPS
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8, top_k=2).greedy


def test_params_dict_round_trip_through_msgpack():
    p = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 9],
        max_tokens=64,
        min_tokens=3,
        ignore_eos=True,
        logprobs=5,
        prompt_logprobs=0,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    d = p.to_dict()
    assert all(isinstance(v, (int, float, str, bool, list, type(None))) for v in d.values())
    wire = msgpack.unpackb(msgpack.packb(d), raw=False)
    assert SamplingParams.from_dict(wire) == p
    assert SamplingParams.from_dict(SamplingParams().to_dict()) == SamplingParams()
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({**d, "bogus": 1})


# ---- greedy ----------------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = rand_logits(5, 100)
    out = Sampler()(logits, [row(temperature=0) for _ in range(5)])
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.topk_ids is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_argmax_is_argmax_with_ties_nan_and_inf(dtype):
    """The CPU path (max(dim).indices) picks what aten::argmax picks: the first of tied maxima,
    the first NaN, index 0 of an all -inf row; on strided views and along dim 1 too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (8, 5000), generator=g).to(dtype)  # many ties at the maximum
    x[1, 7] = x[1, 4000] = float("nan")
    x[2] = float("-inf")
    x[3, 4999] = float("inf")
    for t in (x, x[:, ::3], x.t().contiguous().t()):
        assert torch.equal(row_argmax(t), t.argmax(dim=-1))
    y = x.view(8, 5, 1000)
    assert torch.equal(row_argmax(y, dim=1), y.argmax(dim=1))


def test_greedy_fast_path_bf16():
    logits = rand_logits(3, 50).bfloat16()
    out = Sampler()(logits, [row(temperature=0) for _ in range(3)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_1_is_greedy_whatever_the_temperature():
    logits = rand_logits(4, 200, scale=0.5)  # flat: sampling would often miss the argmax
    for step in range(5):
        out = Sampler(seed=step)(logits, [row(temperature=2.0, top_k=1) for _ in range(4)])
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(4, 64, scale=0.1)
    rows = [row(temperature=0), row(temperature=1.0), row(temperature=0), row(seed=3)]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_non_contiguous_logits():
    base = rand_logits(40, 3)  # [V, B]: its transpose is dense but not contiguous
    logits = base.t()
    rows = [row(temperature=0, min_tokens=1, output=[]) for _ in range(3)]
    want = logits.clone()
    want[:, EOS] = -math.inf
    out = Sampler(eos_token_ids=[EOS])(logits, rows)
    assert torch.equal(out.token_ids, want.argmax(-1))


def test_sampler_leaves_logits_untouched():
    logits = rand_logits(3, 40)
    before = logits.clone()
    rows = [
        row(temperature=0.5, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=1.3),
        row(temperature=0, frequency_penalty=1.0, output=[1, 1]),
        row(temperature=1.0, min_tokens=2, stop_token_ids=[0]),
    ]
    Sampler(eos_token_ids=[EOS], seed=0)(logits, rows)
    assert torch.equal(logits, before)


# ---- masks never leak (property tests) ----------------------------------------------------


def allowed_tokens(
    logits: list[float], temperature: float, k: int, p: float, min_p: float, tol: float = 1e-4
) -> torch.Tensor:
    """float64 reference of the kept set, ties included. tol > 0 gives a superset of what the
    float32 sampler may keep; tol < 0 a subset that it must keep (without ties)."""
    x = torch.tensor(logits, dtype=torch.float64) / temperature
    V = x.numel()
    allowed = torch.ones(V, dtype=torch.bool)
    if 0 < k < V:
        kth = x.sort(descending=True).values[k - 1]
        allowed &= x >= kth
    if p < 1.0:
        probs = torch.where(allowed, x, -math.inf).softmax(-1)
        better = torch.stack([probs[x > x[i]].sum() for i in range(V)])  # strictly better mass
        allowed &= better < p + tol
    if min_p > 0.0:
        allowed &= x >= x.max() + math.log(min_p) - tol
    return allowed


logit_lists = st.integers(2, 40).flatmap(
    lambda v: st.lists(st.floats(-8, 8, width=32), min_size=v, max_size=v)
)


@settings(max_examples=60, deadline=None)
@given(
    logits=logit_lists,
    temperature=st.floats(0.2, 2.0),
    k=st.integers(0, 45),
    p=st.floats(0.05, 1.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.01, 1.0)),
    filters=st.sampled_from(["k", "p", "min_p", "all"]),
    seed=st.integers(0, 2**16),
)
def test_filters_never_sample_masked_tokens(logits, temperature, k, p, min_p, filters, seed):
    k = k if filters in ("k", "all") else 0
    p = p if filters in ("p", "all") else 1.0
    min_p = min_p if filters in ("min_p", "all") else 0.0
    allowed = allowed_tokens(logits, temperature, k, p, min_p)
    B = 64  # many draws at once: half unseeded, half with their own seed
    x = torch.tensor([logits] * B)
    params = dict(temperature=temperature, top_k=k, top_p=p, min_p=min_p)
    rows = [row(**params) if i % 2 else row(seed=seed + i, **params) for i in range(B)]
    out = Sampler(seed=seed)(x, rows)
    assert allowed[out.token_ids].all(), (out.token_ids, allowed)


@settings(max_examples=100, deadline=None)
@given(
    logits=st.integers(2, 40).flatmap(
        lambda v: st.lists(st.floats(-8, 8, width=32), min_size=v, max_size=v, unique=True)
    ),
    temperature=st.floats(0.2, 2.0),
    k=st.integers(0, 45),
    p=st.floats(0.05, 1.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.01, 1.0)),
    filters=st.sampled_from(["k", "p", "min_p", "all"]),
)
def test_filter_masks_match_reference(logits, temperature, k, p, min_p, filters):
    """The kept set itself, without sampling noise: between the strict and loose references."""
    k = k if filters in ("k", "all") else 0
    p = p if filters in ("p", "all") else 1.0
    min_p = min_p if filters in ("min_p", "all") else 0.0
    x0 = torch.tensor([logits]) / temperature
    V = x0.shape[1]
    loose = allowed_tokens(logits, temperature, k, p, min_p, tol=1e-4)
    strict = allowed_tokens(logits, temperature, k, p, min_p, tol=-1e-4)
    top_k = torch.tensor([min(k, V)]) if k else None
    # Full sort, and the partial topk where it is allowed (top-p only with top-k).
    for max_top_k in [None] + ([min(k, V)] if k else []):
        x = x0.clone()
        apply_top_k_top_p(x, top_k, torch.tensor([p]) if p < 1.0 else None, max_top_k)
        apply_min_p(x, torch.tensor([min_p]) if min_p > 0 else None)
        kept = x[0].isfinite()
        assert (kept <= loose).all() and (strict <= kept).all(), (max_top_k, kept, strict, loose)
        assert kept[x0[0].argmax()]  # the best token always survives


@pytest.mark.parametrize("seed", range(5))
def test_partial_topk_matches_full_sort(seed):
    V = 300
    x = rand_logits(6, V, seed=seed)
    x[0, :10] = x[0].max() + 1  # ten tied best tokens: top-3 keeps them all
    x[5, :100] = -math.inf  # e.g. masked by min_tokens
    k = torch.tensor([3, V, 1, 50, 40, 200])
    p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 0.999])  # rows using top-p all use top-k
    for top_p in (None, p):
        a, b = x.clone(), x.clone()
        apply_top_k_top_p(a, k, top_p)
        apply_top_k_top_p(b, k, top_p, max_top_k=200)
        assert torch.equal(a, b)
        assert torch.equal(a[1], x[1])  # neither filter: untouched by the partial topk
        assert a[0].isfinite().sum() == 10 and a[2].isfinite().sum() == 1


PROBS = [0.05, 0.5, 0.15, 0.3]  # sorted best first: 1, 3, 2, 0


@pytest.mark.parametrize(
    "k, p, min_p, kept",
    [
        (2, 1.0, 0.0, {1, 3}),
        (3, 1.0, 0.0, {1, 3, 2}),
        (9, 1.0, 0.0, {0, 1, 2, 3}),
        (0, 0.49, 0.0, {1}),
        (0, 0.51, 0.0, {1, 3}),
        (0, 0.79, 0.0, {1, 3}),
        (0, 0.81, 0.0, {1, 3, 2}),
        (0, 1.0, 0.2, {1, 3, 2}),  # threshold 0.1
        (0, 1.0, 0.35, {1, 3}),  # threshold 0.175
        (0, 1.0, 1.0, {1}),
        (3, 0.6, 0.0, {1, 3}),  # top-3 mass 0.95: 0.5 / 0.95 < 0.6, then 0.8 / 0.95 >= 0.6
    ],
)
def test_filter_masks_exact(k, p, min_p, kept):
    x = torch.tensor([PROBS]).log()
    apply_top_k_top_p(
        x,
        torch.tensor([min(k, 4)]) if k else None,
        torch.tensor([p]) if p < 1.0 else None,
    )
    apply_min_p(x, torch.tensor([min_p]) if min_p else None)
    assert set(x[0].isfinite().nonzero()[:, 0].tolist()) == kept


@settings(max_examples=30, deadline=None)
@given(
    v=st.integers(4, 30),
    min_tokens=st.integers(1, 4),
    n_out=st.integers(0, 6),
    ignore_eos=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_min_tokens_masks_eos_and_stop_ids(v, min_tokens, n_out, ignore_eos, seed):
    # eos and the stop id dominate: without the mask they would be picked almost always.
    logits = torch.zeros(16, v)
    logits[:, EOS] = 30.0
    logits[:, 3] = 30.0
    rows = [
        row(
            output=[0] * n_out,
            min_tokens=min_tokens,
            stop_token_ids=[3],
            ignore_eos=ignore_eos,
            temperature=1.0 if i % 2 else 0.0,
        )
        for i in range(16)
    ]
    tokens = Sampler(eos_token_ids=[EOS], seed=seed)(logits, rows).token_ids
    if n_out < min_tokens:
        assert (tokens != 3).all()
        if ignore_eos:
            assert (tokens == EOS).all()  # eos is no stop token then: not masked
        else:
            assert (tokens != EOS).all()
    else:
        assert ((tokens == EOS) | (tokens == 3)).all()


# ---- seeds -------------------------------------------------------------------------------


def run_steps(sampler: Sampler, batches) -> list[torch.Tensor]:
    """batches: per step, (logits [B, V], rows); returns per step the token ids."""
    return [sampler(logits, rows).token_ids for logits, rows in batches]


def test_seeded_row_is_batch_invariant():
    V, steps = 500, 6
    target_logits = [rand_logits(1, V, seed=100 + s, scale=0.5) for s in range(steps)]
    params = dict(temperature=0.9, top_p=0.95, top_k=300, seed=77)

    gen = make_generator(77, "cpu")
    alone = [
        Sampler(seed=0)(target_logits[s], [row(generator=gen, **params)]).token_ids[0]
        for s in range(steps)
    ]

    def in_batch(position: int, sampler_seed: int) -> list[int]:
        gen = make_generator(77, "cpu")
        others = [
            dict(temperature=1.0),
            dict(temperature=0.7, seed=5),
            dict(temperature=0),
            dict(temperature=1.3, top_k=10, seed=77),  # same seed, other params and generator
            dict(temperature=1.0, frequency_penalty=0.5),
        ]
        got = []
        sampler = Sampler(seed=sampler_seed)
        for s in range(steps):
            rows = [row(output=[1, 2], **o) for o in others]
            rows.insert(position, row(generator=gen, **params))
            x = rand_logits(len(rows), V, seed=1000 * sampler_seed + s)
            x[position] = target_logits[s][0]
            got.append(sampler(x, rows).token_ids[position])
        return got

    for position, sampler_seed in [(0, 1), (3, 2), (5, 3)]:
        assert in_batch(position, sampler_seed) == alone


def test_different_seeds_differ_and_same_seed_repeats():
    V, steps = 1000, 8
    logits = torch.zeros(1, V)  # uniform: a collision over 8 steps has odds 1e-24

    def tokens(seed: int) -> list[int]:
        g = make_generator(seed, "cpu")
        return [
            int(Sampler()(logits, [row(seed=seed, generator=g)]).token_ids[0]) for _ in range(steps)
        ]

    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def test_unseeded_rows_follow_sampler_seed():
    logits = torch.zeros(8, 1000)
    rows = [row() for _ in range(8)]
    a = Sampler(seed=5)(logits, rows).token_ids
    assert torch.equal(a, Sampler(seed=5)(logits, rows).token_ids)
    assert not torch.equal(a, Sampler(seed=6)(logits, rows).token_ids)


def test_seed_without_generator_is_an_error():
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.zeros(1, 4), [SamplingRow(SamplingParams(seed=1), None, [], [])])


# ---- distributions -----------------------------------------------------------------------


def chi_square(tokens: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = tokens.numel()
    observed = torch.bincount(tokens, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * n
    keep = expected > 0
    assert observed[~keep].sum() == 0  # nothing drawn where the probability is zero
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_temperature_frequencies_match_softmax():
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n, t = 20000, 0.7
    tokens = Sampler(seed=0)(base.expand(n, -1), [row(temperature=t)] * n).token_ids
    # df = 5: the 99.99% quantile is about 25.7.
    assert chi_square(tokens, (base / t).softmax(-1)) < 26


def test_top_k_top_p_renormalise():
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5])
    n = 20000
    rows = [row(temperature=1.0, top_k=6, top_p=0.8)] * n
    tokens = Sampler(seed=1)(base.expand(n, -1), rows).token_ids
    probs = base[:6].softmax(-1)  # top-6, then the smallest prefix reaching 0.8
    cut = int((probs.cumsum(0) < 0.8).sum()) + 1
    expected = torch.zeros(8)
    expected[:cut] = probs[:cut] / probs[:cut].sum()
    assert chi_square(tokens, expected) < 4 * cut + 10


def test_seeded_rows_sample_from_the_right_distribution():
    base = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 3000
    rows = [row(seed=i, temperature=1.0) for i in range(n)]
    tokens = Sampler()(base.expand(n, -1), rows).token_ids
    assert chi_square(tokens, base.softmax(-1)) < 22  # df = 3, 99.99% about 21.1


# ---- penalties ---------------------------------------------------------------------------


def hand_penalties(logits: list[float], prompt, output, rep: float, freq: float, pres: float):
    out = []
    for tok, x in enumerate(logits):
        if tok in prompt or tok in output:
            x = x / rep if x > 0 else x * rep
        c = output.count(tok)
        x -= freq * c + pres * (c > 0)
        out.append(x)
    return out


def test_penalties_match_hand_formula():
    V = 10
    logits = rand_logits(4, V, seed=3)
    cases = [
        dict(prompt=[1, 2, 2, 9], output=[3, 3, 3, 1], rep=1.3, freq=0.4, pres=0.7),
        dict(prompt=[0, 5], output=[], rep=0.8, freq=0.0, pres=0.0),
        dict(prompt=[4], output=[4, 6, 6, 11], rep=1.0, freq=-0.5, pres=1.5),  # 11: outside V
        dict(prompt=[7], output=[7], rep=1.0, freq=0.0, pres=0.0),
    ]
    rows = [
        row(
            c["prompt"],
            c["output"],
            repetition_penalty=c["rep"],
            frequency_penalty=c["freq"],
            presence_penalty=c["pres"],
        )
        for c in cases
    ]
    t = SamplingTensors.from_rows(rows, V, "cpu")
    x = logits.clone()
    apply_penalties(x, t)
    for i, c in enumerate(cases):
        want = hand_penalties(
            logits[i].tolist(), c["prompt"], c["output"], c["rep"], c["freq"], c["pres"]
        )
        torch.testing.assert_close(x[i], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_presence_penalty_steers_greedy():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    assert Sampler()(logits, [row(temperature=0, output=[0])]).token_ids[0] == 0
    out = Sampler()(logits, [row(temperature=0, output=[0], presence_penalty=0.5)])
    assert out.token_ids[0] == 1
    # Repetition penalty over the prompt alone also counts.
    out = Sampler()(logits, [row(temperature=0, prompt=[0], repetition_penalty=1.2)])
    assert out.token_ids[0] == 1


# ---- logprobs ----------------------------------------------------------------------------


def test_compute_logprobs_against_log_softmax():
    logits = rand_logits(6, 30)  # float32: half would make ties that topk may order either way
    ids = torch.tensor([0, 5, 29, 7, 7, 12])
    chosen, ranks, topk_ids, topk_lp = compute_logprobs(logits, ids, 4)
    ref = torch.log_softmax(logits.double(), -1)
    torch.testing.assert_close(
        chosen.double(), ref.gather(1, ids[:, None])[:, 0], atol=1e-5, rtol=0
    )
    order = ref.argsort(-1, descending=True)
    want_ranks = (order == ids[:, None]).nonzero()[:, 1] + 1
    assert torch.equal(ranks, want_ranks)
    assert torch.equal(topk_ids, order[:, :4])
    torch.testing.assert_close(topk_lp.double(), ref.gather(1, order[:, :4]), atol=1e-5, rtol=0)
    assert chosen.dtype == topk_lp.dtype == torch.float32
    _, _, ids0, lp0 = compute_logprobs(logits, ids, 0)
    assert ids0.shape == lp0.shape == (6, 0)


def test_sampler_logprobs_are_raw_and_sized_by_max_request():
    V = 50
    logits = rand_logits(3, V)
    rows = [
        row(temperature=0.5, logprobs=2, repetition_penalty=1.5, prompt=[1, 2, 3]),
        row(temperature=0),  # asks for nothing, still gets values
        row(temperature=1.2, logprobs=5, top_k=3, seed=4),
    ]
    out = Sampler(seed=0)(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.topk_ids.shape == out.topk_logprobs.shape == (3, 5)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.topk_logprobs, raw.topk(5, -1).values)
    assert out.ranks[1] == 1  # greedy pick


def test_sampler_does_not_read_device_tensors_back(monkeypatch):
    """Stands in for a CUDA sync check on CPU: no .item()/.tolist()/.cpu()/bool() inside."""
    logits = rand_logits(4, 64)
    rows = [
        row(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05, seed=1, logprobs=3),
        row(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3, output=[1, 2]),
        row(temperature=0, presence_penalty=0.2, output=[5], min_tokens=3),
        row(temperature=0.5),
    ]

    def forbidden(*args, **kwargs):
        raise AssertionError("host read-back inside the sampler")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = Sampler(eos_token_ids=[EOS], seed=0)(logits, rows)
    monkeypatch.undo()
    assert out.token_ids.shape == (4,)


def test_top_p_below_float32_resolution_keeps_the_best_token():
    """top_p = 1e-50 is valid (> 0) but is 0.0 in float32: the best token must still survive
    (an empty kept set used to index position -1 and kill the engine core)."""
    from swaserve.sampling.sampler import apply_top_k_top_p

    logits = torch.tensor([[0.5, 2.0, 1.0], [1.0, 1.0, 3.0]])
    apply_top_k_top_p(logits, None, torch.tensor([0.0, 1e-50], dtype=torch.float32))
    assert logits[0].argmax() == 1 and torch.isinf(logits[0]).sum() == 2
    assert logits[1].argmax() == 2 and torch.isinf(logits[1]).sum() == 2
    out = Sampler()(torch.randn(2, 50), [
        SamplingRow(SamplingParams(temperature=1.0, top_p=1e-50, seed=1), make_generator(1, "cpu"),
                    [1], []),
        SamplingRow(SamplingParams(temperature=0.7, top_p=1e-50, top_k=5), None, [1], []),
    ])
    assert out.token_ids.shape == (2,)
