"""Reference attention over the paged pool, in plain torch, for any device.

Per request and group, `prepare` gathers the flat slots of the keys the group keeps: from the
group's window start of the request's first query, `max(0, context_len - window + 1)` (0 for
full groups), to its last new token. Slots below that start may be retired (NULL) and are never
read. Each layer then attends with its own window (`spec.window`), not its group's: a sliding
layer in a full group (`disable_hybrid_kv_cache`, every layer keeps its whole KV) still sees
only `q - window < k <= q`. `forward` takes that layer's key range as a suffix of the group's
slots and builds its mask once per step and window (cached on the metadata). With an FP8 pool
a prefill chunk's own keys and values (the last rows of its request's keys) come from the
step's K/V at full precision, as in the Triton kernel: only the cached prefix is quantised. A
decode token reads its own key from the cache like the rest. The math is torch's fused SDPA
where it applies and pays (`attend_fast`), else the float32 einsums of `attend`, the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from swaserve.attention.base import AttentionBackend, AttentionInputs
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.models.blocks import AttentionSpec

if TYPE_CHECKING:
    from swaserve.attention.kernels.rope_store import QKPrologue


@dataclass
class TorchGroupMetadata:
    slot_mapping: torch.Tensor  # [T] flat slots of the new tokens
    key_start: list[int]  # per request: position of its first kept key (padded[r, 0])
    context_lens: list[int]  # per request: position of its first new token
    seq_lens: list[int]  # per request: context + new tokens
    device: torch.device
    # [R, W]: row r holds the flat slots of the keys the group keeps for request r (positions
    # key_start[r] to seq_lens[r]), then zeros (slot 0 of the NULL page) up to the longest
    padded: torch.Tensor | None = None
    # (request, layer window) -> (visible slots, [q_len, num_keys] bool mask, True = may
    # attend); ("decode", layer window) -> decode_view's batches
    _views: dict[tuple, Any] = field(default_factory=dict)

    def visible(self, r: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots and mask of request r's keys for a layer of `window` (None: full attention)."""
        key = (r, window)
        if key not in self._views:
            ctx, end = self.context_lens[r], self.seq_lens[r]
            start = self._layer_start(r, window)
            qpos = torch.arange(ctx, end)[:, None]
            kpos = torch.arange(start, end)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            kept = self.key_start[r]
            self._views[key] = (self.padded[r, start - kept : end - kept], mask.to(self.device))
        return self._views[key]

    def _layer_start(self, r: int, window: int | None) -> int:
        """Position of request r's first key visible to a layer of `window`."""
        ctx, kept = self.context_lens[r], self.key_start[r]
        start = 0 if window is None else max(0, ctx - window + 1)
        if start < kept:
            raise ValueError(
                f"a layer of window {window} in a group that keeps keys from {kept} only "
                f"(request {r}, context {ctx}): its group's window is narrower"
            )
        return start

    def decode_view(self, window: int | None) -> list[DecodeBatch]:
        """The requests with one new token (decodes) for a layer of `window`, in batches of
        similar key counts (`_decode_batches`): none when fewer than two (the forward batches
        two decodes or more)."""
        key = ("decode", window)
        if key not in self._views:
            n = len(self.seq_lens)
            rows = [r for r in range(n) if self.seq_lens[r] - self.context_lens[r] == 1]
            batches: list[DecodeBatch] = []
            if len(rows) > 1:
                starts = {r: self._layer_start(r, window) for r in rows}
                lens = {r: self.seq_lens[r] - starts[r] for r in rows}
                first = [0]  # query_start_loc: a decode's token is at first[r]
                for r in range(n):
                    first.append(first[-1] + self.seq_lens[r] - self.context_lens[r])
                batches = [self._decode_batch(group, starts, lens, first)
                           for group in _decode_batches(rows, lens)]  # fmt: skip
            self._views[key] = batches
        return self._views[key]

    def _decode_batch(
        self, rows: list[int], starts: dict[int, int], lens: dict[int, int], first: list[int]
    ) -> DecodeBatch:
        offsets = [starts[r] - self.key_start[r] for r in rows]
        n_keys = torch.tensor([lens[r] for r in rows])
        width = int(n_keys.max())
        dev = self.device
        valid = (torch.arange(width)[None, :] < n_keys[:, None]).to(dev)
        picked = self.padded[torch.tensor(rows, device=dev)]
        if any(offsets):  # a layer narrower than its group: each row from its offset
            cols = torch.tensor(offsets)[:, None] + torch.arange(width)[None, :]
            cols = cols.clamp_(max=picked.shape[1] - 1).to(dev)
            slots = picked.gather(1, cols).masked_fill_(~valid, 0)
        else:  # rows hold zeros after their keys already
            slots = picked[:, :width]
        at = torch.tensor([first[r] for r in rows], device=dev)
        return DecodeBatch(rows, slots, valid[:, None, :], at)


