"""Attention groups: how layers share one page id (docs/architecture.md §3, vLLM's hybrid
allocator).

Layers are partitioned into groups of one attention kind, `full` or `swa(window)`. Every group
has the same number of layer slots, `slots_per_page` (the last group of a kind is padded), so
one physical page id holds `page_size` tokens for one layer slot of every layer of the group
that owns it, and a single page size serves every group:

    kv[slot, k|v, page, offset, head, dim]      slot = layer_to_slot[layer]

    page p owned by group g = (layers a, b, c), slots_per_page = 4:
      slot 0 -> layer a   slot 1 -> layer b   slot 2 -> layer c   slot 3 -> padding (unused)

A page id belongs to one group at a time; which group is decided when it is allocated, so
memory flows freely between full and SWA groups (no fixed split).

Choosing `slots_per_page` (the cost rule). Padding wastes memory in every page its group
owns; more groups cost one page table, one partial last page and one set of kernel metadata
each. We weigh both at a reference request of `REFERENCE_CONTEXT` tokens, where a full layer
holds `REFERENCE_CONTEXT` tokens and an SWA layer `min(window, REFERENCE_CONTEXT)`:

    waste(S)  = (slot-tokens allocated with padding - slot-tokens needed) / slot-tokens needed
    cost(S)   = waste(S) + GROUP_COST * num_groups(S)          GROUP_COST = 1% per group

and take the S in 1..max(layers of one kind) of least cost (ties: fewer groups, then smaller
S). Padding a full group is expensive (its pages grow with the context), padding an SWA group
is cheap (its pages stay near the window). Examples (window 512 / 1024, context 8192):

    Gemma 3 270M  15 swa + 3 full  -> S=3:  5 swa + 1 full groups, no padding
    Gemma 3 1B    22 swa + 4 full  -> S=4:  6 swa (2 padded slots) + 1 full group
    Gemma 3 27B   52 swa + 10 full -> S=10: 6 swa (8 padded slots, ~6% at 8k) + 1 full group
    gpt-oss       12 swa + 12 full -> S=12: 1 + 1 groups
    all full or all swa (one kind) -> S=layers: one group
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

REFERENCE_CONTEXT = 8192
GROUP_COST = Fraction(1, 100)


@dataclass(frozen=True)
class AttentionGroup:
    index: int
    kind: str  # "full" | "swa"
    window: int | None  # None for full; query q sees key k iff q - window < k <= q
    layers: tuple[int, ...]  # model layer ids, slot i of a page holds layers[i]

    @property
    def is_swa(self) -> bool:
        return self.kind == "swa"


@dataclass(frozen=True)
class GroupLayout:
    groups: tuple[AttentionGroup, ...]
    slots_per_page: int
    layer_to_group: tuple[int, ...]
    layer_to_slot: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layer_to_group)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def num_padded_slots(self) -> int:
        return self.slots_per_page * len(self.groups) - self.num_layers


def _footprint(window: int | None) -> int:
    """Tokens one layer of this kind holds for the reference request."""
    return REFERENCE_CONTEXT if window is None else min(window, REFERENCE_CONTEXT)


def choose_slots_per_page(kind_sizes: dict[int | None, int]) -> int:
    """The slots per page of least cost (see the module docstring) for {window: num_layers}."""
    needed = sum(n * _footprint(w) for w, n in kind_sizes.items())
    best: tuple[Fraction, int, int] | None = None
    for s in range(1, max(kind_sizes.values()) + 1):
        groups = sum(math.ceil(n / s) for n in kind_sizes.values())
        allocated = sum(math.ceil(n / s) * s * _footprint(w) for w, n in kind_sizes.items())
        key = (Fraction(allocated - needed, needed) + GROUP_COST * groups, groups, s)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2]


def build_layout(layer_windows: Sequence[int | None], all_full: bool = False) -> GroupLayout:
    """Partition layers into attention groups of equal slot count.

    `layer_windows[l]` is None for a full-attention layer, else its sliding window (>= 1).
    Layers with the same window form one kind. `all_full=True` treats every layer as full (the
    baseline of the memory benchmark). Groups are numbered by their first layer.
    """
    if not layer_windows:
        raise ValueError("build_layout needs at least one layer")
    windows: list[int | None] = [None if all_full else w for w in layer_windows]
    kinds: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"layer {layer}: window must be a positive int or None, got {w!r}")
        kinds.setdefault(w, []).append(layer)
    slots = choose_slots_per_page({w: len(ls) for w, ls in kinds.items()})

    chunks: list[tuple[int | None, tuple[int, ...]]] = []
    for w, layers in kinds.items():
        for i in range(0, len(layers), slots):
            chunks.append((w, tuple(layers[i : i + slots])))
    chunks.sort(key=lambda c: c[1][0])

    groups = []
    layer_to_group = [0] * len(windows)
    layer_to_slot = [0] * len(windows)
    for index, (w, layers) in enumerate(chunks):
        groups.append(AttentionGroup(index, "full" if w is None else "swa", w, layers))
        for slot, layer in enumerate(layers):
            layer_to_group[layer] = index
            layer_to_slot[layer] = slot
    return GroupLayout(tuple(groups), slots, tuple(layer_to_group), tuple(layer_to_slot))
