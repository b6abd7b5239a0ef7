"""FP8 KV scales from a calibration pass: one forward over fixed token ids into a small
model-dtype pool, recording each layer's K and V absolute maximum; scale = headroom * amax /
448, so the calibrated range maps below the e4m3 limit with room for larger activations.
A DFlash drafter's pool layers are calibrated on the same tokens: their context K/V come from
the target's hidden states of that pass."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from swaserve.attention.base import AttentionInputs
from swaserve.attention.torch_backend import TorchBackend
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import GroupLayout
from swaserve.memory.kv_pool import FP8_MAX, KVPool

if TYPE_CHECKING:
    from swaserve.speculative.dflash_proposer import DFlashProposer

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


def _calibration_pass(model: nn.Module, layout: GroupLayout, page_size: int, kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device, vocab_size: int,
                      seed: int, keep_layers: tuple[int, ...] = ()
                      ) -> tuple[_RecordingPool, ForwardBatch]:
    """The target's forward over the calibration tokens into a recording pool."""
    gen = torch.Generator().manual_seed(seed)
    n = CALIBRATION_TOKENS
    ids = torch.randint(0, vocab_size, (n,), generator=gen)
    pages = math.ceil(n / page_size)
    pool = _RecordingPool(layout, pages + 1, page_size, kv_heads, head_dim, dtype, device)
    backend = TorchBackend(layout, page_size, device)
    table = list(range(1, pages + 1))
    inputs = AttentionInputs([n], [0], [[table] * len(layout.groups)])
    fb = ForwardBatch(ids.to(device), torch.arange(n, device=device), backend,
                      backend.prepare(inputs), pool, keep_layers=frozenset(keep_layers))
    model(fb)
    return pool, fb


def _scales(pool: _RecordingPool) -> tuple[list[float], list[float]]:
    scales = (pool.amax * HEADROOM / FP8_MAX).clamp(min=1e-6).tolist()  # once, at start-up
    return scales[0], scales[1]


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
    pool, _ = _calibration_pass(model, layout, page_size, kv_heads, head_dim, dtype, device,
                                vocab_size, seed)
    return _scales(pool)


@torch.inference_mode()
def calibrate_drafter_kv_scales(
    model: nn.Module,
    proposer: DFlashProposer,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    vocab_size: int,
    seed: int = 0,
) -> dict[int, tuple[float, float]]:
    """A DFlash drafter's pool layers (its context K/V, from the target's hidden states of the
    same calibration tokens): pool layer id -> (k scale, v scale)."""
    keep = tuple(proposer.cfg.target_layer_ids)
    pool, fb = _calibration_pass(model, proposer.layout, page_size, kv_heads, head_dim, dtype,
                                 device, vocab_size, seed, keep)
    features = torch.cat([fb.layer_outputs[i] for i in keep], dim=-1)
    drafter = proposer.drafter
    ctx = drafter.project_context(features.to(proposer.dtype))
    slots = fb.positions + page_size  # the pass's pages are 1, 2, ... in order
    for j, layer_id in enumerate(proposer.pool_layer_ids):
        k, v = drafter.context_kv(j, ctx, fb.positions)[:2]
        pool.store(layer_id, k.to(dtype), v.to(dtype), slots)
    ks, vs = _scales(pool)
    return {i: (ks[i], vs[i]) for i in proposer.pool_layer_ids}