@dataclass
class DecodeBatch:
    """Decodes attended in one call: their request indices, their visible slots padded to the
    longest `[R, L]` (padding reads slot 0 of the NULL page), the mask `[R, 1, L]` (True = may
    attend; padding False; a decode token sees every visible key, so the mask only cuts the
    padding) and their rows in the step's tokens `[R]`."""

    rows: list[int]
    slots: torch.Tensor
    mask: torch.Tensor
    at: torch.Tensor


PAD_RATIO = 2  # a decode batch reads at most this many padded keys per key it needs


def _decode_batches(rows: list[int], lens: dict[int, int]) -> list[list[int]]:
    """`rows` split so that padding each batch to its longest costs at most PAD_RATIO x the
    keys it holds: longest first, a row joins the batch while that holds. A 1,500-key decode
    beside six of 40 padded them all to 1,500 (25x the keys needed) in one batch; a batch of
    one is still batched (the caller's `attend_fast`)."""
    batches: list[list[int]] = []
    held = 0  # keys the last batch holds
    for r in sorted(rows, key=lambda r: -lens[r]):
        if batches:
            b = batches[-1]
            width = lens[b[0]]  # the batch's longest: its first
            if width * (len(b) + 1) <= PAD_RATIO * (held + lens[r]):
                b.append(r)
                held += lens[r]
                continue
        batches.append([r])
        held = lens[r]
    return [sorted(b) for b in batches]  # in step order: one batch of every decode needs no pick


@dataclass
class TorchMetadata:
    query_start_loc: list[int]  # [B + 1]
    groups: list[TorchGroupMetadata]


