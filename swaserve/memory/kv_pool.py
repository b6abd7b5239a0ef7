"""KV storage: the tensors behind the page ids that the MemoryManager hands out.

Page-major storage `pages[num_pages, slots_per_page, 2 (k, v), page_size, kv_heads, head_dim]`:
page id p of group g holds, for each layer of g, that layer's K and V of `page_size` tokens,
and all of it is one contiguous block `pages[p]`. A KV transfer or an offload of a page is one
segment (a write of scattered pages through NIXL cost ~8 us per segment on the H200, and the
plane-major layout it replaces made 2 x slots_per_page segments of every page). `kv` is the
same memory seen as `[slot, k|v, page, offset, head, dim]`: `kv[layer_to_slot[layer], 0]` is a
layer's K cache `[num_pages, page_size, kv_heads, head_dim]`, a strided view whose page stride
spans the whole page (the kernels take strides, and index pages in int64). Storage only:
indices and refcounts live in memory/manager.py.

Layers of different K/V sizes (`GroupLayout.kv_shapes`, Gemma 4): the row shape is one unit
`(1, unit_width)` and a layer of u units takes u consecutive slots, its K `[page_size, heads,
head_dim]` then its V in one contiguous block; `layer_cache` and the row views are then per layer
(same strides form: page stride the whole page). A layer that shares another's K/V
(`kv_sources`) sees its source's cache and scales.

FP8 (`float8_e4m3fn`): each layer has a K and a V scale; the pool stores `round(x / scale)`
saturated at +-448, and readers multiply back (the Triton kernels fold the scales in).
"""

from __future__ import annotations

import math

import torch

from swaserve.memory.groups import GroupLayout

FP8_MAX = 448.0
PAGE_BYTES = 4096  # the OS page: lazy_zeros aligns the pool to it


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages become resident only when written (`torch.zeros` writes
    every byte: a 2 GiB pool was 2 GiB of RSS from the start, in every engine of a test run).
    An anonymous mmap: fresh zero pages from the kernel, page-aligned, whatever state malloc
    is in (calloc is lazy only while it maps a fresh block: a CI run once saw its 256 MiB
    resident at once). The tensor keeps the mapping alive."""
    import mmap

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


class KVPool:
    def __init__(
        self,
        layout: GroupLayout,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.is_fp8 = dtype == torch.float8_e4m3fn
        # mixed K/V widths: rows of one unit; the layers' own shapes come from the layout
        num_kv_heads, head_dim = layout.row_shape(num_kv_heads, head_dim)
        shape = (num_pages, layout.slots_per_page, 2, page_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            self.pages = lazy_zeros(shape, dtype)
        else:
            self.pages = torch.zeros(shape, dtype=dtype, device=device)
        self.kv = self.pages.permute(1, 2, 0, 3, 4, 5)  # [slot, k|v, page, offset, head, dim]
        n = len(layout.layer_to_slot)
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._layer_rows: list[tuple[torch.Tensor, int, int]] = []  # (rows, first, page_rows)
        flat = self.pages.view(-1)
        page_elems = self.pages[0].numel() if num_pages else 0
        unit = num_kv_heads * head_dim
        for layer in range(n):
            slot = layout.layer_to_slot[layer]
            h, d = (num_kv_heads, head_dim) if layout.kv_shapes is None \
                else layout.kv_shapes[layer]  # fmt: skip
            width, off = h * d, flat.storage_offset() + slot * 2 * page_size * unit
            size, stride = (num_pages, page_size, h, d), (page_elems, width, d, 1)
            self._caches.append((flat.as_strided(size, stride, off),
                                 flat.as_strided(size, stride, off + page_size * width)))
            # pages viewed as rows of [h, d]: (page, slot, k|v, offset) -> one row
            self._layer_rows.append((flat.view(-1, h, d), (off - flat.storage_offset()) // width,
                                     page_elems // width))
        self.k_scales = [1.0] * n  # per layer; 1.0 and unused unless fp8
        self.v_scales = [1.0] * n

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """Per-layer scales; a KV-sharing layer's are its source's, whatever is given."""
        src = [self.layout.kv_source(i) for i in range(len(k_scales))]
        self.k_scales = [k_scales[s] for s in src]
        self.v_scales = [v_scales[s] for s in src]

    def layer_scales(self, layer_id: int) -> tuple[float, float]:
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def max_layer_shape(self) -> tuple[int, int]:
        """(most KV heads, largest head size) over the layers: static buffers sized for any."""
        shapes = [k.shape[2:] for k, _ in self._caches]
        return max(h for h, _ in shapes), max(d for _, d in shapes)

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each `[num_pages, page_size, kv_heads, head_dim]`."""
        return self._caches[layer_id]

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if self.is_fp8:
            return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(self.dtype)
        return x.to(self.dtype)

    def row_addressing(self, layer_id: int) -> tuple[torch.Tensor, int, int]:
        """(rows, first, page_rows): the pool as rows `[N, kv_heads, head_dim]` of this layer's
        shape, where the K of a layer's flat slot s is row
        `s + (s // page_size) * (page_rows - page_size) + first` and its V that row + page_size
        (the native CPU kernels address the pool so)."""
        return self._layer_rows[layer_id]

    def _k_rows(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows of `row_addressing(layer_id)[0]` holding the K of flat slots
        `page * page_size + offset` of a layer; its V rows are these + page_size."""
        _, first, page_rows = self.row_addressing(layer_id)
        ps = self.page_size
        return slots + (slots // ps) * (page_rows - ps) + first

    def store(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatter new K/V `[T, kv_heads, head_dim]` to flat slots `page * page_size + offset`."""
        ks, vs = self.layer_scales(layer_id)
        rows = self._k_rows(layer_id, slot_mapping)
        table = self._layer_rows[layer_id][0]
        table[rows] = self._encode(k, ks)
        table[rows + self.page_size] = self._encode(v, vs)

    def read(self, layer_id: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[len(slots), kv_heads, head_dim]` at flat slots, dequantised to float32."""
        rows = self._k_rows(layer_id, slots)
        # index_select, not advanced indexing: it copies whole [kv_heads, head_dim] rows
        # (~7x faster on CPU for decode batches' thousands of slots)
        table = self._layer_rows[layer_id][0]
        k = torch.index_select(table, 0, rows).float()
        v = torch.index_select(table, 0, rows + self.page_size).float()
        if self.is_fp8:
            ks, vs = self.layer_scales(layer_id)
            k, v = k * ks, v * vs
        return k, v

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (every layer slot, K and V): copy-on-write of a shared page."""
        if src:
            # Host lists -> device without a stream sync (torch.tensor(..., device=cuda) waits).
            s = torch.tensor(src).to(self.pages.device, non_blocking=True)
            d = torch.tensor(dst).to(self.pages.device, non_blocking=True)
            self.pages[d] = self.pages[s]
