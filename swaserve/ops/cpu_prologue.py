"""CPU float32: the norms and the attention prologue (q/k norms, rotary) in a few torch ops
(issue 14, item 4), as a removable layer that `cpu_pack.pack_cpu_weights` switches on with the
packed GEMMs (`--disable-fused-ops` keeps the eager reference).

A decode step of Gemma 3 270M ran ~100 torch ops a layer, a third of them for its six RMSNorms
and another quarter for q/k norms and rotary: at ~4 us of dispatch each that is several ms a
step beside ~36 ms of GEMMs. Here, with the same roundings as the eager code (the tests check
bit equality):

- `RMSNorm`: one `torch.rms_norm` with the scale (1 + w) or w precomputed (`cpu_scale`; torch
  2.13 still runs it as several ops inside, but one dispatch from Python);
- q and k, adjacent in the merged q|k|v output, as one `[T, H + Hkv, D]` view: one rms_norm
  and one product by the q and k scales stacked per head, then rotary as
  `x * cos + swap(x) * sin'`, where swap exchanges the two halves of each head and sin' is
  (-sin, sin): the eager rotate_half's products and sums exactly;
- the cos/sin tables once a step per rotary kind (Gemma 3 has two), not once a layer: cached
  on the ForwardBatch (`rope_tables`).

Partial rotary (fewer rotated dims than the head) keeps the eager path. Measured: `cpu_step.py
--runs 3`, alternating with the tree before, 143.0-146.0 -> 146.0-148.2 tok/s (~2%).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swaserve.ops import cpu_native

if TYPE_CHECKING:
    from swaserve.engine.forward_batch import ForwardBatch
    from swaserve.models.blocks import Attention, RMSNorm, Rotary


def norm_scale(norm: RMSNorm) -> torch.Tensor:
    """The float32 factor eager RMSNorm multiplies the normalised rows by: 1 + w or w."""
    w = norm.weight.detach().float()
    return 1.0 + w if norm.unit_offset else w.clone()


def enable(model: torch.nn.Module) -> None:
    """Switch every RMSNorm and fitting Attention of a float32 CPU model to this file's ops."""
    from swaserve.models.blocks import Attention, RMSNorm

    for m in model.modules():
        if isinstance(m, RMSNorm) and not m.fused:
            m.cpu_scale = norm_scale(m)
        elif isinstance(m, Attention) and not m.fused and m.qkv_proj is not None:
            rot = m.rotary
            if 2 * rot.inv_freq_host.shape[0] != m.spec.head_dim:  # partial rotary
                continue
            if m.qk_norm_whole:  # norms over whole projections (OLMo 2/3): the eager split path
                continue
            if m.q_norm is not None and m.q_norm.eps != m.k_norm.eps:
                continue
            s = m.spec
            if m.q_norm is not None:
                m.cpu_qk_scale = torch.cat([
                    norm_scale(m.q_norm).expand(s.num_heads, -1),
                    norm_scale(m.k_norm).expand(s.num_kv_heads, -1),
                ])  # fmt: skip
            m.cpu_prologue = True


def rope_tables(rotary: Rotary, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin') `[T, 1, D]` of this step's positions for `rotary`, computed as the eager
    `Rotary` does, once a step per distinct (inv_freq, scaling)."""
    key = rotary.table_key
    tables = fb.rope_tables.get(key)
    if tables is None:
        freqs = fb.positions.float()[:, None] * rotary.inv_freq_host[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if rotary.attention_scaling != 1.0:
            cos, sin = cos * rotary.attention_scaling, sin * rotary.attention_scaling
        half = freqs.shape[1]
        sin[:, :half].neg_()  # rotate_half's -x2 * sin as x2 * (-sin): the same product
        tables = fb.rope_tables[key] = (cos[:, None, :], sin[:, None, :])
    return tables


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """`x` as rows of its last dimension (a view when it can be) and their stride, for the
    native kernels; None when they do not apply (no library, not float32)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or cpu_native.library() is None:
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows, rows.stride(0)


def rmsnorm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` for a norm with `cpu_scale`: native/norms.c, else one `torch.rms_norm`."""
    r = _rows(x)
    if r is None:
        return torch.rms_norm(x, (x.shape[-1],), norm.cpu_scale, norm.eps)
    rows, stride = r
    out = torch.empty(x.shape, dtype=torch.float32)
    cpu_native.library().swa_rmsnorm(
        out.data_ptr(), rows.data_ptr(), stride, norm.cpu_scale.data_ptr(), norm.eps,
        rows.shape[0], rows.shape[1],
    )  # fmt: skip
    return out


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, x_norm: RMSNorm | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`blocks.add_rmsnorm` in one native pass: (norm(s), s) for s = residual + x_norm(x) (or
    + x); None where the kernel does not apply (the caller's torch ops then)."""
    if norm.cpu_scale is None or (x_norm is not None and x_norm.cpu_scale is None):
        return None
    rx, rr = _rows(x), _rows(residual)
    if rx is None or rr is None or rx[0].shape != rr[0].shape:
        return None
    n, dim = rx[0].shape
    s = torch.empty(residual.shape, dtype=torch.float32)
    normed = torch.empty(residual.shape, dtype=torch.float32)
    xs = cpu_native.ptr(x_norm.cpu_scale) if x_norm is not None else None
    cpu_native.library().swa_add_rmsnorm(
        normed.data_ptr(), s.data_ptr(), rx[0].data_ptr(), rx[1], rr[0].data_ptr(), rr[1], xs,
        x_norm.eps if x_norm is not None else 0.0, norm.cpu_scale.data_ptr(), norm.eps, n, dim,
    )  # fmt: skip
    return normed, s


def qk_prologue(
    attn: Attention, qkv: torch.Tensor, fb: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normed and rotated q `[T, H, D]` and k `[T, Hkv, D]` (new tensors) from the merged
    q|k|v projection output `[T, (H + 2 Hkv) D]`."""
    s = attn.spec
    t, heads, d = qkv.shape[0], s.num_heads + s.num_kv_heads, s.head_dim
    cos, sin = rope_tables(attn.rotary, fb)
    lib = cpu_native.library()
    if (lib is not None and qkv.dtype == torch.float32 and qkv.stride(-1) == 1 and t
            and cos.is_contiguous() and sin.is_contiguous()):
        out = torch.empty(t, heads, d, dtype=torch.float32)
        scale = attn.cpu_qk_scale
        lib.swa_qk_prologue(
            out.data_ptr(), qkv.data_ptr(), qkv.stride(0), cpu_native.ptr(scale),
            attn.q_norm.eps if scale is not None else 0.0, cos.data_ptr(), sin.data_ptr(), t,
            heads, d,
        )  # fmt: skip
        return out[:, : s.num_heads], out[:, s.num_heads :]
    qk = qkv[:, : heads * d].view(t, heads, d)
    if attn.cpu_qk_scale is not None:
        qk = torch.rms_norm(qk, (d,), None, attn.q_norm.eps) * attn.cpu_qk_scale
    swapped = qk.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    out = qk * cos + swapped * sin
    return out[:, : s.num_heads], out[:, s.num_heads :]