def padded_slots(
    tables: np.ndarray, starts: list[int], ends: list[int], page_size: int
) -> torch.Tensor:
    """[R, max(ends - starts)] flat pool slots of positions [starts[r], ends[r]) of request r
    under page table row tables[r] (`[R, pages]`, zero-padded), zeros after them:
    `slot_mapping` of every request at once. In numpy: a step's few small arrays cost ~2 us an
    op there against ~10-40 in torch (~0.5 ms a step on the CPU before)."""
    width = max((e - s for s, e in zip(starts, ends)), default=0)
    pages = tables.shape[1]
    if width == 0 or pages == 0:
        return torch.zeros(len(tables), width, dtype=torch.int64)
    pos = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(width, dtype=np.int64)
    page = np.take_along_axis(tables, np.minimum(pos // page_size, pages - 1), axis=1)
    out = page.astype(np.int64) * page_size + pos % page_size
    out[pos >= np.asarray(ends, dtype=np.int64)[:, None]] = 0
    return torch.from_numpy(out)


class TorchBackend(AttentionBackend):
    def prepare(self, inputs: AttentionInputs) -> TorchMetadata:
        ps = self.page_size
        qsl = [0]
        for n in inputs.query_lens:
            qsl.append(qsl[-1] + n)
        ctxs = list(inputs.context_lens)
        ends = [c + n for c, n in zip(ctxs, inputs.query_lens)]
        # Token t of the step is request req[t]'s token t - qsl[req[t]], at that request's
        # position ctx + t - qsl: column ctx - start + t - qsl of its row of `padded`.
        lens = np.asarray(inputs.query_lens, dtype=np.int64)
        req = np.repeat(np.arange(len(lens)), lens)
        tok = np.arange(len(req)) - np.asarray(qsl[:-1], dtype=np.int64)[req]
        groups = []
        for g, group in enumerate(self.layout.groups):
            starts = [0 if group.window is None else max(0, c - group.window + 1) for c in ctxs]
            padded = padded_slots(inputs.group_table(g), starts, ends, ps)
            skip = np.asarray([c - s for c, s in zip(ctxs, starts)], dtype=np.int64)
            new_slots = torch.from_numpy(padded.numpy()[req, skip[req] + tok])
            padded = padded.to(self.device)
            groups.append(
                TorchGroupMetadata(
                    new_slots.to(self.device), starts, ctxs, ends, self.device, padded
                )
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
        out: torch.Tensor | None = None,
        prologue: QKPrologue | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # kv_stored (only with k = v = None here): a layer reading another's K/V, already in
        # the pool (KV sharing, GroupLayout.kv_sources); q is rotated
        # a prologue is not asked for here (fuses_qk_prologue False): eager blocks
        if prologue is not None and not kv_stored:
            if prologue.q_norm is not None:
                q, k = prologue.q_norm(q), prologue.k_norm(k)
            q, k = prologue.rotary(fb.positions, q, k)
        meta: TorchMetadata = fb.metadata
        gm = meta.groups[self.layout.layer_to_group[spec.layer_id]]
        if not kv_stored:
            fb.kv.store(spec.layer_id, k, v, gm.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        qsl = meta.query_start_loc
        # Decodes in one batched call (a per-request loop costs more than the math on CPU);
        # they read their own key from the cache like the rest, fp8 included.
        batched: set[int] = set()
        for d in gm.decode_view(spec.window):  # the layer's window
            # `slots` may be a column slice of the batch's padded table (not contiguous)
            keys, vals = fb.kv.read(spec.layer_id, d.slots.reshape(-1))
            shape = (*d.slots.shape, *keys.shape[1:])
            every = len(d.rows) == q.shape[0]  # a pure decode step in one batch: no row to pick
            o = attend_fast(
                (q if every else q[d.at])[:, None], keys.view(shape), vals.view(shape), d.mask,
                spec.scale, spec.softcap, sinks,
            )[:, 0]
            if every:
                out.copy_(o)
            else:
                out[d.at] = o
            batched.update(d.rows)
        rest = [r for r in range(len(qsl) - 1) if r not in batched]
        return self.attend_each(q, k, v, spec, sinks, fb, out, rest)

    def attend_each(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
        fb: ForwardBatch,
        out: torch.Tensor,
        requests: list[int],
    ) -> torch.Tensor:
        """Attend the rows of `requests` one request at a time (K/V already stored) into
        `out`."""
        meta: TorchMetadata = fb.metadata
        gm = meta.groups[self.layout.layer_to_group[spec.layer_id]]
        qsl = meta.query_start_loc
        fp8 = fb.kv.is_fp8
        for r in requests:
            n = qsl[r + 1] - qsl[r]
            slots, mask = gm.visible(r, spec.window)  # the layer's window, not the group's
            keys, vals = fb.kv.read(spec.layer_id, slots)
            # a prefill chunk's own keys (the last rows) at full precision; a KV-sharing layer
            # (k None) reads its source's from the pool
            if fp8 and n > 1 and k is not None:
                keys[-n:] = k[qsl[r] : qsl[r + 1]]
                vals[-n:] = v[qsl[r] : qsl[r + 1]]
            out[qsl[r] : qsl[r + 1]] = attend_fast(
                q[None, qsl[r] : qsl[r + 1]], keys[None], vals[None], mask[None], spec.scale,
                spec.softcap, sinks,
            )[0]
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
    return attend_batched(q[None], k[None], v[None], mask[None], scale, softcap, sinks)[0]


def attend_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attend_batched` (same shapes, same result to ~1e-6) through torch's fused SDPA in
    float32 where it applies: neither soft-capping nor sinks (SDPA has neither). The einsums
    copy the gathered K/V into a head-major layout and build the scores whole; SDPA reads them
    strided. Single-token rows (decodes) go in grouped-query form: each KV head's G query heads
    are G query rows of one SDPA head, so no key is expanded or copied per query head. 2-core
    CPU (RESULTS.md, stops 25 and 26):
    - a 256-token chunk over 1,500 keys, one thread: 67 -> 16 ms with SmolLM2's heads (9 q, 3
      kv, D 64), 43 -> 26 ms with Gemma 3 270M's (4, 1, D 256);
    - 16 decodes over 200 keys, two threads: Gemma's heads 0.61 ms (einsums) -> 0.44, SmolLM2's
      0.58 (SDPA with its GQA expansion) -> 0.49; 8 over 1,532 keys: 2.70 -> 2.30, 3.16 ->
      2.36."""
    r, n, h, d = q.shape
    hkv = k.shape[2]
    if softcap or sinks is not None:
        return attend_batched(q, k, v, mask, scale, softcap, sinks)
    kt, vt = k.float().transpose(1, 2), v.float().transpose(1, 2)  # [R, Hkv, L, D]
    if n == 1:
        o = F.scaled_dot_product_attention(
            q.float().reshape(r, hkv, h // hkv, d),  # query head i -> kv head i // (H // Hkv)
            kt, vt, attn_mask=mask[:, None], scale=scale,  # [R, 1, 1, L], True = may attend
        )  # fmt: skip
        return o.reshape(r, 1, h, d).to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.float().transpose(1, 2),  # [R, H, n, D]
        kt, vt,
        attn_mask=mask[:, None],  # [R, 1, n, L], True = may attend
        scale=scale,
        enable_gqa=hkv != h,  # query head i reads kv head i // (H // Hkv), as in `attend`
    )  # fmt: skip
    return o.transpose(1, 2).to(q.dtype)


def attend_batched(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attend` for R independent requests: q `[R, n, H, D]`, k/v `[R, L, Hkv, D]`, mask
    `[R, n, L]` -> `[R, n, H, D]`. Every row must see at least one key (or have a sink)."""
    b, n, h, d = q.shape
    hkv = k.shape[2]
    qg = q.float().view(b, n, hkv, h // hkv, d)
    s = torch.einsum("bnkgd,blkd->bkgnl", qg, k.float()) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, h // hkv, 1, 1).expand(b, hkv, h // hkv, n, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    o = torch.einsum("bkgnl,blkd->bnkgd", p, v.float())
    return o.reshape(b, n, h, d).to(q.dtype)
