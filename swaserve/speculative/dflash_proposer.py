"""DFlash drafting inside the engine: the drafter's context K/V live in the unified pool, as
layers of their own, and one block forward per request in decode proposes its drafts.

Pool layers. The layout is built over the target's layers 0..L-1 then the drafter's layers
L..L+n-1 (`pool_layer_ids`), with the drafter's windows: its full layers join the full
groups, its sliding layers an SWA group of their window. So their pages are allocated,
shared by the prefix cache, backed up to the host tier, retired behind the window and freed
with the request's, by the code that does so for the target.

Context K/V. A drafter layer's context key/value at position p depends only on the target's
hidden states at p (after `target_layer_ids`): after every target forward (prefill chunks,
decodes, verify chunks) `store_context` writes them at the step's positions, in the same slots
as the target's K/V. Like those, the ones of rejected drafts are dead and get overwritten.

Drafting. A request committed up to c (its last token x_c not yet run by the target) runs
the block [x_c, mask x (B - 1)] at positions c..c+B-1 over its context keys 0..c-1 (a
sliding layer: c-W+1..c-1) read from the pool; rows 1..k give its k drafts (argmax: one-hot q).

Drafting is batched: requests in chunks of at most CONTEXT_ROWS padded context rows, each
chunk one drafter forward (torch attention over contexts gathered from the pool and padded).
`draft` is device work only, with shapes fixed by (requests, context width): on CUDA it runs
inside graphs captured per (batch bucket, power-of-two width) (dflash_graphs.py), eagerly
elsewhere and for chunks no graph fits.

The target's outputs come from every step path (eager, piecewise, decode and verify
graphs: `ModelRunner.keep`/`kept`).

On the decode and verify CUDA graph paths `store_context_in_graph` runs inside the graph (no
host work); eager and piecewise steps call `store_context`.

The drafts stay on the device (`propose_on_device`; engine/speculation.py fills the verify's
input ids from them) unless the host needs their values first (`propose`: one sync, under
tensor or expert parallelism, or when a live request has a penalty).

Partial (written down, not hidden): attention in torch over gathered contexts (not the paged
kernel; a graph's width is padded to a power of two).
"""

from __future__ import annotations

import torch
from torch import Tensor

from swaserve.engine.forward_batch import ForwardBatch
from swaserve.engine.request import Request
from swaserve.memory.groups import GroupLayout
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager
from swaserve.models.blocks import head_module
from swaserve.speculative.dflash_model import BatchedContext, DFlashDrafter

# Padded context rows (requests x longest context) drafted in one forward: bounds the gathered
# K/V (x layers x heads x dims) and the score matrix.
CONTEXT_ROWS = 1 << 16


