"""Triton attention over the paged pool: the GPU default, a drop-in for TorchBackend
(docs/architecture.md §7).

`prepare` builds the step's metadata on the host (block tables padded with the NULL page,
flat slot mappings, ragged offsets) and copies each tensor to the device once; `forward`
stores the layer's new K/V with `store_kv` and runs `paged_attention` over the layer's cache.
On CPU it runs under the Triton interpreter (`TRITON_INTERPRET=1`, set before triton is
imported), which is how the tests exercise it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from swaserve.attention.base import AttentionBackend, AttentionInputs
from swaserve.attention.kernels.paged_attention import no_split_cap, paged_attention, store_kv
from swaserve.attention.kernels.rope_store import QKPrologue, qk_rope_store
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import GroupLayout
from swaserve.models.blocks import AttentionSpec


@dataclass
class TritonGroupMetadata:
    # [B, max_pages] int32: request r's page table for this group; NULL (0) where retired and
    # past the end of the table. The kernel reads only entries of keys its queries can see.
    block_table: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64 flat slots (page * page_size + offset), new tokens
    # Fixed split-KV count of this group's layers (CUDA graphs: the launch must not depend on
    # the step's lengths; a window bounds the keys, so it splits less); None lets
    # `paged_attention` choose from max_seq_len.
    num_splits: int | None = None
    # [1] int32 on the device (CUDA graphs): the splits this step's batch wants, at most
    # num_splits (set per replay); None: all num_splits
    split_cap: torch.Tensor | None = None


@dataclass
class TritonMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32: request r owns rows [qsl[r], qsl[r + 1])
    seq_lens: torch.Tensor  # [B] int32, context + new tokens
    context_lens: torch.Tensor  # [B] int32, tokens already in the pool
    groups: list[TritonGroupMetadata]
    num_tokens: int
    max_query_len: int  # host copies: tile sizes and split-KV choice need no device sync
    max_seq_len: int
    decode_only: bool  # every request has exactly one new token
    # the shortest query run (host): a batch of decodes beside a prefill chunk takes one
    # attention launch per kind (paged_attention); None: one launch for all
    min_query_len: int | None = None


def _kv_scales(kv: object, layer_id: int) -> tuple[float, float]:
    """Per-layer (k_scale, v_scale) of an FP8 pool (`KVPool.layer_scales`), else (1, 1)."""
    scales = getattr(kv, "layer_scales", None)
    return scales(layer_id) if scales is not None else (1.0, 1.0)


class TritonBackend(AttentionBackend):
    fuses_qk_prologue = True  # q/k norms + rotary + K/V store: one launch (kernels/rope_store.py)

    def __init__(self, layout: GroupLayout, page_size: int, device: torch.device) -> None:
        super().__init__(layout, page_size, device)
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "the triton attention backend needs a CUDA device, or TRITON_INTERPRET=1 set "
                "before triton is imported to run on CPU (slow; for tests)"
            )
        no_split_cap(self.device)  # made here, never first inside a CUDA graph capture

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def prepare(self, inputs: AttentionInputs) -> TritonMetadata:
        ps = self.page_size
        qlens = torch.tensor(inputs.query_lens, dtype=torch.int32)
        ctx = torch.tensor(inputs.context_lens, dtype=torch.int32)
        seq_lens = ctx + qlens
        qsl = torch.zeros(len(qlens) + 1, dtype=torch.int32)
        torch.cumsum(qlens, 0, out=qsl[1:])
        # per new token: its request and position (request-major, as the rows of q)
        req = torch.repeat_interleave(torch.arange(len(qlens)), qlens.long())
        pos = (torch.arange(int(qsl[-1])) - qsl[:-1].long()[req]) + ctx.long()[req]

        groups = []
        for g in range(self.layout.num_groups):
            table = torch.from_numpy(inputs.group_table(g))
            slots = table[req, pos // ps].long() * ps + pos % ps
            groups.append(
                TritonGroupMetadata(self._to_device(table), self._to_device(slots))
            )
        max_q = max(inputs.query_lens, default=0)
        return TritonMetadata(
            query_start_loc=self._to_device(qsl),
            seq_lens=self._to_device(seq_lens),
            context_lens=self._to_device(ctx),
            groups=groups,
            num_tokens=int(qsl[-1]),
            max_query_len=max_q,
            max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
            decode_only=max_q == 1,
            min_query_len=min(inputs.query_lens, default=0),
        )

    def kv_destination(
        self, layer_id: int, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
        """Where this step's new K/V of `layer_id` go: (k_cache, v_cache, flat slots [T],
        k_scale, v_scale), for a kernel that stores them itself (`forward(kv_stored=True)`)."""
        meta: TritonMetadata = fb.metadata
        gm = meta.groups[self.layout.layer_to_group[layer_id]]
        k_cache, v_cache = fb.kv.layer_cache(layer_id)
        return (k_cache, v_cache, gm.slot_mapping, *_kv_scales(fb.kv, layer_id))

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
        meta: TritonMetadata = fb.metadata
        gm = meta.groups[self.layout.layer_to_group[spec.layer_id]]
        k_cache, v_cache, slots, k_scale, v_scale = self.kv_destination(spec.layer_id, fb)
        # kv_stored: q and k rotated, k and v in the cache already (the q/k/v GEMV's epilogue)
        if not kv_stored and prologue is not None:
            qk_rope_store(fb.positions, q, k, v, prologue, k_cache, v_cache, slots, k_scale,
                          v_scale)  # fmt: skip
        elif not kv_stored:
            store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        # Steps with chunks (prefill, mixed, verify) may read the chunks' own keys from k/v,
        # the step's contiguous rows, instead of through the block table: an fp8 cache does
        # (full precision), another where that is faster (paged_attention); decode-only steps
        # (the CUDA graphs) read the cache alone, as the kernel would
        fresh = not meta.decode_only
        return paged_attention(
            q,
            k_cache,
            v_cache,
            gm.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            scale=spec.scale,
            window=spec.window or 0,
            softcap=spec.softcap or 0.0,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
            num_splits=gm.num_splits,
            split_cap=gm.split_cap,
            k_new=k if fresh else None,
            v_new=v if fresh else None,
            out=out,
            min_query_len=meta.min_query_len,
        )
