"""FP8 KV scales from a calibration pass: one forward over fixed token ids into a small
model-dtype pool, recording each layer's K and V absolute maximum; scale = headroom * amax /
448, so the calibrated range maps below the e4m3 limit with room for larger activations."""

from __future__ import annotations

import math

import torch
from torch import nn

from swaserve.attention.base import AttentionInputs
from swaserve.attention.torch_backend import TorchBackend
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import GroupLayout
from swaserve.memory.kv_pool import FP8_MAX, KVPool

HEADROOM = 2.0
CALIBRATION_TOKENS = 512


class _RecordingPool(KVPool):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        n = len(self.layout.layer_to_slot)
        self.amax = torch.zeros(2, n, device=self.kv.device)

    def store(self, layer_id, k, v, slot_mapping) -> None:  # noqa: ANN001
        self.amax[0, layer_id] = torch.maximum(self.amax[0, layer_id], k.abs().max().float())
        self.amax[1, layer_id] = torch.maximum(self.amax[1, layer_id], v.abs().max().float())
        super().store(layer_id, k, v, slot_mapping)


@torch.inference_mode()
def calibrate_kv_scales(
    model: nn.Module,
    layout: GroupLayout,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    vocab_size: int,
    seed: int = 0,
) -> tuple[list[float], list[float]]:
    gen = torch.Generator().manual_seed(seed)
    n = CALIBRATION_TOKENS
    ids = torch.randint(0, vocab_size, (n,), generator=gen)
    pages = math.ceil(n / page_size)
    pool = _RecordingPool(layout, pages + 1, page_size, kv_heads, head_dim, dtype, device)
    backend = TorchBackend(layout, page_size, device)
    table = list(range(1, pages + 1))
    inputs = AttentionInputs([n], [0], [[table] * len(layout.groups)])
    fb = ForwardBatch(ids.to(device), torch.arange(n, device=device), backend,
                      backend.prepare(inputs), pool)
    model(fb)
    scales = (pool.amax * HEADROOM / FP8_MAX).clamp(min=1e-6).tolist()  # once, at start-up
    return scales[0], scales[1]
