"""Rank 0's ModelRunner under tensor parallelism: the same conversion and forward, each first
announced to the other ranks over the step wire, so that they run the same forward on their
shards and meet rank 0 in every collective of it.

    build(input_ids, inputs)  FORWARD: the attention inputs and the (filled) input ids
    forward(fb)               the model; its all-reduces pair with the workers' forward
    logits(hidden)            LOGITS: the rows; every rank's vocabulary shard, gathered here
    mirror_copies(src, dst)   COPY: the prefix cache's copy-on-write, made on every rank
    mirror_moves(n, ops)      MOVES: a flush of the offload tiers' copies, replayed on every
                              rank's pool and tiers (its own shard of the bytes)
    mirror_landed(n)          LANDED: rank 0 saw flush n's loads land (host_cache.py)
    announce_moe_step(...)    MOE: an expert-parallel step's sizes, before its forward (ep_tp.py)

Sampling, the scheduler, the memory manager and the prefix cache stay on rank 0; page ids mean
the same in every rank's pool. Every exchange runs under `TensorParallel.guard`, so a rank that
died is an error naming it. No CUDA graphs: EngineCore runs eager with T > 1.
"""

from __future__ import annotations

import torch
from torch import nn

from swaserve.attention.base import AttentionBackend, AttentionInputs
from swaserve.distributed.launch import TensorParallel
from swaserve.distributed.step_wire import StepWire
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.engine.model_runner import ModelRunner
from swaserve.memory.host_cache import Op
from swaserve.memory.kv_pool import KVPool


class TPModelRunner(ModelRunner):
    def __init__(
        self,
        model: nn.Module,
        kv: KVPool,
        backend: AttentionBackend,
        device: torch.device,
        parallel: TensorParallel,
    ) -> None:
        super().__init__(model, kv, backend, device)
        self.parallel = parallel
        self.tp = parallel.tp
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.wire = StepWire(self.tp, int(cfg.hidden_size), next(model.parameters()).dtype)

    def build(self, input_ids: torch.Tensor, inputs: AttentionInputs) -> ForwardBatch:
        with self.parallel.guard():
            self.wire.send_forward(inputs, input_ids)
        return super().build(input_ids, inputs)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        with self.parallel.guard():
            return super().forward(fb)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.wire.dtype)
        with self.parallel.guard():
            self.wire.send_logits(hidden)
            parts = self.tp.gather(self.model.compute_logits(hidden).float().contiguous())
        logits = torch.cat(parts, dim=-1)
        if logits.shape[-1] != self.vocab_size:  # the padding of the last shard
            logits = logits[:, : self.vocab_size].contiguous()
        return logits

    def mirror_copies(self, src: list[int], dst: list[int]) -> None:
        with self.parallel.guard():
            self.wire.send_copies(src, dst)

    def mirror_moves(self, flush: int, ops: list[Op]) -> None:
        with self.parallel.guard():
            self.wire.send_moves(flush, ops)

    def mirror_landed(self, flush: int) -> None:
        with self.parallel.guard():
            self.wire.send_landed(flush)

    def announce_moe_step(self, sizes: list[int], fixed: bool) -> None:
        with self.parallel.guard():
            self.wire.send_moe(sizes, fixed)
