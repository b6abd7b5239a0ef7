"""CUDA graphs for decode steps (`--cuda-graph-max-bs`, 0 disables): a removable layer.

One graph per bucketed batch size captures model forward + logits for `bs` requests with `q`
new tokens each: q = 1 for decode, q = K + 1 for the verify chunks of speculative decoding
([last, d_1..d_K], fewer drafts padded). Inputs and the Triton metadata live in static device
buffers that every replay overwrites in place:

    requests [0, n)   real: tokens, positions, page tables, slots, seq_len = start + q;
                      a chunk shorter than q is padded at its end with slot -1 tokens, which
                      only padding rows read (causal) and whose logits the caller drops
    requests [n, bs)  padding: slot -1 (the store kernel skips it), seq_len q over the NULL
                      page (all-zero table row), so they read finite keys and write nothing

Key splits (split-KV): a replayed launch cannot change its grid, so a bucket's grid holds the
most splits any batch it serves may want (`choose_num_splits` over its batch sizes at the
longest context, per KV group: a window bounds the keys). Each replay writes the count this
step's batch wants (its real size and longest context, `SplitRule`) to a device int that the
kernel reads (`split_cap`): 17 requests in the 32-request bucket split as 17 would. Only the
Triton backend is captured; eager is the fallback.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch import nn

from swaserve.attention.kernels.paged_attention import (
    _num_sms,
    attention_config,
    choose_num_splits,
)
from swaserve.attention.triton_backend import TritonBackend, TritonGroupMetadata, TritonMetadata
from swaserve.engine.forward_batch import DeviceTokens, ForwardBatch
from swaserve.memory.kv_pool import KVPool

log = logging.getLogger(__name__)


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Around CUDA graph captures: collect garbage first, then none until the captures end.
    A collection during a capture can free an earlier engine's graphs (tests build many), and
    destroying a graph while a stream captures is not permitted: the capture fails with
    "operation not permitted when stream is capturing" (seen on the H200 as an
    order-dependent test failure)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class SplitRule:
    """Key splits per KV group of a decode or verify graph's attention (`choose_num_splits`):
    `rule(n, kv_len)` for a replay of n requests whose longest holds kv_len keys, `grid(sizes)`
    the most over a bucket's batch sizes at the longest context, `longest`. A window bounds a
    group's keys (window + q - 1 for q queries).

    With fewer programs than two per SM the replay keeps the split count of the longest
    context: the kernel then gives each split an equal share of a block's tiles, down to one
    tile, and such short dependent walks are what batch-1 latency wants. One split of four
    tiles (the count `choose_num_splits` gives 256 keys) made batch-1 Llama-8B decode 2.4%
    slower on the H200 (4.30 against 4.20 ms/token, benchmarks/RESULTS.md stop 27). Busier
    SMs split by the real context (splits of >= BALANCE_SPLIT_KEYS keys)."""

    def __init__(
        self, num_kv_heads: int | list[int], q: int, block_q: int | list[int], num_sms: int,
        windows: list[int | None], longest: int,
    ) -> None:  # fmt: skip
        """`num_kv_heads` and `block_q` per group where the groups' K/V shapes differ (Gemma 4)."""
        n = len(windows)
        self.hkvs = num_kv_heads if isinstance(num_kv_heads, list) else [num_kv_heads] * n
        self.block_qs = block_q if isinstance(block_q, list) else [block_q] * n
        self.hkv, self.q, self.num_sms = min(self.hkvs), q, num_sms
        self.windows, self.longest = windows, longest

    def __call__(self, n: int, kv_len: int) -> list[int]:
        if n * self.hkv < 2 * self.num_sms:
            kv_len = self.longest
        return [
            choose_num_splits(n, hkv, self.q, kv_len if w is None else
                              min(kv_len, w + self.q - 1), bq, self.num_sms)
            for w, hkv, bq in zip(self.windows, self.hkvs, self.block_qs, strict=True)
        ]  # fmt: skip

    def grid(self, batch_sizes: range) -> list[int]:
        """Per group, the most splits any of `batch_sizes` wants (at the longest context: more
        keys never want fewer splits)."""
        return [max(c) for c in zip(*(self(n, self.longest) for n in batch_sizes), strict=True)]


