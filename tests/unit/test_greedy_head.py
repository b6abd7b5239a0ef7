"""The screened greedy head (swaserve/ops/greedy_head.py): its tokens are the float32 head's
argmax (`row_argmax` of F.linear) on inputs built to stress the screen — near-ties the
bfloat16 screen cannot separate, exact ties, all-negative rows, vocabularies not a multiple of
its block, rows of unequal norms — its error bound holds for this CPU's bfloat16 GEMM, the
fallbacks (NaN, overflow, flat logits) give the float32 answer, and an engine's greedy tokens
equal the same engine's without the screen. The screen runs through oneDNN and, where it is
built (AVX512-BF16, a C compiler), through native/bf16_screen.c: both are tested."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from swaserve.ops import cpu_linear, cpu_native
from swaserve.ops import greedy_head as gh
from swaserve.ops.cpu_linear import PackedWeight
from swaserve.ops.greedy_head import GreedyHead, greedy_head_for
from swaserve.sampling.sampler import row_argmax


def _packed(w: torch.Tensor) -> PackedWeight:
    p = PackedWeight(w)
    if not p.gatherable:
        pytest.skip("this torch's oneDNN packs in a layout cpu_linear does not decode")
    return p


pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN in this torch")


def _native_screen() -> bool:
    lib = cpu_native.library()
    return lib is not None and bool(lib.swa_bf16_screen_available())


SCREENS = ["onednn", pytest.param("native", marks=pytest.mark.skipif(
    not _native_screen(), reason="no native bfloat16 screen here"))]  # fmt: skip


@pytest.fixture
def screen(request, monkeypatch):
    """Which GEMM the heads built in the test screen with (the native one takes tables of
    16k x 2j; the others always take oneDNN's)."""
    if request.param == "onednn":
        monkeypatch.setattr(cpu_native, "library", lambda: None)
    return request.param


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return row_argmax(F.linear(x, w))


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
@pytest.mark.parametrize("v,k", [(5, 8), (300, 64), (1024, 96), (4099, 160), (2048, 640)])
def test_tokens_are_the_float32_argmax(screen, v, k):
    g = torch.Generator().manual_seed(v)
    w = torch.randn(v, k, generator=g) * torch.rand(v, 1, generator=g) * 0.3  # unequal norms
    x = torch.randn(24, k, generator=g) * 4
    # Near-ties: a row that copies the argmax's row but for one element, nudged so that its
    # logit is above or below by ~1e-4 of it: far beyond float32's error, far within bf16's.
    top = row_argmax(F.linear(x, w))
    for r in range(0, 24, 3):
        j = (int(top[r]) + 1 + r) % v
        if j == int(top[r]):
            continue
        w[j] = w[top[r]]
        i = int(x[r].abs().argmax())
        w[j, i] += (1 if r % 2 else -1) * 1e-4 * abs(float(F.linear(x[r], w[top[r]]))) / float(
            x[r, i].abs())
    # all-negative rows: x opposite the rows' mean direction
    x[20:] = -w.mean(0) / w.mean(0).norm() * 50 + 0.01 * x[20:]
    head = GreedyHead(_packed(w))
    assert (head.pairs is not None) == (screen == "native" and v % 16 == 0 and k % 2 == 0)
    assert torch.equal(head.tokens(x), _reference(x, w))


def test_exact_ties_go_to_the_lowest_token():
    """Small integers: every logit exact in float32 and in the screen, ties exact."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-3, 4, (700, 32), generator=g).float()
    w[[17, 250, 400, 699]] = 3.0  # four equal rows, the only ones of all 3s
    x = torch.randint(-2, 3, (6, 32), generator=g).float()
    x[0] = 2.0  # row 0's largest logit (192) is shared by tokens 17, 250, 400 and 699
    head = GreedyHead(_packed(w))
    out = head.tokens(x)
    assert torch.equal(out, _reference(x, w))
    assert int(out[0]) == 17


def _worst_case() -> tuple[torch.Tensor, torch.Tensor]:
    """A table and rows where every bfloat16 rounding errs the same way, as far as it can:
    token 7 (A) wins in float32, token 3 (B) in the screen. x is 1 + d (d just under 2^-8:
    rounded to 1) on [0, 32) and 1 on [32, 64); A is 1 + d on [0, 32): exact 32 (1 + d)^2 =
    32.2499, screened 32; B is 1 + 2^-7 (exact in bfloat16) on 24 of [32, 64) and 1 on the
    other 8: 32.1875, rounded to 32.25 on output. A bound too tight (the unit roundoff 2^-11,
    say) drops A."""
    d = 2.0**-8 - 2.0**-20
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(3)) * 0.01
    w[7] = 0.0
    w[7, :32] = 1 + d
    w[3] = 0.0
    w[3, 32:] = 1.0
    w[3, 32:56] = 1 + 2.0**-7
    x = torch.ones(2, 64)
    x[:, :32] = 1 + d
    return w, x


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_worst_case_rounding(screen):
    w, x = _worst_case()
    head = GreedyHead(_packed(w))
    assert (head.pairs is not None) == (screen == "native")
    y = head.logits_screen(x).float()
    assert bool((y[:, 3] >= y[:, 7]).all())  # the screen does not pick A (32.25, 32)
    assert torch.equal(head.tokens(x), torch.tensor([7, 7]))
    assert torch.equal(_reference(x, w), torch.tensor([7, 7]))


@pytest.mark.parametrize("screen", SCREENS, indirect=True)
def test_screen_error_is_within_the_bound(screen):
    """|screen - exact| <= a + b |screen| on every logit (exact: float64), the premise of the
    candidates; checked on this CPU's bfloat16 GEMM, with large and small scales."""
    g = torch.Generator().manual_seed(1)
    # row counts that may take other oneDNN kernels (1: a GEMV), scales far apart
    cases = [(torch.randn(2000, 640, generator=g) * torch.rand(2000, 1, generator=g),
              torch.randn(rows, 640, generator=g) * scale)
             for rows, scale in ((16, 1e-3), (16, 1.0), (16, 300.0), (1, 1.0), (3, 5.0),
                                 (64, 1.0))]
    for w, x in [*cases, _worst_case()]:
        head = GreedyHead(_packed(w))
        assert (head.pairs is not None) == (screen == "native" and w.shape[0] % 16 == 0)
        y = head.logits_screen(x).double()
        exact = x.double() @ w.double().t()
        a = x.double().norm(dim=1, keepdim=True) * head._a_scale + head._a_floor
        assert bool(((y - exact).abs() <= a + head._b * y.abs()).all())


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler here")
@pytest.mark.parametrize("v", [300, 4099, 262144 // 64])  # a short tail block, none
def test_native_candidates_equal_the_torch_ones(v, monkeypatch):
    """native/bf16_screen.c's candidate scan lists exactly the torch code's pairs: peaked,
    flat-ish and all-negative rows, tail blocks, near-ties at the threshold."""
    g = torch.Generator().manual_seed(v)
    w = torch.randn(v, 64, generator=g) * torch.rand(v, 1, generator=g)
    x = torch.randn(12, 64, generator=g) * torch.tensor([0.01, 0.1, 1, 3, 10, 30] * 2)[:, None]
    x[10:] = -w.mean(0) / w.mean(0).norm() * 50  # all-negative rows
    head = GreedyHead(_packed(w))
    y = head.logits_screen(x)
    native = head.candidates(x, y)
    with monkeypatch.context() as m:
        m.setattr(cpu_native, "library", lambda: None)
        want = head.candidates(x, y)
    key = lambda p: sorted(map(tuple, p.tolist()))  # noqa: E731
    assert key(native) == key(want) and native.shape[0] > x.shape[0]
    # Screens of coarse values (many ties and values at the thresholds), rows of positive and
    # negative logits, the bound a about as wide as the values' spread.
    for seed in range(20):
        gs = torch.Generator().manual_seed(seed)
        y = (torch.randint(-40, 40, (6, v), generator=gs) / 8).to(torch.bfloat16)
        y[::2] -= 30  # all-negative rows: the threshold's d < 0 branch
        xs = torch.randn(6, 64, generator=gs)
        xs *= (torch.rand(6, 1, generator=gs) * 3 / head._a_scale) / xs.norm(dim=1, keepdim=True)
        native = head.candidates(xs, y)
        with monkeypatch.context() as m:
            m.setattr(cpu_native, "library", lambda: None)
            assert key(native) == key(head.candidates(xs, y)), seed


def test_fallbacks_give_the_float32_answer(monkeypatch):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(600, 48, generator=g)
    head = GreedyHead(_packed(w))
    x = torch.randn(4, 48, generator=g)
    x[1, 5] = float("nan")  # NaN logits: the first NaN is the argmax
    x[2] *= 1e37  # logits that could overflow
    assert head.candidates(x, head.logits_screen(x)) is None
    assert torch.equal(head.tokens(x), _reference(x, w))
    # flat logits: every token a candidate, more than are rescored
    flat = GreedyHead(_packed(torch.ones(600, 48)))
    monkeypatch.setattr(gh, "_MAX_RESCORED", 100)
    xs = torch.randn(3, 48, generator=g)
    assert flat.candidates(xs, flat.logits_screen(xs)).shape[0] == 1800
    assert torch.equal(flat.tokens(xs), torch.zeros(3, dtype=torch.int64))


def _tiny_gemma(tmp_path, softcap=None):
    from tests.helpers import save_random_hf_model

    cfg = transformers.Gemma3TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"], sliding_window=6,
        query_pre_attn_scalar=16, final_logit_softcapping=softcap,
    )
    save_random_hf_model(cfg, tmp_path)
    return str(tmp_path)


def test_engine_greedy_tokens_with_and_without_the_screen(tmp_path, monkeypatch):
    """Plain greedy steps take the screen (counted), a logprobs request the logits; the tokens
    equal the engine's without the screen (SWASERVE_GREEDY_SCREEN=0). A CPU without
    AVX512-BF16 still runs the screen here (slower, same arithmetic)."""
    from swaserve import Engine, SamplingParams

    if not PackedWeight(torch.randn(1000, 64)).gatherable:
        pytest.skip("this torch's oneDNN packs in a layout cpu_linear does not decode")
    monkeypatch.setattr(gh, "screen_available", lambda: True)
    calls = []
    tokens = GreedyHead.tokens
    monkeypatch.setattr(GreedyHead, "tokens", lambda self, x: calls.append(1) or tokens(self, x))
    folder = _tiny_gemma(tmp_path)
    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (3, 17, 30, 9)]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = []
    for env in ("1", "0"):
        monkeypatch.setenv("SWASERVE_GREEDY_SCREEN", env)
        eng = Engine(model=folder, device="cpu", dtype="float32", kv_cache_gb=0.01, page_size=4)
        assert (eng.core.runner.greedy_head is not None) == (env == "1")
        outs.append([o.token_ids for o in eng.generate(prompt_token_ids=prompts,
                                                       sampling_params=greedy)])
        if env == "1":
            assert len(calls) >= 10  # every sampling step: every request plain greedy
            calls.clear()
            lp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
            eng.generate(prompt_token_ids=prompts[:1], sampling_params=lp)
            assert not calls  # logprobs: the float32 logits
    assert outs[0] == outs[1]


def test_no_screen_for_soft_capped_logits(tmp_path, monkeypatch):
    from swaserve.models.registry import model_class
    from swaserve.ops.cpu_pack import pack_cpu_weights

    monkeypatch.setattr(gh, "screen_available", lambda: True)
    for softcap, expect in ((None, True), (30.0, False)):
        cfg = transformers.Gemma3TextConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, num_hidden_layers=1, query_pre_attn_scalar=16,
            layer_types=["full_attention"], final_logit_softcapping=softcap,
        )
        model = model_class(cfg)(cfg)
        pack_cpu_weights(model)
        if not getattr(model.model.embed_tokens, "packed", None):
            pytest.skip("the tied table stayed dense with this torch's oneDNN")
        assert (greedy_head_for(model) is not None) == expect
