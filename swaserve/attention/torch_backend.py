"""Reference attention over the paged pool, in plain torch, for any device.

Per request and group, `prepare` gathers the flat slots of the keys the request's queries can
see: from the window start of its first query, `max(0, context_len - window + 1)` (0 for full
layers), to its last new token. Slots below that start may be retired (NULL) and are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swaserve.attention.base import AttentionBackend, AttentionInputs, slot_mapping
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.models.blocks import AttentionSpec


@dataclass
class TorchGroupMetadata:
    slot_mapping: torch.Tensor  # [T] flat slots of the new tokens
    kv_slots: list[torch.Tensor]  # per request: flat slots of the visible keys
    masks: list[torch.Tensor]  # per request: [q_len, num_keys] bool, True = may attend


@dataclass
class TorchMetadata:
    query_start_loc: list[int]  # [B + 1]
    groups: list[TorchGroupMetadata]


class TorchBackend(AttentionBackend):
    def prepare(self, inputs: AttentionInputs) -> TorchMetadata:
        ps = self.page_size
        qsl = [0]
        for n in inputs.query_lens:
            qsl.append(qsl[-1] + n)
        groups = []
        for g, group in enumerate(self.layout.groups):
            new_slots, kv_slots, masks = [], [], []
            for r, (n, ctx) in enumerate(zip(inputs.query_lens, inputs.context_lens)):
                table = inputs.page_tables[r][g]
                end = ctx + n
                new_slots.append(slot_mapping(table, ctx, end, ps))
                start = 0 if group.window is None else max(0, ctx - group.window + 1)
                kv_slots.append(slot_mapping(table, start, end, ps).to(self.device))
                qpos = torch.arange(ctx, end)[:, None]
                kpos = torch.arange(start, end)[None, :]
                mask = kpos <= qpos
                if group.window is not None:
                    mask &= kpos > qpos - group.window
                masks.append(mask.to(self.device))
            groups.append(
                TorchGroupMetadata(torch.cat(new_slots).to(self.device), kv_slots, masks)
            )
        return TorchMetadata(qsl, groups)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        meta: TorchMetadata = fb.metadata
        gm = meta.groups[self.layout.layer_to_group[spec.layer_id]]
        fb.kv.store(spec.layer_id, k, v, gm.slot_mapping)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc
        for r in range(len(qsl) - 1):
            keys, vals = fb.kv.read(spec.layer_id, gm.kv_slots[r])
            out[qsl[r] : qsl[r + 1]] = attend(
                q[qsl[r] : qsl[r + 1]], keys, vals, gm.masks[r], spec.scale, spec.softcap, sinks
            )
        return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense attention in float32. q `[n, H, D]`, k/v `[L, Hkv, D]`, mask `[n, L]` -> `[n, H, D]`.

    GQA: query head h reads kv head h // (H // Hkv). Sinks: one extra logit per query head that
    joins the softmax denominator and contributes no value (gpt-oss).
    """
    n, h, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(n, hkv, h // hkv, d)
    s = torch.einsum("nkgd,lkd->kgnl", qg, k.float()) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(hkv, h // hkv, 1, 1).expand(hkv, h // hkv, n, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    o = torch.einsum("kgnl,lkd->nkgd", p, v.float())
    return o.reshape(n, h, d).to(q.dtype)
