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

Partial (written down, not hidden): one block forward per request (no batching across
requests yet), attention in torch, drafts read back with one extra device sync per step, and
no CUDA graphs while DFlash is on (EngineCore captures none).
"""

from __future__ import annotations

import torch
from torch import Tensor

from swaserve.engine.request import Request
from swaserve.memory.groups import GroupLayout
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager
from swaserve.speculative.dflash_model import ContextKV, DFlashDrafter


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
        self.keep_layers = frozenset(self.cfg.target_layer_ids)
        inner = target.model
        self.embedding = inner.embed_tokens.weight
        # The reference uses the target's raw head (no final softcap of the target's own).
        self.head = self.embedding if target.tie_word_embeddings else target.lm_head.weight
        self.dtype = next(drafter.parameters()).dtype

    # ---- after a target forward -----------------------------------------------------------

    def store_context(
        self,
        starts: list[int],
        counts: list[int],
        page_tables: list[list[list[int]]],
        layer_outputs: dict[int, Tensor],
        kv: KVPool,
    ) -> None:
        """Context K/V of the tokens a target forward computed: request r's `counts[r]` tokens
        from position `starts[r]`, rows in batch order in `layer_outputs`."""
        feats = torch.cat([layer_outputs[i] for i in self.cfg.target_layer_ids], dim=-1)
        ctx = self.drafter.project_context(feats.to(self.dtype))
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        dev_positions = positions.to(ctx.device)
        for j, layer_id in enumerate(self.pool_layer_ids):
            g = self.layout.layer_to_group[layer_id]
            slots = self._slots([pt[g] for pt in page_tables], starts, counts)
            k, v = self.drafter.context_kv(j, ctx, dev_positions)[:2]
            kv.store(layer_id, k, v, slots.to(ctx.device))

    def _slots(self, tables: list[list[int]], starts: list[int], counts: list[int]) -> Tensor:
        ps = self.page_size
        out: list[int] = []
        for table, s, n in zip(tables, starts, counts):
            out += [table[p // ps] * ps + p % ps for p in range(s, s + n)]
        return torch.tensor(out, dtype=torch.int64)

    # ---- before a step --------------------------------------------------------------------

    @torch.inference_mode()
    def propose(
        self, requests: list[Request], ks: list[int], memory: MemoryManager, kv: KVPool
    ) -> list[list[int]]:
        """k drafts per request (requests in decode: committed up to num_computed_tokens)."""
        cfg, ps = self.cfg, self.page_size
        b = cfg.block_size
        rows = []
        for req, k in zip(requests, ks):
            c = req.num_computed_tokens
            tables = memory.page_table(req.request_id)
            ctx_kv = []
            for j, layer_id in enumerate(self.pool_layer_ids):
                window = cfg.layer_windows[j]
                lo = 0 if window is None else max(0, c - (window - 1))
                table = tables[self.layout.layer_to_group[layer_id]]
                slots = torch.tensor(
                    [table[p // ps] * ps + p % ps for p in range(lo, c)], dtype=torch.int64
                )
                keys, values = kv.read(layer_id, slots.to(kv.kv.device))
                positions = torch.arange(lo, c, device=self.embedding.device)
                ctx_kv.append(ContextKV(keys.to(self.dtype), values.to(self.dtype), positions))
            block = [req.tokens(c, c + 1)[0]] + [cfg.mask_token_id] * (b - 1)
            ids = torch.tensor(block, device=self.embedding.device)
            embeds = self.drafter.embed_block(ids, self.embedding).to(self.dtype)
            positions = torch.arange(c, c + b, device=self.embedding.device)
            hidden = self.drafter.forward_block(embeds, positions, ctx_kv)
            logits = self.drafter.compute_logits(hidden[1 : k + 1], self.head.to(self.dtype))
            rows.append(logits.argmax(-1))
        if not rows:
            return []
        flat = torch.cat(rows).tolist()  # the drafts on the host: one sync for the step
        out, start = [], 0
        for k in ks:
            out.append(flat[start : start + k])
            start += k
        return out
