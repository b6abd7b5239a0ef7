"""The model-side batch: device tensors plus the backend's typed metadata, built once per step
by `ModelRunner.prepare` (the one conversion from the scheduler's CPU-side batch)."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from swaserve.attention.base import AttentionBackend
    from swaserve.memory.kv_pool import KVPool


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of every request, request-major
    positions: torch.Tensor  # [T] int64
    backend: AttentionBackend
    metadata: Any  # the backend's own dataclass (see attention/*_backend.py)
    kv: KVPool
    # Layers whose output the caller wants besides the last one (a DFlash drafter reads the
    # target's hidden states after these); the model fills `layer_outputs` with Hugging Face's
    # hidden_states[i + 1]: the residual stream after layer i, final-normed for the last layer.
    keep_layers: frozenset[int] = frozenset()
    layer_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    # per-step values layers share: rotary cos/sin by `Rotary.table_key` (ops/cpu_prologue.py)
    rope_tables: dict = field(default_factory=dict)

    def keep(self, layer: int, stream: torch.Tensor, normed: torch.Tensor, last: bool) -> None:
        """Called by the model after each layer (cheap when nothing is kept)."""
        if layer in self.keep_layers:
            self.layer_outputs[layer] = normed if last else stream


@dataclass
class DeviceTokens:
    """Input ids that exist only on the device: `input_ids[dst[i]] = ids[rows[i]]`, where
    `ids` are the sampled tokens of the step still in flight (the overlap schedule) or a
    step's DFlash drafts (engine/speculation.py). `dst` indexes the step's packed tokens."""

    dst: list[int]
    rows: list[int]
    ids: torch.Tensor

    def apply(self, input_ids: torch.Tensor) -> None:
        idx = torch.tensor([self.dst, self.rows], dtype=torch.int64).to(
            input_ids.device, non_blocking=True
        )
        input_ids[idx[0]] = self.ids[idx[1]]

    def in_chunks(self, lengths: list[int], q: int) -> DeviceTokens:
        """The same for input ids laid out as one row of `q` per request (request r's
        `lengths[r]` tokens first: a verify graph's), instead of packed."""
        starts = list(itertools.accumulate(lengths, initial=0))
        dst = []
        for d in self.dst:
            r = bisect.bisect_right(starts, d) - 1
            dst.append(r * q + d - starts[r])
        return DeviceTokens(dst, self.rows, self.ids)
