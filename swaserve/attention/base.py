"""The attention seam (docs/architecture.md §7): `prepare` once per step, `forward` once per layer.

One contract covers prefill, decode and mixed batches: request i has `query_lens[i]` new tokens
at positions `[context_lens[i], context_lens[i] + query_lens[i])` and attends, causally and
within its layer's window, to its cached keys plus its new ones. New K/V are written to the
pool through a flat `slot_mapping` (page * page_size + offset) per attention group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from swaserve.attention.kernels.rope_store import QKPrologue
    from swaserve.engine.forward_batch import ForwardBatch
    from swaserve.memory.groups import GroupLayout
    from swaserve.models.blocks import AttentionSpec


@dataclass
class AttentionInputs:
    """CPU-side description of one step, per request (request-major order)."""

    query_lens: list[int]
    context_lens: list[int]  # tokens whose K/V are already in the pool
    # [request][group] -> page ids (NULL where retired); or, from the engine, `arrays`
    page_tables: list[list[list[int]]] | None = None
    # per group, the same tables as one `[B, W]` int32 array with zeros (NULL) after each
    # request's entries (MemoryManager.table_arrays: no per-step list building)
    arrays: list[np.ndarray] | None = None

    @property
    def num_groups(self) -> int:
        if self.arrays is not None:
            return len(self.arrays)
        return len(self.page_tables[0]) if self.page_tables else 0

    def group_table(self, group: int) -> np.ndarray:
        """Group `group`'s tables as a `[B, W]` int32 array, W >= 1, zero-padded."""
        if self.arrays is not None:
            return self.arrays[group]
        assert self.page_tables is not None, "AttentionInputs without page tables"
        rows = [pt[group] for pt in self.page_tables]
        out = np.zeros((len(rows), max(1, max(map(len, rows), default=0))), dtype=np.int32)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out


def slot_mapping(
    page_table: list[int], start: int, end: int, page_size: int
) -> torch.Tensor:
    """Flat pool slots of token positions [start, end) under one page table."""
    pos = torch.arange(start, end)
    table = torch.tensor(page_table, dtype=torch.int64)
    return table[pos // page_size] * page_size + pos % page_size


class AttentionBackend(ABC):
    # Whether `forward` takes a `prologue` (the q/k norms and rotary, fused with the K/V store)
    fuses_qk_prologue = False

    def __init__(self, layout: GroupLayout, page_size: int, device: torch.device) -> None:
        self.layout = layout
        self.page_size = page_size
        self.device = device

    @abstractmethod
    def prepare(self, inputs: AttentionInputs) -> Any:
        """Build this step's metadata (device tensors), shared by every layer."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
        fb: ForwardBatch,
        out: torch.Tensor | None = None,
        prologue: QKPrologue | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store k/v `[T, Hkv, D]` in the pool, attend with q `[T, H, D]`; returns `[T, H, D]`
        (written into `out` when given: the static buffer of piecewise CUDA graphs). With a
        `prologue` (only where `fuses_qk_prologue`), q and k are not normed and rotated yet:
        the backend does that first, in place, at `fb.positions`. `kv_stored` (only where the
        backend has `kv_destination`): q and k are rotated and k/v already in the pool; every
        backend also takes `kv_stored` with k = v = None: a layer that reads another layer's
        K/V (`GroupLayout.kv_sources`), q rotated."""