def batch_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({b for b in sizes if b <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: TritonBackend,
        kv: KVPool,
        max_bs: int,
        max_model_len: int,
        spec_shape: tuple[int, int, int],  # (num_heads, num_kv_heads, head_dim)
        tokens_per_request: int = 1,
        keep_layers: tuple[int, ...] = (),  # layer outputs captured too (DFlash), in order
        # run after the model inside the graph with (batch, kept outputs): DFlash stores its
        # drafter's context K/V there (padding rows have slot -1: stored nowhere)
        after: Callable[[ForwardBatch, torch.Tensor], None] | None = None,
    ) -> None:
        self.model, self.backend, self.kv = model, backend, kv
        dev = backend.device
        self.q = q = tokens_per_request
        self.buckets = batch_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.page_size = backend.page_size
        self.max_pages = math.ceil((max_model_len + q) / self.page_size)
        ngroups = backend.layout.num_groups
        rows = self.max_bs * q
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        # [split caps per group | seq_lens]: one copy per replay writes both
        self.ints = torch.full((ngroups + self.max_bs,), q, dtype=torch.int32, device=dev)
        self.split_caps = self.ints[:ngroups]
        self.seq_lens = self.ints[ngroups:]
        self.qsl = torch.arange(self.max_bs + 1, dtype=torch.int32, device=dev) * q
        self.tables = [
            torch.zeros(self.max_bs, self.max_pages, dtype=torch.int32, device=dev)
            for _ in range(ngroups)
        ]
        self.slots = [
            torch.full((rows,), -1, dtype=torch.int64, device=dev) for _ in range(ngroups)
        ]
        h = spec_shape[0]
        # each group's own K/V shape (they differ where GroupLayout.kv_shapes is set)
        shapes = [tuple(kv.layer_cache(g.layers[0])[0].shape[2:]) for g in backend.layout.groups]
        self.want = SplitRule(
            [hkv for hkv, _ in shapes], q,
            [attention_config(d, h // hkv, q).block_q for hkv, d in shapes], _num_sms(dev),
            [g.window for g in backend.layout.groups], max_model_len + q - 1,
        )  # fmt: skip
        # per bucket, per group: the grid's splits, the most any batch of the bucket may want
        self.splits: dict[int, list[int]] = {}
        smaller = 0
        for bs in self.buckets:
            self.splits[bs] = self.want.grid(range(smaller + 1, bs + 1))
            smaller = bs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.keep_layers = keep_layers
        self.after = after
        self.kept: dict[int, torch.Tensor] = {}  # bucket -> [bs * q, len(keep) * hidden]
        self.last_bucket: int | None = None
        self.pool = None

    def _batch(self, bs: int) -> ForwardBatch:
        t = bs * self.q
        meta = TritonMetadata(
            query_start_loc=self.qsl[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.seq_lens[:bs],  # unused by the kernels
            groups=[
                TritonGroupMetadata(tb[:bs], s[:t], n, self.split_caps[g : g + 1])
                for g, (tb, s, n) in enumerate(
                    zip(self.tables, self.slots, self.splits[bs], strict=True)
                )
            ],
            num_tokens=t,
            max_query_len=self.q,
            max_seq_len=self.max_pages * self.page_size,
            decode_only=self.q == 1,
        )
        return ForwardBatch(
            self.input_ids[:t], self.positions[:t], self.backend, meta, self.kv,
            keep_layers=frozenset(self.keep_layers),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with no_collection(), torch.cuda.stream(stream):
            for bs in reversed(self.buckets):  # largest first: smaller ones reuse its pool
                fb = self._batch(bs)
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    self.model.compute_logits(self.model(fb))
                    if self.after is not None and self.keep_layers:
                        self.after(fb, self._kept(fb))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self.model.compute_logits(self.model(fb)).float()
                    if self.keep_layers:
                        self.kept[bs] = self._kept(fb)
                        if self.after is not None:
                            self.after(fb, self.kept[bs])
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        what = "decode" if self.q == 1 else f"verify ({self.q} tokens per request)"
        log.info("captured %s CUDA graphs for batch sizes %s", what, self.buckets)

    def _kept(self, fb: ForwardBatch) -> torch.Tensor:
        return torch.cat([fb.layer_outputs[i] for i in self.keep_layers], dim=-1)

    def bucket(self, n: int) -> int | None:
        for bs in self.buckets:
            if bs >= n:
                return bs
        return None

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        tables: list[np.ndarray],  # per group [n, W] int32, zero-padded (table_arrays)
        fill: DeviceTokens | None = None,  # token ids still on the device
    ) -> torch.Tensor:
        """Logits `[n, vocab]` (float32) of one decode step for n <= max_bs requests."""
        n = len(token_ids)
        bs = self.bucket(n)
        ps = self.page_size
        pad = [0] * (bs - n)
        # Plain lists, one host tensor per kind: per-row torch calls cost more than the step.
        head = torch.tensor([token_ids + pad, positions + pad], dtype=torch.int64)
        self.input_ids[:bs].copy_(head[0], non_blocking=True)
        self.positions[:bs].copy_(head[1], non_blocking=True)
        caps = self.want(n, max(positions) + 1)
        seq = torch.tensor(caps + [p + 1 for p in positions] + [1] * (bs - n), dtype=torch.int32)
        self.ints[: len(caps) + bs].copy_(seq, non_blocking=True)
        if fill is not None:
            fill.apply(self.input_ids)
        pos = np.asarray(positions, dtype=np.int64)
        rows = np.arange(n)
        for g in range(len(self.tables)):
            arr = tables[g]
            width = arr.shape[1]
            table = np.zeros((bs, width), dtype=np.int32)
            table[:n] = arr
            slots = np.full(bs, -1, dtype=np.int64)
            slots[:n] = arr[rows, pos // ps].astype(np.int64) * ps + pos % ps
            # Entries past `width` keep stale page ids from earlier steps: the kernel never
            # reads past a request's seq_len, so they are harmless.
            self.tables[g][:bs, :width].copy_(torch.from_numpy(table), non_blocking=True)
            self.slots[g][:bs].copy_(torch.from_numpy(slots), non_blocking=True)
        self.graphs[bs].replay()
        self.last_bucket = bs
        return self.outputs[bs][:n]

    def run_chunks(
        self,
        chunks: list[list[int]],  # per request: 1..q token ids from its next position on
        starts: list[int],  # per request: the position of its first token
        tables: list[np.ndarray],  # per group [n, W] int32, zero-padded (table_arrays)
        fill: DeviceTokens | None = None,  # token ids on the device (packed: see in_chunks)
    ) -> torch.Tensor:
        """Logits `[n, q, vocab]` (float32) of one step where request r computes chunks[r] at
        positions starts[r].. (rows past len(chunks[r]) are padding: drop them)."""
        n, q, ps = len(chunks), self.q, self.page_size
        bs = self.bucket(n)
        ids, pos, seq = [], [], []
        for chunk, p0 in zip(chunks, starts):
            ids += chunk + [0] * (q - len(chunk))
            pos += range(p0, p0 + q)
            seq.append(p0 + q)
        ids += [0] * ((bs - n) * q)
        pos += [0] * ((bs - n) * q)
        head = torch.tensor([ids, pos], dtype=torch.int64)
        t = bs * q
        self.input_ids[:t].copy_(head[0], non_blocking=True)
        if fill is not None:
            fill.in_chunks([len(c) for c in chunks], q).apply(self.input_ids)
        self.positions[:t].copy_(head[1], non_blocking=True)
        caps = self.want(n, max(seq))
        lens = torch.tensor(caps + seq + [q] * (bs - n), dtype=torch.int32)
        self.ints[: len(caps) + bs].copy_(lens, non_blocking=True)
        # Every table entry a row may read (up to start + q, padding included) is written:
        # NULL past the request's own pages.
        width = min(self.max_pages, max(-(-(p0 + q) // ps) for p0 in starts))
        at = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(q)[None, :]  # [n, q]
        real = np.arange(q)[None, :] < np.asarray([len(c) for c in chunks])[:, None]
        for g in range(len(self.tables)):
            arr = tables[g]
            w = min(width, arr.shape[1])
            table = np.zeros((bs, width), dtype=np.int32)
            table[:n, :w] = arr[:, :w]
            slots = np.full((bs, q), -1, dtype=np.int64)
            page = table[np.arange(n)[:, None], np.minimum(at // ps, width - 1)]
            slots[:n] = np.where(real, page.astype(np.int64) * ps + at % ps, -1)
            self.tables[g][:bs, :width].copy_(torch.from_numpy(table), non_blocking=True)
            self.slots[g][:t].copy_(torch.from_numpy(slots.reshape(-1)), non_blocking=True)
        self.graphs[bs].replay()
        self.last_bucket = bs
        return self.outputs[bs][: n * q].view(n, q, -1)

    def kept_rows(self, lengths: list[int]) -> torch.Tensor:
        """The kept layer outputs of the last replay, real rows only: request r's first
        lengths[r] of its q rows, in batch order."""
        kept = self.kept[self.last_bucket]
        q = self.q
        if all(n == q for n in lengths):
            return kept[: len(lengths) * q]
        return torch.cat([kept[r * q : r * q + n] for r, n in enumerate(lengths)])
