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


def qk_prologue(
    attn: Attention, qkv: torch.Tensor, fb: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normed and rotated q `[T, H, D]` and k `[T, Hkv, D]` (new tensors) from the merged
    q|k|v projection output `[T, (H + 2 Hkv) D]`."""
    s = attn.spec
    t, heads, d = qkv.shape[0], s.num_heads + s.num_kv_heads, s.head_dim
    qk = qkv[:, : heads * d].view(t, heads, d)
    if attn.cpu_qk_scale is not None:
        qk = torch.rms_norm(qk, (d,), None, attn.q_norm.eps) * attn.cpu_qk_scale
    cos, sin = rope_tables(attn.rotary, fb)
    swapped = qk.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    out = qk * cos + swapped * sin
    return out[:, : s.num_heads], out[:, s.num_heads :]