def _to(t: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on `device` without a stream sync: a pageable host-to-device copy
    with non_blocking=True is staged at once, where a blocking one waits for the stream (every
    such wait lets the GPU drain on the slow host of the step loop)."""
    return t.to(device, non_blocking=True)


class DFlashProposer:
    def __init__(
        self,
        drafter: DFlashDrafter,
        target: torch.nn.Module,
        layout: GroupLayout,
        num_target_layers: int,
        page_size: int,
    ) -> None:
        self.drafter = drafter
        self.cfg = drafter.cfg
        self.layout = layout
        self.page_size = page_size
        self.pool_layer_ids = [num_target_layers + i for i in range(self.cfg.num_layers)]
        embed = target.model.embed_tokens
        head = head_module(target)
        # The target's raw table and head (the reference applies no final softcap of the
        # target's own); a weight packed for the CPU (swaserve/ops/cpu_pack.py) has no dense
        # tensor: its lookup and GEMM are called instead.
        self.embedding = embed.packed.rows if hasattr(embed, "packed") else embed.weight
        self.head = head.packed.linear if hasattr(head, "packed") else head.weight
        param = next(drafter.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.groups = sorted({layout.layer_to_group[i] for i in self.pool_layer_ids})
        self.graphs = None  # DrafterGraphs once captured (CUDA)

    # ---- after a target forward -----------------------------------------------------------

    def store_context(
        self,
        starts: list[int],
        counts: list[int],
        page_tables: list[list[list[int]]],
        features: Tensor,
        kv: KVPool,
    ) -> None:
        """Context K/V of the tokens a target forward computed: request r's `counts[r]` tokens
        from position `starts[r]`; `features` [tokens, n_ids * hidden] in batch order, the
        target's outputs after target_layer_ids concatenated (ModelRunner.kept)."""
        ctx = self.drafter.project_context(features.to(self.dtype))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        dev_positions = _to(positions, ctx.device)
        for j, layer_id in enumerate(self.pool_layer_ids):
            g = self.layout.layer_to_group[layer_id]
            slots = self._slots([pt[g] for pt in page_tables], starts, counts)
            k, v = self.drafter.context_kv(j, ctx, dev_positions)[:2]
            kv.store(layer_id, k, v, _to(slots, ctx.device))

    def store_context_of_batch(self, fb: ForwardBatch, features: Tensor, kv: KVPool) -> None:
        """`store_context` from the forward's own batch: its positions and each group's slot
        mapping (a tensor-parallel worker, which has no page tables of its own)."""
        ctx = self.drafter.project_context(features.to(self.dtype))
        for j, layer_id in enumerate(self.pool_layer_ids):
            group = fb.metadata.groups[self.layout.layer_to_group[layer_id]]
            k, v = self.drafter.context_kv(j, ctx, fb.positions)[:2]
            kv.store(layer_id, k, v, group.slot_mapping)

    def store_context_in_graph(self, fb: ForwardBatch, features: Tensor) -> None:
        """`store_context` inside a captured decode or verify graph (engine/cuda_graph.py):
        the step's positions and each group's slot mapping are the graph's own buffers,
        padding rows have slot -1 and are stored nowhere, and nothing runs on the host."""
        from swaserve.attention.kernels.paged_attention import store_kv

        ctx = self.drafter.project_context(features.to(self.dtype))
        for j, layer_id in enumerate(self.pool_layer_ids):
            group = fb.metadata.groups[self.layout.layer_to_group[layer_id]]
            k, v = self.drafter.context_kv(j, ctx, fb.positions)[:2]
            k_cache, v_cache = fb.kv.layer_cache(layer_id)
            k_scale, v_scale = fb.kv.layer_scales(layer_id)  # fp8: set before any capture
            store_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, group.slot_mapping,
                     k_scale, v_scale)

    def _slots(self, tables: list[list[int]], starts: list[int], counts: list[int]) -> Tensor:
        ps = self.page_size
        out: list[int] = []
        for table, s, n in zip(tables, starts, counts):
            out += [table[p // ps] * ps + p % ps for p in range(s, s + n)]
        return torch.tensor(out, dtype=torch.int64)

    # ---- before a step --------------------------------------------------------------------

    def propose(
        self, requests: list[Request], ks: list[int], memory: MemoryManager, kv: KVPool
    ) -> list[list[int]]:
        """k drafts per request (requests in decode: committed up to num_computed_tokens) on
        the host: `propose_on_device`, then one device-to-host copy."""
        rows = self.propose_on_device(requests, ks, memory, kv).tolist()
        return [row[:k] for row, k in zip(rows, ks, strict=True)]

    @torch.inference_mode()
    def propose_on_device(
        self, requests: list[Request], ks: list[int], memory: MemoryManager, kv: KVPool
    ) -> Tensor:
        """The drafts [R, B - 1] of the requests, left on the device (request r's first ks[r]
        are its drafts): one batched block forward per chunk of requests, no sync. On CUDA
        the tensor may be a graph's output buffer, valid until the drafter's next replay."""
        drafts: list[Tensor] = []
        i = 0
        while i < len(requests):
            j, longest = i, 0
            while j < len(requests):  # chunks of at most CONTEXT_ROWS padded context rows
                longest = max(longest, requests[j].num_computed_tokens)
                if j > i and (j - i + 1) * longest > CONTEXT_ROWS:
                    break
                j += 1
            drafts.append(self._propose_chunk(requests[i:j], ks[i:j], memory, kv))
            i = j
        if len(drafts) == 1:  # one chunk but for very long contexts
            return drafts[0]
        if not drafts:
            return torch.empty(0, self.cfg.block_size - 1, dtype=torch.long, device=self.device)
        return torch.cat(drafts)

    def _propose_chunk(
        self, requests: list[Request], ks: list[int], memory: MemoryManager, kv: KVPool
    ) -> Tensor:
        """[R, B - 1] drafts of a chunk of requests (the host keeps each request's first k):
        through a captured graph when one fits, else the same function eagerly."""
        starts = [q.num_computed_tokens for q in requests]
        last = [q.tokens(c, c + 1)[0] for q, c in zip(requests, starts)]
        tables = {g: [memory.page_table(q.request_id)[g] for q in requests]
                  for g in self.groups}
        width = self.context_width(starts)
        if self.graphs is not None:
            drafts = self.graphs.run(last, starts, tables, width)
            if drafts is not None:
                return drafts
        head = torch.tensor([last, starts], dtype=torch.int64)
        return self.draft_eager(head, {g: _padded(rows) for g, rows in tables.items()}, width,
                                kv)

    def draft_eager(self, head: Tensor, tables: dict[int, Tensor], width: int,
                    kv: KVPool) -> Tensor:
        """`draft` from host tensors: head [2, R] (x_c, c), tables group -> [R, pages]."""
        dev = self.device
        head = _to(head, dev)
        return self.draft(head[0], head[1], {g: _to(t, dev) for g, t in tables.items()}, width,
                          kv)

    def context_width(self, starts: list[int]) -> int:
        """Context keys a drafter forward reads per request (padded to the longest): every
        position before c, or a sliding layer's last window - 1 of them."""
        longest = max(starts)
        widths = [longest if w is None else min(longest, w - 1) for w in self.cfg.layer_windows]
        return max(1, *widths)

    def draft(
        self,
        last_ids: Tensor,  # [R] x_c, on the device
        starts: Tensor,  # [R] c
        tables: dict[int, Tensor],  # group -> [R, pages] page ids (past a request's own: any)
        width: int,  # context keys per request (>= context_width; extra ones are masked)
        kv: KVPool,
    ) -> Tensor:
        """The drafts [R, B - 1] of R requests: device work only, with shapes fixed by
        (R, width), so that a CUDA graph can hold it (DrafterGraphs)."""
        cfg, b, ps = self.cfg, self.cfg.block_size, self.page_size
        r, dev = last_ids.shape[0], last_ids.device
        steps = torch.arange(b, device=dev)
        block = torch.where(steps[None, :] == 0, last_ids[:, None], cfg.mask_token_id)
        embeds = self.drafter.embed_block(block, self.embedding).to(self.dtype)
        ctx = []
        cols = torch.arange(width, device=dev)
        for j, layer_id in enumerate(self.pool_layer_ids):
            window = cfg.layer_windows[j]
            lo = (torch.zeros_like(starts) if window is None
                  else (starts - (window - 1)).clamp_min(0))
            positions = lo[:, None] + cols[None, :]  # [R, C]
            valid = cols[None, :] < (starts - lo)[:, None]
            table = tables[self.layout.layer_to_group[layer_id]]
            index = (positions // ps).clamp_max(table.shape[1] - 1)
            slots = table.gather(1, index) * ps + positions % ps
            slots = torch.where(valid, slots, 0)  # padding reads the NULL page, never seen
            keys, values = kv.read(layer_id, slots.view(-1))
            shape = (r, width, *keys.shape[1:])
            ctx.append(BatchedContext(keys.view(shape).to(self.dtype),
                                      values.view(shape).to(self.dtype), positions, valid))
        hidden = self.drafter.forward_blocks(embeds, starts[:, None] + steps[None, :], ctx)
        return self.draft_logits(hidden[:, 1:]).argmax(-1)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """The draft logits [..., vocab] of the drafter's final hidden states [..., hidden]."""
        return self.drafter.compute_logits(hidden, self.head)

    def capture_graphs(self, max_requests: int, max_model_len: int, kv: KVPool) -> None:
        """CUDA graphs of `draft` for batches of up to `max_requests` (engine/cuda_graph.py's
        buckets) and context widths in powers of two (DrafterGraphs)."""
        from swaserve.speculative.dflash_graphs import DrafterGraphs

        graphs = DrafterGraphs(self, kv, max_requests, max_model_len)
        graphs.capture()
        self.graphs = graphs


def _padded(rows: list[list[int]]) -> Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)
