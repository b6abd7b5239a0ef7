"""CUDA graphs of the DFlash drafter's forward (`DFlashProposer.draft`): one per (batch
bucket, context width), so that drafting costs a replay instead of ~100 kernel launches from
the step loop's slow host.

    inputs    static buffers: each request's last committed token x_c, its c, and its page
              table per drafter group (rows past a request's pages keep stale ids: `draft`
              masks every key past c, and reads the NULL page for them)
    buckets   requests: engine/cuda_graph.py's batch buckets up to `max_requests`; context
              width: powers of two from MIN_WIDTH up to max_model_len, while requests x width
              stays within CONTEXT_ROWS (the eager path's chunk bound); a batch no graph fits
              drafts eagerly
    output    [bucket, B - 1] argmax drafts; the caller reads its first R rows back (the one
              device-to-host copy of drafting)

Padding a request's context to the bucket's width adds keys that are masked out: the drafts
are those of the eager forward up to the order of floating-point sums.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from swaserve.engine.cuda_graph import batch_buckets, no_collection
from swaserve.memory.kv_pool import KVPool

if TYPE_CHECKING:
    from swaserve.speculative.dflash_proposer import DFlashProposer

log = logging.getLogger(__name__)

MIN_WIDTH = 256


def width_buckets(max_width: int) -> list[int]:
    out = [MIN_WIDTH]
    while out[-1] < max_width:
        out.append(out[-1] * 2)
    return out


class DrafterGraphs:
    def __init__(self, proposer: DFlashProposer, kv: KVPool, max_requests: int,
                 max_model_len: int) -> None:
        from swaserve.speculative.dflash_proposer import CONTEXT_ROWS

        # the proposer owns these graphs: a strong reference back would make a cycle, which
        # the frozen start-up heap keeps (engine/gc_heap.py) with the KV pool in it
        self.proposer, self.kv = weakref.proxy(proposer), kv
        dev = proposer.device
        self.r_buckets = batch_buckets(max_requests)
        self.shapes = [(r, c) for r in self.r_buckets for c in width_buckets(max_model_len)
                       if r * c <= CONTEXT_ROWS]
        top = self.r_buckets[-1]
        pages = math.ceil((max_model_len + proposer.cfg.block_size) / proposer.page_size)
        self.last_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self.starts = torch.zeros(top, dtype=torch.int64, device=dev)
        self.tables = {g: torch.zeros(top, pages, dtype=torch.int64, device=dev)
                       for g in proposer.groups}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}

    def _draft(self, r: int, c: int) -> Tensor:
        tables = {g: t[:r] for g, t in self.tables.items()}
        return self.proposer.draft(self.last_ids[:r], self.starts[:r], tables, c, self.kv)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pool = None
        with no_collection(), torch.cuda.stream(stream):
            # largest first: the smaller ones reuse its memory pool
            for r, c in sorted(self.shapes, key=lambda s: s[0] * s[1], reverse=True):
                for _ in range(2):  # warm up: kernels chosen, allocator settled
                    self._draft(r, c)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[(r, c)] = self._draft(r, c)
                if pool is None:
                    pool = graph.pool()
                self.graphs[(r, c)] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured %d DFlash drafter CUDA graphs (requests %s, context widths up to %d)",
                 len(self.graphs), self.r_buckets, max(c for _, c in self.shapes))

    def bucket(self, n: int, width: int) -> tuple[int, int] | None:
        fits = [(r, c) for r, c in self.shapes if r >= n and c >= width]
        return min(fits, key=lambda s: s[0] * s[1]) if fits else None

    def run(self, last_ids: list[int], starts: list[int], tables: dict[int, list[list[int]]],
            width: int) -> Tensor | None:
        """[R, B - 1] drafts of R requests through a graph, or None when none fits."""
        n = len(last_ids)
        shape = self.bucket(n, width)
        if shape is None:
            return None
        r, _ = shape
        pad = [0] * (r - n)
        head = torch.tensor([last_ids + pad, starts + pad], dtype=torch.int64)
        self.last_ids[:r].copy_(head[0], non_blocking=True)
        self.starts[:r].copy_(head[1], non_blocking=True)
        for g, rows in tables.items():
            w = max(len(row) for row in rows)
            table = torch.tensor([row + [0] * (w - len(row)) for row in rows], dtype=torch.int64)
            self.tables[g][:n, :w].copy_(table, non_blocking=True)
        if shape not in self.graphs:  # not captured (CPU tests of these inputs): eagerly
            return self._draft(*shape)[:n]
        self.graphs[shape].replay()
        return self.outputs[shape][:n]
