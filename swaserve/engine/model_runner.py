"""ModelRunner: turns the scheduler's CPU-side batch into a `ForwardBatch` (the one
conversion) and runs the model. Nothing here decides what runs; it only executes."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.attention.base import AttentionBackend, AttentionInputs
from swaserve.engine.forward_batch import DeviceTokens, ForwardBatch
from swaserve.engine.scheduler import ScheduledBatch
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager
from swaserve.ops.greedy_head import GreedyHead


class ModelRunner:
    def __init__(
        self, model: nn.Module, kv: KVPool, backend: AttentionBackend, device: torch.device
    ) -> None:
        self.model = model
        self.kv = kv
        self.backend = backend
        self.device = device
        self.graphs = None  # DecodeGraphs once captured (swaserve/engine/cuda_graph.py)
        self.verify_graphs = None  # the same, K + 1 tokens per request (speculative decoding)
        self.piecewise = None  # PiecewiseGraphs (engine/piecewise_graph.py): the other steps
        self.mixed = None  # MixedGraphs (engine/mixed_graph.py): small steps with prefill chunks
        # Layers whose outputs a step also returns (DFlash's target_layer_ids, in order), and
        # those outputs of the last step, concatenated: [its tokens, len(keep) * hidden].
        self.keep: tuple[int, ...] = ()
        self.kept: torch.Tensor | None = None
        # whether the last step's graphs also stored DFlash's context K/V (DecodeGraphs.after)
        self.context_stored = False
        # CPU: exact greedy tokens of a step without its logits (ops/greedy_head.py), or None
        self.greedy_head: GreedyHead | None = None

    def decode_logits(
        self, batch: ScheduledBatch, memory: MemoryManager, fill: DeviceTokens | None = None
    ) -> torch.Tensor | None:
        """Logits of a pure decode step through a captured CUDA graph, or None when the step
        does not qualify (graphs off, a prefill chunk in the batch, or too many requests)."""
        self.context_stored = False
        g = self.graphs
        if g is None or len(batch) > g.max_bs or any(n != 1 for n in batch.num_new_tokens):
            return None
        reqs = batch.requests
        if any(r.num_computed_tokens + 1 != r.num_tokens for r in reqs):
            return None
        logits = g.run(
            [r.tokens(r.num_computed_tokens, r.num_tokens)[0] for r in reqs],
            [r.num_computed_tokens for r in reqs],
            memory.table_arrays([r.request_id for r in reqs]),
            fill,
        )
        if self.keep:
            self.kept = g.kept_rows([1] * len(reqs))
            self.context_stored = g.after is not None
        return logits

    def verify_logits(
        self, batch: ScheduledBatch, memory: MemoryManager, fill: DeviceTokens | None = None
    ) -> torch.Tensor | None:
        """Speculative decoding: the logits of each request's verify rows, packed in batch
        order ([sum(K_r + 1), vocab]), through a captured graph of `q` tokens per request; None
        when the step does not qualify (a prefill chunk in it, a chunk longer than q, too many
        requests)."""
        self.context_stored = False
        g = self.verify_graphs
        if g is None or len(batch) > g.max_bs:
            return None
        reqs, ns = batch.requests, batch.num_new_tokens
        for r, n in zip(reqs, ns):
            c = r.num_computed_tokens
            if n > g.q or c != r.num_tokens - 1 or c + n != r.num_tokens_with_drafts:
                return None
        logits = g.run_chunks(
            [r.tokens(r.num_computed_tokens, r.num_computed_tokens + n) for r, n in zip(reqs, ns)],
            [r.num_computed_tokens for r in reqs],
            memory.table_arrays([r.request_id for r in reqs]),
            fill,
        )
        if self.keep:
            self.kept = g.kept_rows(list(ns))
            self.context_stored = g.after is not None
        if all(n == g.q for n in ns):
            return logits.view(-1, logits.shape[-1])
        return torch.cat([logits[i, :n] for i, n in enumerate(ns)])

    def mixed_logits(
        self,
        batch: ScheduledBatch,
        memory: MemoryManager,
        rows: list[int],
        fill: DeviceTokens | None = None,
    ) -> torch.Tensor | None:
        """Logits of the packed `rows` of a step of at most the mixed graphs' tokens and
        requests, through one captured graph ([len(rows), vocab], possibly no rows), or None
        when the step does not qualify (no mixed graphs, too big, kept layer outputs). The
        caller keeps out steps that need other rows' hidden states or verify drafts."""
        g = self.mixed
        if g is None or self.keep:
            return None
        ns = batch.num_new_tokens
        if g.bucket(sum(ns), len(ns)) is None:
            return None
        ids: list[int] = []
        ctx: list[int] = []
        for req, n in zip(batch.requests, ns):
            c = req.num_computed_tokens
            ids += req.tokens(c, c + n)
            ctx.append(c)
        tables = memory.table_arrays([r.request_id for r in batch.requests])
        return g.run(list(ns), ctx, ids, tables, rows, fill)

    def prepare(
        self, batch: ScheduledBatch, memory: MemoryManager, fill: DeviceTokens | None = None
    ) -> ForwardBatch:
        """`fill`: input ids still on the device (placeholders of the step in flight)."""
        ids: list[int] = []
        ctx_lens: list[int] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            ctx = req.num_computed_tokens
            ids += req.tokens(ctx, ctx + n)
            ctx_lens.append(ctx)
        inputs = AttentionInputs(
            query_lens=list(batch.num_new_tokens),
            context_lens=ctx_lens,
            arrays=memory.table_arrays([r.request_id for r in batch.requests]),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if fill is not None:
            fill.apply(input_ids)
        return self.build(input_ids, inputs)

    def build(self, input_ids: torch.Tensor, inputs: AttentionInputs) -> ForwardBatch:
        """The ForwardBatch of input ids already on the device and the step's attention inputs
        (request r's positions run from context_lens[r] for query_lens[r] tokens)."""
        pos: list[int] = []
        for ctx, n in zip(inputs.context_lens, inputs.query_lens):
            pos += range(ctx, ctx + n)
        return ForwardBatch(
            input_ids=input_ids,
            positions=torch.tensor(pos, dtype=torch.int64).to(self.device, non_blocking=True),
            backend=self.backend,
            metadata=self.backend.prepare(inputs),
            kv=self.kv,
        )

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states `[T, hidden]`; through piecewise graphs a view of a static buffer, valid
        until the next forward is enqueued (use it, or clone it, within the step)."""
        pw = self.piecewise
        t = fb.input_ids.shape[0]
        if pw is not None and t <= pw.max_tokens:
            hidden = pw.run(fb)
            if self.keep:
                self.kept = pw.kept_rows(t)
            return hidden
        fb.keep_layers = frozenset(self.keep)
        hidden = self.model(fb)
        if self.keep:
            self.kept = torch.cat([fb.layer_outputs[i] for i in self.keep], dim=-1)
        return hidden

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()
