"""Piecewise CUDA graphs: every step that the decode graphs do not take (prefill chunks beside
decodes, large decode batches, verify steps past their buckets) runs the model's non-attention
work as replayed graphs, with only attention launched eagerly in between.

A mixed step of ~250 requests enqueued ~400 kernels one by one (25 ms of host time against
~18 ms of arithmetic on an H200; benchmarks/RESULTS.md, step profile). The model code is not
changed for this: during capture the attention backend is replaced by a splitter, and every
attention call ends the graph being captured and begins the next one. For a model of L layers
one token-count bucket T holds L + 1 graphs:

    graph 0      embedding ... layer 0's q/k/v (copied into the static q/k/v buffers)
    attention 0  eager: the real backend on the step's metadata, into the static out buffer
    graph 1      layer 0's o_proj ... layer 1's q/k/v
    ...
    graph L      layer L-1's o_proj ... final norm -> the bucket's static hidden output

Invariants that make one set of static buffers safe for every layer and every bucket:
- q/k/v of layer i are read by attention i before graph i + 1 overwrites them; `out` is read
  by graph i + 1 before attention i + 1 overwrites it (one stream: launch order is run order).
- The buckets share one private memory pool. A tensor that lives from graph i into graph j
  (the residual stream) stays referenced until the bucket's capture ends; once released, a
  later (smaller) bucket's capture may reuse its memory, which is safe because the graphs of
  one bucket are replayed together and never interleaved with another bucket's.
- Rows past the step's real tokens are padding: stale ids and positions from earlier steps
  (finite), row-independent through every non-attention op, never attended to (attention
  runs on the real rows only) and dropped from the output.
Only the Triton backend runs between the pieces; the torch backend stays eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from swaserve.attention.kernels.rope_store import QKPrologue
from swaserve.attention.triton_backend import TritonBackend
from swaserve.engine.cuda_graph import no_collection
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.kv_pool import KVPool
from swaserve.models.blocks import AttentionSpec

log = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts with a captured graph set: fine steps up to 256, then every 256 (at most
    255 padded rows of non-attention work), and max_tokens itself."""
    small = [16, 32, 64, 128, 256]
    sizes = {b for b in small if b <= max_tokens} | set(range(512, max_tokens + 1, 256))
    return sorted(sizes | {max_tokens})


@dataclass(frozen=True)
class _Site:
    """One attention call of the model, in call order."""

    spec: AttentionSpec
    sinks: torch.Tensor | None
    prologue: QKPrologue | None  # q/k norms + rotary, run eagerly with the K/V store
    kv_stored: bool = False  # a layer reading another layer's K/V (KV sharing): no k/v


class _Splitter:
    """Stands in for the attention backend while the model runs for warm-up or capture: copies
    q/k/v into the static buffers and returns the static output; when capturing, ends the
    graph in progress and begins the next."""

    def __init__(self, owner: PiecewiseGraphs) -> None:
        self.owner = owner
        # as the backend that runs between the pieces: the model hands its q/k prologue over
        self.fuses_qk_prologue = owner.backend.fuses_qk_prologue
        self.graphs: list[torch.cuda.CUDAGraph] | None = None  # None: warm-up, nothing captured
        self.sites: list[_Site] = []

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
        fb: ForwardBatch,
        prologue: QKPrologue | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # kv_stored only from a layer that shares another's K/V (k = v = None): the GEMV's
        # kv_destination path never runs under piecewise graphs
        assert not kv_stored or k is None, "the backend between the pieces stores K/V"
        o = self.owner
        qs, ks, vs, out = o.views(q.shape[0], spec)
        qs.copy_(q)
        if not kv_stored:
            ks.copy_(k)
            vs.copy_(v)
        self.sites.append(_Site(spec, sinks, prologue, kv_stored))
        if self.graphs is not None:
            self.graphs[-1].capture_end()
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=o.pool)
            self.graphs.append(g)
        return out


class PiecewiseGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend: TritonBackend,
        kv: KVPool,
        max_tokens: int,
        attn_shape: tuple[int, int, int],  # (num_heads, num_kv_heads, head_dim), largest layer
        keep_layers: tuple[int, ...] = (),  # layer outputs captured too (DFlash), in order
    ) -> None:
        self.model, self.backend, self.kv = model, backend, kv
        dev = backend.device
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        h, hkv, d = attn_shape
        dtype = next(model.parameters()).dtype
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.q = torch.zeros(n * h * d, dtype=dtype, device=dev)
        self.k = torch.zeros(n * hkv * d, dtype=dtype, device=dev)
        self.v = torch.zeros(n * hkv * d, dtype=dtype, device=dev)
        self.out = torch.zeros(n * h * d, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.sites: list[_Site] = []
        self.keep_layers = keep_layers
        self.kept: dict[int, torch.Tensor] = {}  # bucket -> [t, len(keep) * hidden]
        self.last_bucket: int | None = None
        self.pool = None

    def views(
        self, t: int, spec: AttentionSpec
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Static q, k, v and attention output of `t` rows shaped for one layer."""
        h, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        return (
            self.q[: t * h * d].view(t, h, d),
            self.k[: t * hkv * d].view(t, hkv, d),
            self.v[: t * hkv * d].view(t, hkv, d),
            self.out[: t * h * d].view(t, h, d),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with no_collection(), torch.cuda.stream(stream):
            for t in reversed(self.buckets):  # largest first: the others fit in its memory
                split = _Splitter(self)
                fb = ForwardBatch(self.input_ids[:t], self.positions[:t], split, None, self.kv,
                                  keep_layers=frozenset(self.keep_layers))
                for _ in range(2):  # warm up: Triton compiles, the allocator settles
                    split.sites = []
                    self.model(fb)
                split.sites = []
                first = torch.cuda.CUDAGraph()
                split.graphs = [first]
                first.capture_begin(pool=self.pool)
                hidden = self.model(fb)
                if self.keep_layers:  # still inside the last piece's capture
                    self.kept[t] = torch.cat(
                        [fb.layer_outputs[i] for i in self.keep_layers], dim=-1
                    )
                split.graphs[-1].capture_end()
                if not self.sites:
                    self.sites = split.sites
                assert [s.spec for s in split.sites] == [s.spec for s in self.sites]
                self.graphs[t], self.outputs[t] = split.graphs, hidden
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "captured piecewise CUDA graphs (%d pieces each) for %d token counts up to %d",
            len(self.sites) + 1, len(self.buckets), self.max_tokens,
        )

    def bucket(self, n: int) -> int | None:
        for t in self.buckets:
            if t >= n:
                return t
        return None

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states `[T, hidden]` of the step `fb` (T <= max_tokens), the same as
        `model(fb)`; a view of a static buffer that the next replay overwrites."""
        t = fb.input_ids.shape[0]
        bucket = self.bucket(t)
        graphs = self.graphs[bucket]
        self.input_ids[:t].copy_(fb.input_ids)
        self.positions[:t].copy_(fb.positions)
        backend = self.backend
        for graph, site in zip(graphs, self.sites):
            graph.replay()
            q, k, v, out = self.views(t, site.spec)
            if site.kv_stored:
                k = v = None
            backend.forward(q, k, v, site.spec, site.sinks, fb, out=out, prologue=site.prologue,
                            kv_stored=site.kv_stored)
        graphs[-1].replay()
        self.last_bucket = bucket
        return self.outputs[bucket][:t]

    def kept_rows(self, t: int) -> torch.Tensor:
        """The kept layer outputs of the last replay's t real rows."""
        return self.kept[self.last_bucket][:t]
