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
