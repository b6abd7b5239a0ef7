"""DFlash drafting under tensor parallelism: the drafter is sharded like the target (its
attention heads, KV heads and MLP: distributed/layers.py, `shard_drafter`), so each rank's pool
holds its shard of the drafter's K/V groups as it holds the target's, and every drafter forward
and every context K/V store runs on every rank.

    rank 0   DFlashProposer's logic: which requests draft, how many, the block, the acceptance
             (engine/speculation.py). Before each drafter forward it sends DRAFT (x_c, c, the
             drafter groups' page tables, the context width), before each context store
             CONTEXT (step_wire.py); then runs its own shard.
    workers  DRAFT: the same `draft` on their shard. CONTEXT: the context K/V of the last
             FORWARD's tokens (`store_context_of_batch`), from the target outputs their own
             forward kept (`ModelRunner.keep`): the residual stream after a layer is whole and
             equal on every rank once its all-reduce is done, so nothing travels.

Collectives of one drafter forward, in order on every rank: the block's embedding (the
target's vocabulary-parallel embedding module: each rank's table holds a shard, so its lookup
is masked and summed), per layer o_proj's and down_proj's all-reduces, then the gather of the
draft logits to rank 0 (the target's head shard times output_multiplier, softcapped: both are
elementwise, so each shard is capped alone), which cuts the vocabulary padding before the
argmax. The context store has none (fc, the norms and k/v_proj of a rank's own heads).

No CUDA graphs: with T > 1 the engine runs eager (tp_runner.py), and a worker would have to
replay each drafter graph in step with rank 0, so DrafterGraphs are never captured here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from swaserve.distributed.launch import TensorParallel
from swaserve.distributed.parallel_state import TPGroup
from swaserve.distributed.step_wire import StepWire
from swaserve.memory.groups import GroupLayout
from swaserve.memory.kv_pool import KVPool
from swaserve.speculative.dflash_model import DFlashDrafter
from swaserve.speculative.dflash_proposer import DFlashProposer


class TPDFlashProposer(DFlashProposer):
    def __init__(
        self,
        drafter: DFlashDrafter,
        target: nn.Module,
        layout: GroupLayout,
        num_target_layers: int,
        page_size: int,
        tp: TPGroup,
        parallel: TensorParallel | None = None,
        wire: StepWire | None = None,
    ) -> None:
        """`parallel` and `wire`: rank 0's, which announces each drafter forward and context
        store (None on the workers, which run them when told)."""
        super().__init__(drafter, target, layout, num_target_layers, page_size)
        self.tp = tp
        self.parallel, self.wire = parallel, wire
        self.embedding = target.model.embed_tokens  # the module: lookup, then all-reduce
        self.vocab_size = int(target.config.vocab_size)

    def _guard(self) -> contextlib.AbstractContextManager:
        """Rank 0: a dead worker is an error naming it (launch.py), not a hang."""
        return self.parallel.guard() if self.parallel is not None else contextlib.nullcontext()

    def store_context(self, *args: Any) -> None:
        """Rank 0: CONTEXT to the workers, then DFlashProposer.store_context (no collective:
        each rank stores its own heads)."""
        with self._guard():
            self.wire.send_context()
        super().store_context(*args)

    def draft_eager(self, head: Tensor, tables: dict[int, Tensor], width: int,
                    kv: KVPool) -> Tensor:
        with self._guard():
            if self.wire is not None:
                self.wire.send_draft(head, [tables[g] for g in self.groups], width)
            return super().draft_eager(head, tables, width, kv)

    def serve_draft(self, head: Tensor, tables: list[Tensor], width: int, kv: KVPool) -> None:
        """A worker's side of a DRAFT: `tables` in the order of `self.groups`, as sent."""
        self.draft_eager(head, dict(zip(self.groups, tables, strict=True)), width, kv)

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """Rank 0: the whole vocabulary's draft logits; a worker: its shard's, never read
        (rank 0 alone takes the argmax)."""
        local = super().draft_logits(hidden).contiguous()
        parts = self.tp.gather(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
