"""The target's hidden states that a DFlash drafter trains on, for many sequences at once.

A `SequenceSet` packs sequences flat, one row per token:

    tokens    [N]     sequence i is rows offsets[i] .. offsets[i + 1] - 1, position 0 first
    features  [N, F]  the target's hidden states after `target_layer_ids`, concatenated
                      (Hugging Face's hidden_states[i + 1]), in the target's dtype

`target_features` fills it with prefills of many sequences per forward (the engine's own
model and attention backend over a scratch KV pool, one request per sequence, every token
new), up to `max_batch_tokens` tokens a forward; a longer sequence runs alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from swaserve.attention.base import AttentionInputs
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import build_layout
from swaserve.memory.kv_pool import KVPool
from swaserve.models.blocks import head_dim_of, layer_windows


@dataclass
class SequenceSet:
    tokens: Tensor  # [N] int64
    features: Tensor  # [N, F]
    offsets: list[int]  # len(self) + 1 row offsets
    prompt_lens: list[int]  # per sequence: tokens of its prompt

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]


def feature_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[range]:
    """Consecutive sequences per forward: as many as fit in `max_batch_tokens` (one at least)."""
    out, start, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and total + n > max_batch_tokens:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


@torch.inference_mode()
def _prefill(core: Any, seqs: Sequence[list[int]], layer_ids: tuple[int, ...],
             pool: KVPool, backend: Any, per_group: int) -> Tensor:
    """[sum of lengths, F]: one forward of `seqs` as fresh requests (pages of request r in
    group g: 1 + g * per_group + its own consecutive run)."""
    ps, groups = pool.page_size, pool.layout.num_groups
    tables: list[list[list[int]]] = []
    used = 0
    for s in seqs:
        n = math.ceil(len(s) / ps)
        tables.append([list(range(1 + g * per_group + used, 1 + g * per_group + used + n))
                       for g in range(groups)])
        used += n
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    fb = ForwardBatch(
        ids.to(core.device),
        pos.to(core.device),
        backend,
        backend.prepare(AttentionInputs([len(s) for s in seqs], [0] * len(seqs), tables)),
        pool,
        keep_layers=frozenset(layer_ids),
    )
    core.model(fb)
    return torch.cat([fb.layer_outputs[i] for i in layer_ids], dim=-1)


def target_features(
    core: Any,
    seqs: Sequence[tuple[list[int], int]],
    layer_ids: tuple[int, ...],
    max_batch_tokens: int = 65536,
    progress: Callable[[int], None] | None = None,
) -> SequenceSet:
    """The SequenceSet of (token ids, prompt length) pairs `seqs` on the target `core` (an
    EngineCore: its model, dtype, device and backend class); `progress(k)` after each forward
    of k sequences."""
    hf, ps = core.hf_config, 16
    lengths = [len(s) for s, _ in seqs]
    batches = feature_batches(lengths, max_batch_tokens)
    layout = build_layout(layer_windows(hf))
    # pages a forward needs per group, for the largest batch
    per_group = max((sum(math.ceil(lengths[i] / ps) for i in b) for b in batches), default=1)
    pool = KVPool(layout, 1 + per_group * layout.num_groups, ps, hf.num_key_value_heads,
                  head_dim_of(hf), core.dtype, core.device)
    backend = type(core.runner.backend)(layout, ps, core.device)
    width = len(layer_ids) * int(hf.hidden_size)
    features = torch.empty(sum(lengths), width, dtype=core.dtype, device=core.device)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    for b in batches:
        out = _prefill(core, [seqs[i][0] for i in b], layer_ids, pool, backend, per_group)
        with torch.no_grad():
            features[offsets[b.start] : offsets[b.stop]] = out
        if progress is not None:
            progress(len(b))
    tokens = torch.tensor([t for s, _ in seqs for t in s], dtype=torch.int64)
    del pool
    return SequenceSet(tokens.to(core.device), features, offsets, [p for _, p in seqs])
