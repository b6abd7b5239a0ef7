"""The model-side batch: device tensors plus the backend's typed metadata, built once per step
by `ModelRunner.prepare` (the one conversion from the scheduler's CPU-side batch)."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class DeviceTokens:
    """Input ids that exist only on the device: `input_ids[dst[i]] = ids[rows[i]]`, where
    `ids` are the sampled tokens of the step still in flight (the overlap schedule)."""

    dst: list[int]
    rows: list[int]
    ids: torch.Tensor

    def apply(self, input_ids: torch.Tensor) -> None:
        idx = torch.tensor([self.dst, self.rows], dtype=torch.int64).to(
            input_ids.device, non_blocking=True
        )
        input_ids[idx[0]] = self.ids[idx[1]]
