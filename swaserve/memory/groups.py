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

Layers of different KV sizes (Gemma 4: sliding layers of [Hkv, 256], full ones of [Hkv', 512]).
A layer's K row is `heads x head_dim` elements ("width"); the pool's rows are the greatest common
divisor of the widths (one "unit"), and a layer of width u units takes u consecutive slots of a
page (its K then its V, each `page_size x width`, one contiguous block). Kinds are then (window,
width); the rule above runs over unit slots with S a multiple of every width, so a page's bytes
are the same for every group. Equal widths give the layout above exactly.

KV sharing (Gemma 4's last `num_kv_shared_layers` layers): a layer that reads another layer's
K/V (`kv_sources[l] != l`) owns no slot; its group and slot are its source's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

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
    slots_per_page: int  # unit slots of a page
    layer_to_group: tuple[int, ...]
    layer_to_slot: tuple[int, ...]  # a layer's first unit slot (its source's, if it shares)
    # per layer (heads, head_dim) of its K/V rows, where widths differ; None: every layer has
    # the pool's row shape (the caller's)
    kv_shapes: tuple[tuple[int, int], ...] | None = None
    # per layer, the layer whose K/V it reads (itself unless it shares); None: no sharing
    kv_sources: tuple[int, ...] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_to_group)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def unit_width(self) -> int | None:
        """Elements of a pool row (K of one token in one unit slot) when widths differ."""
        if self.kv_shapes is None:
            return None
        return math.gcd(*(h * d for h, d in self.kv_shapes))

    def units(self, layer: int) -> int:
        """Unit slots layer `layer`'s K/V take in a page (1 unless widths differ)."""
        if self.kv_shapes is None:
            return 1
        h, d = self.kv_shapes[layer]
        return h * d // self.unit_width

    def kv_source(self, layer: int) -> int:
        return layer if self.kv_sources is None else self.kv_sources[layer]

    def row_shape(self, kv_heads: int, head_dim: int) -> tuple[int, int]:
        """The pool's row shape: the model's (kv_heads, head_dim), or one unit when widths
        differ."""
        return (kv_heads, head_dim) if self.kv_shapes is None else (1, self.unit_width)

    @property
    def num_padded_slots(self) -> int:
        used = sum(self.units(layer) for g in self.groups for layer in g.layers)
        return self.slots_per_page * len(self.groups) - used


def _footprint(window: int | None) -> int:
    """Tokens one layer of this kind holds for the reference request."""
    return REFERENCE_CONTEXT if window is None else min(window, REFERENCE_CONTEXT)


def choose_slots_per_page(
    kind_sizes: dict[int | None, int] | dict[tuple[int | None, int], int],
) -> int:
    """The unit slots per page of least cost (see the module docstring) for {window: layers}
    or {(window, units a layer): layers}; a multiple of every kind's units."""
    kinds = {(k if isinstance(k, tuple) else (k, 1)): n for k, n in kind_sizes.items()}
    step = math.lcm(*(u for _, u in kinds))
    needed = sum(n * u * _footprint(w) for (w, u), n in kinds.items())
    best: tuple[Fraction, int, int] | None = None
    for s in range(step, max(n * u for (_, u), n in kinds.items()) + step, step):
        per = {k: math.ceil(n / (s // k[1])) for k, n in kinds.items()}  # groups of each kind
        groups = sum(per.values())
        allocated = sum(per[k] * s * _footprint(k[0]) for k in kinds)
        key = (Fraction(allocated - needed, needed) + GROUP_COST * groups, groups, s)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2]


def build_layout(
    layer_windows: Sequence[int | None],
    all_full: bool = False,
    kv_shapes: Sequence[tuple[int, int]] | None = None,
    kv_sources: Sequence[int] | None = None,
) -> GroupLayout:
    """Partition layers into attention groups of equal slot count.

    `layer_windows[l]` is None for a full-attention layer, else its sliding window (>= 1).
    Layers with the same window (and K/V width) form one kind. `all_full=True` treats every
    layer as full (the baseline of the memory benchmark). `kv_shapes[l]`: layer l's
    (kv_heads, head_dim) where they differ between layers; `kv_sources[l]`: the earlier layer
    whose K/V layer l reads (l itself when it has its own). Groups are numbered by their first
    layer.
    """
    if not layer_windows:
        raise ValueError("build_layout needs at least one layer")
    n = len(layer_windows)
    windows: list[int | None] = [None if all_full else w for w in layer_windows]
    shapes = None
    if kv_shapes is not None:
        shapes = tuple((int(h), int(d)) for h, d in kv_shapes)
        if len(shapes) != n:
            raise ValueError(f"kv_shapes has {len(shapes)} entries for {n} layers")
        if len(set(shapes)) == 1:
            shapes = None  # one shape: the plain layout
    sources = tuple(range(n)) if kv_sources is None else tuple(int(x) for x in kv_sources)
    if len(sources) != n:
        raise ValueError(f"kv_sources has {len(sources)} entries for {n} layers")
    for layer, src in enumerate(sources):
        if src != layer and not (0 <= src < layer and sources[src] == src):
            raise ValueError(f"layer {layer}: its KV source {src} must be an earlier layer "
                             "with its own K/V")
        if src != layer and windows[src] != windows[layer]:
            raise ValueError(f"layer {layer} reads layer {src}'s K/V but their windows differ")
        if src != layer and shapes is not None and shapes[src] != shapes[layer]:
            raise ValueError(f"layer {layer} reads layer {src}'s K/V but their K/V shapes "
                             f"differ ({shapes[layer]} against {shapes[src]})")
    gcd = math.gcd(*(h * d for h, d in shapes)) if shapes else 1

    def units(layer: int) -> int:
        return shapes[layer][0] * shapes[layer][1] // gcd if shapes else 1

    kinds: dict[tuple[int | None, int], list[int]] = {}
    for layer, w in enumerate(windows):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"layer {layer}: window must be a positive int or None, got {w!r}")
        if sources[layer] == layer:
            kinds.setdefault((w, units(layer)), []).append(layer)
    slots = choose_slots_per_page({k: len(ls) for k, ls in kinds.items()})

    chunks: list[tuple[int | None, int, tuple[int, ...]]] = []
    for (w, u), layers in kinds.items():
        per = slots // u
        for i in range(0, len(layers), per):
            chunks.append((w, u, tuple(layers[i : i + per])))
    chunks.sort(key=lambda c: c[2][0])

    groups = []
    layer_to_group = [0] * n
    layer_to_slot = [0] * n
    for index, (w, u, layers) in enumerate(chunks):
        groups.append(AttentionGroup(index, "full" if w is None else "swa", w, layers))
        for i, layer in enumerate(layers):
            layer_to_group[layer] = index
            layer_to_slot[layer] = i * u
    for layer, src in enumerate(sources):
        layer_to_group[layer], layer_to_slot[layer] = layer_to_group[src], layer_to_slot[src]
    return GroupLayout(
        tuple(groups), slots, tuple(layer_to_group), tuple(layer_to_slot), shapes,
        None if kv_sources is None or sources == tuple(range(n)) else sources,
    )


def model_layout(
    model: Any, layer_windows: Sequence[int | None], all_full: bool = False,
    extra_windows: Sequence[int | None] = (),
    extra_shape: tuple[int, int] | None = None,
    base_shape: Callable[[], tuple[int, int]] | None = None,
) -> GroupLayout:  # fmt: skip
    """The layout of a built model's layers, then `extra_windows` (a DFlash drafter's layers, of
    K/V shape `extra_shape`): per-layer K/V shapes and KV sharing where the model declares them
    (`model.kv_layout() -> (shapes, sources)`, Gemma 4; shapes per rank under TP). A model that
    declares none has one shape, `base_shape()` (asked only when a drafter's differs)."""
    declared = getattr(model, "kv_layout", None)
    shapes, sources = declared() if declared is not None else (None, None)
    windows = list(layer_windows) + list(extra_windows)
    if extra_windows and extra_shape is not None:
        if shapes is None and base_shape is not None and base_shape() != tuple(extra_shape):
            shapes = [base_shape()] * len(layer_windows)
        if shapes is not None:
            shapes = list(shapes) + [tuple(extra_shape)] * len(extra_windows)
    elif extra_windows and shapes is not None:
        raise ValueError("the extra layers' K/V shape is needed beside per-layer shapes")
    if sources is not None:
        sources = list(sources) + list(range(len(sources), len(windows)))
    return build_layout(windows, all_full, shapes, sources)
