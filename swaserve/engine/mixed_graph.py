"""Mixed CUDA graphs (`--mixed-cuda-graph-max-tokens`, 0 disables): whole-step graphs, attention
included, for steps of at most `max_tokens` tokens that mix decodes and prefill chunks.

Such a step otherwise runs piecewise (engine/piecewise_graph.py): attention and its prologue
launched from Python once per layer. For a 62-layer model that is ~200 launches, more host
time on a slow host than the ~25 ms the GPU spends on 17 decodes and a 175-token chunk of a
27B model. Under KV pressure the scheduler builds exactly such steps, one after another
(`kv_bound_step_tokens`, engine/scheduler.py), so they must cost the GPU's time only.

A bucket of T rows has S = min(T, max_seqs) + 1 request slots. Every buffer is static and
every replay overwrites it in place:

    rows [0, n)       the step's tokens in batch order: request r's at qsl[r]..qsl[r + 1]
    rows [n, T)       padding: one padding request in slot b (b = the batch's requests) of
                      T - n tokens at positions 0.. over the NULL page (zero table row):
                      finite keys, slot -1 (nothing stored), rows dropped
    slots (b, S)      empty requests (q_len 0): their attention programs return at once

Attention runs as in an eager mixed step: `paged_attention` with `min_query_len` 1 takes a
decode-tile launch for requests of at most its BLOCK_Q tokens (one program row per request
slot) and a prefill-tile launch for the longer ones, whose few query blocks split the keys of a
long context (`chunk_num_splits`); each launch's programs of the other kind return at once.
The decode launch splits keys as the decode graphs do (`SplitRule`: the grid holds the most
splits any batch of 1..S - 1 requests wants, at most DECODE_SPLITS; `split_cap` what this one
wants), bounded so that the partials of T rows stay within MAX_SPLIT_BYTES. Prefill chunks
read their keys from the cache (the eager path reads a bf16 chunk's own keys from its rows
where that is faster: the same values).

Logits: only of the rows the step samples (`rows`, up to S, in the caller's order), gathered
inside the graph through a static index, so a bucket's logits are `[S, vocab]`, not
`[T, vocab]`. Steps with prompt logprobs, drafts to verify or kept layer outputs (DFlash) do
not come here (model_runner.py).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from torch import nn

from swaserve.attention.kernels.paged_attention import (
    MAX_SPLIT_BYTES,
    _num_sms,
    attention_config,
)
from swaserve.attention.triton_backend import TritonBackend, TritonGroupMetadata, TritonMetadata
from swaserve.engine.cuda_graph import SplitRule, no_collection
from swaserve.engine.forward_batch import DeviceTokens, ForwardBatch
from swaserve.memory.kv_pool import KVPool

log = logging.getLogger(__name__)

# The decode launch's key splits at most: its grid holds a row for every request slot (S of
# them) whatever the step's real count, and with the 64 splits a lone decode over a long
# context wants, the programs that return at once would outnumber the real ones ~30 to 1 (a
# mixed step's decodes are few and its chunk dominates; 8 splits keep a long context's walk
# at an eighth of its keys).
DECODE_SPLITS = 8


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token counts with a graph: 32, then every 64 (at most 63 padded rows; the scheduler's
    capped steps fill theirs exactly), and max_tokens itself."""
    sizes = {32} | set(range(64, max_tokens + 1, 64))
    return sorted({t for t in sizes if t <= max_tokens} | {max_tokens})


class MixedGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: TritonBackend,
        kv: KVPool,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        spec_shape: tuple[int, int, int],  # (num_heads, num_kv_heads, head_dim), largest layer
    ) -> None:
        self.model, self.backend, self.kv = model, backend, kv
        dev = backend.device
        self.buckets = mixed_buckets(max_tokens)
        self.max_tokens = t_max = self.buckets[-1]
        self.max_seqs = min(max_seqs, t_max)
        s_max = self.max_seqs + 1
        self.page_size = ps = backend.page_size
        self.max_pages = math.ceil(max(max_model_len, t_max) / ps)
        layout = backend.layout
        self.num_groups = ng = layout.num_groups
        self.input_ids = torch.zeros(t_max, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t_max, dtype=torch.int64, device=dev)
        # [split caps per group | qsl (S + 1) | seq_lens (S)]: one copy per replay writes all
        self.ints = torch.zeros(ng + 2 * s_max + 1, dtype=torch.int32, device=dev)
        self.split_caps = self.ints[:ng]
        self.qsl = self.ints[ng : ng + s_max + 1]
        self.seq_lens = self.ints[ng + s_max + 1 :]
        self.tables = [
            torch.zeros(s_max, self.max_pages, dtype=torch.int32, device=dev) for _ in range(ng)
        ]
        self.slots = [torch.full((t_max,), -1, dtype=torch.int64, device=dev) for _ in range(ng)]
        self.sample = torch.zeros(s_max, dtype=torch.int64, device=dev)  # rows to take logits of
        h = spec_shape[0]
        shapes = [tuple(kv.layer_cache(g.layers[0])[0].shape[2:]) for g in layout.groups]
        self.want = SplitRule(
            [hkv for hkv, _ in shapes], 1,
            [attention_config(d, h // hkv, 1).block_q for hkv, d in shapes], _num_sms(dev),
            [g.window for g in layout.groups], max_model_len,
        )  # fmt: skip
        # per bucket, per group: the decode launch's grid splits, its partials bounded
        self.splits: dict[int, list[int]] = {}
        for t in self.buckets:
            grid = [min(n, DECODE_SPLITS) for n in self.want.grid(range(1, self.seqs(t)))]
            for g, (_, d) in enumerate(shapes):
                row = t * h * max(16, 1 << (d - 1).bit_length()) * 4
                while grid[g] > 1 and grid[g] * row > MAX_SPLIT_BYTES:
                    grid[g] //= 2
            self.splits[t] = grid
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def seqs(self, t: int) -> int:
        """Request slots of bucket t: its real requests and the padding one."""
        return min(t, self.max_seqs) + 1

    def _batch(self, t: int) -> ForwardBatch:
        s = self.seqs(t)
        meta = TritonMetadata(
            query_start_loc=self.qsl[: s + 1],
            seq_lens=self.seq_lens[:s],
            context_lens=self.seq_lens[:s],  # unused by the kernels
            groups=[
                TritonGroupMetadata(tb[:s], sl[:t], n, self.split_caps[g : g + 1])
                for g, (tb, sl, n) in enumerate(
                    zip(self.tables, self.slots, self.splits[t], strict=True)
                )
            ],
            num_tokens=t,
            max_query_len=t,
            max_seq_len=self.max_pages * self.page_size,
            decode_only=False,
            min_query_len=1,  # decode-sized and longer requests: one launch of each
        )
        return ForwardBatch(self.input_ids[:t], self.positions[:t], self.backend, meta, self.kv)

    def _logits(self, t: int) -> torch.Tensor:
        fb = self._batch(t)
        hidden = self.model(fb)
        return self.model.compute_logits(hidden[self.sample[: self.seqs(t)]]).float()

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with no_collection(), torch.cuda.stream(stream):
            for t in reversed(self.buckets):  # largest first: the others fit in its memory
                for _ in range(2):  # warm up: Triton compiles, the allocator settles
                    self._logits(t)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self._logits(t)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[t], self.outputs[t] = graph, out
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured mixed CUDA graphs for token counts %s (at most %d requests)",
                 self.buckets, self.max_seqs)  # fmt: skip

    def bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest bucket for a step of `num_tokens` tokens of `num_seqs` requests."""
        if num_seqs > self.max_seqs:
            return None
        for t in self.buckets:
            if t >= num_tokens:
                return t
        return None

    def stage(
        self,
        query_lens: list[int],
        context_lens: list[int],
        token_ids: list[int],  # the step's tokens, packed in batch order
        tables: list[np.ndarray],  # per group [b, W] int32, zero-padded (table_arrays)
        rows: list[int],  # packed rows whose logits the caller wants, in its order
        fill: DeviceTokens | None = None,  # token ids still on the device
    ) -> int:
        """Write one step into the static buffers; returns its bucket (`run` replays it)."""
        b, n, ps = len(query_lens), len(token_ids), self.page_size
        t = self.bucket(n, b)
        assert t is not None and len(rows) <= b, (n, b, len(rows))
        s, pad = self.seqs(t), t - n
        qlens = np.asarray(query_lens, dtype=np.int64)
        ctx = np.asarray(context_lens, dtype=np.int64)
        starts = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(qlens, out=starts[1:])
        req = np.repeat(np.arange(b), qlens)
        pos = np.arange(n) - starts[req] + ctx[req]
        seq_lens = ctx + qlens
        caps = self.want(b, int(seq_lens.max()))
        ints = np.zeros(self.ints.numel(), dtype=np.int32)
        ng, s_max = self.num_groups, self.max_seqs + 1
        ints[:ng] = caps
        qsl = ints[ng : ng + s_max + 1]
        qsl[: b + 1] = starts
        qsl[b + 1 :] = t  # the padding request ends at T, the empty ones after it too
        lens = ints[ng + s_max + 1 :]
        lens[:b] = seq_lens
        lens[b] = pad  # over the NULL page from position 0
        head = np.concatenate([np.asarray(token_ids, dtype=np.int64), np.zeros(pad, np.int64),
                               pos, np.arange(pad, dtype=np.int64)])  # fmt: skip
        host = torch.from_numpy(head)
        self.input_ids[:t].copy_(host[:t], non_blocking=True)
        self.positions[:t].copy_(host[t:], non_blocking=True)
        self.ints.copy_(torch.from_numpy(ints), non_blocking=True)
        sample = np.zeros(s, dtype=np.int64)
        sample[: len(rows)] = rows
        self.sample[:s].copy_(torch.from_numpy(sample), non_blocking=True)
        if fill is not None:
            fill.apply(self.input_ids)
        # The padding request reads table entries up to its length: NULL there, written.
        need = -(-pad // ps)
        for g in range(self.num_groups):
            arr = tables[g]
            width = max(arr.shape[1], need)  # both <= max_pages
            table = np.zeros((b + 1, width), dtype=np.int32)
            table[:b, : arr.shape[1]] = arr
            slots = np.full(t, -1, dtype=np.int64)
            slots[:n] = table[req, pos // ps].astype(np.int64) * ps + pos % ps
            # Entries past `width` and rows past b keep stale page ids: never read (a
            # request's programs stop at its seq_len; empty requests return at once).
            self.tables[g][: b + 1, :width].copy_(torch.from_numpy(table), non_blocking=True)
            self.slots[g][:t].copy_(torch.from_numpy(slots), non_blocking=True)
        return t

    def run(
        self,
        query_lens: list[int],
        context_lens: list[int],
        token_ids: list[int],
        tables: list[np.ndarray],
        rows: list[int],
        fill: DeviceTokens | None = None,
    ) -> torch.Tensor:
        """Logits `[len(rows), vocab]` (float32) of one step (`stage`'s arguments): a view of
        the bucket's static output, valid until its next replay."""
        t = self.stage(query_lens, context_lens, token_ids, tables, rows, fill)
        self.graphs[t].replay()
        return self.outputs[t][: len(rows)]

    @torch.inference_mode()
    def run_eager(self, t: int, num_rows: int) -> torch.Tensor:
        """What bucket t's graph computes, run eagerly on the staged buffers (tests: the
        layout checked where no graph can be captured, e.g. on CPU under the interpreter)."""
        return self._logits(t)[:num_rows]
