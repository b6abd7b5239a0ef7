"""The fused q/k norm + rotary + K/V store kernel (swaserve/attention/kernels/rope_store.py)
against the eager blocks (RMSNorm, Rotary) and a torch store, on CPU under the interpreter.

Every test name contains `triton`. q, k and v are strided views of one packed projection
output, as in the model. Set SWASERVE_TEST_TRITON_CUDA=1 to run them compiled on a CUDA device.
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from swaserve.attention.kernels import rope_store  # noqa: E402
from swaserve.attention.kernels.rope_store import QKPrologue, qk_rope_store  # noqa: E402
from swaserve.models.blocks import Rotary  # noqa: E402
from tests.kernels.test_triton_ops import DEVICE, _close, _norm, _randn  # noqa: E402

FP8 = torch.float8_e4m3fn
PAGE, PAGES = 4, 12


def _inv_freq(rot: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))


def _encode(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    if cache_dtype == FP8:
        return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)
    return x.to(cache_dtype)


def _case(t, hq, hk, d, dtype, seed):
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=seed) * 2
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype,cache", [(torch.float32, None), (torch.bfloat16, None),
                                         (torch.bfloat16, FP8)])  # fmt: skip
@pytest.mark.parametrize("t", [1, 13])
@pytest.mark.parametrize(
    "hq,hk,d,rot,norm,scale",
    [
        (4, 2, 16, 16, None, 1.0),
        (8, 1, 128, 128, "llama", 1.0),  # Qwen3: q/k norms, weights after rounding
        (3, 1, 80, 40, "gemma", 1.0),  # Gemma 3: 1 + w, partial rotary, odd head count
        (4, 4, 64, 32, None, 1.3466),  # YaRN's attention scaling (gpt-oss)
        (8, 2, 256, 256, "gemma", 1.0),
    ],
)
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head", "all-heads"])
def test_triton_qk_rope_store(hq, hk, d, rot, norm, scale, t, dtype, cache, per_head,
                              monkeypatch):  # fmt: skip
    # one program per (token, head), or one per token for all its q heads and one for its k/v
    monkeypatch.setattr(rope_store, "PER_HEAD_BELOW_TOKENS", 10**9 if per_head else 0)
    cache = cache or dtype
    qkv, q, k, v = _case(t, hq, hk, d, dtype, seed=hq * d + t)
    gen = torch.Generator().manual_seed(3)
    positions = torch.randint(0, 40000, (t,), generator=gen, dtype=torch.int64).to(DEVICE)
    rotary = Rotary(_inv_freq(rot), attention_scaling=scale).to(DEVICE)
    qn = kn = None
    if norm is not None:
        qn = _norm(d, norm == "gemma", dtype, seed=11)
        kn = _norm(d, norm == "gemma", dtype, seed=12)
    # the eager reference: norms, then rotary, on copies
    want_q, want_k = q.clone(), k.clone()
    if qn is not None:
        want_q, want_k = qn(want_q), kn(want_k)
    want_q, want_k = rotary(positions, want_q, want_k)
    v_in, before = v.clone(), qkv.clone()

    k_cache = torch.full((PAGES, PAGE, hk, d), 7.0, device=DEVICE).to(cache)
    v_cache = torch.full((PAGES, PAGE, hk, d), 7.0, device=DEVICE).to(cache)
    slots = torch.randperm(PAGES * PAGE, generator=gen)[:t].to(DEVICE)
    if t > 1:
        slots[t // 2] = -1  # a padded row: rotated in place, never stored
    qk_rope_store(positions, q, k, v, QKPrologue(rotary, qn, kn), k_cache, v_cache, slots,
                  k_scale=0.5, v_scale=0.25)  # fmt: skip

    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(v, v_in)  # v is read, not written
    if qn is None and rot < d:  # pass-through dims stay bit for bit
        assert torch.equal(q[..., rot:], before[:, : hq * d].view(t, hq, d)[..., rot:])
    # the cache holds exactly the kernel's own rotated k, and v, encoded; nothing else changed
    flat_k, flat_v = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)
    real = slots >= 0
    assert torch.equal(flat_k[slots[real]].float(), _encode(k[real], cache, 0.5).float())
    assert torch.equal(flat_v[slots[real]].float(), _encode(v[real], cache, 0.25).float())
    untouched = torch.ones(PAGES * PAGE, dtype=torch.bool, device=DEVICE)
    untouched[slots[real]] = False
    assert (flat_k[untouched].float() == 7.0).all() and (flat_v[untouched].float() == 7.0).all()
