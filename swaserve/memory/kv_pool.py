"""KV storage: the tensors behind the page ids that the MemoryManager hands out.

Layout `[slots_per_page, 2 (k, v), num_pages, page_size, kv_heads, head_dim]`: page id p of
group g holds, for each layer of g, that layer's K and V of `page_size` tokens at
`kv[layer_to_slot[layer], :, p]`. Storage only: indices and refcounts live in memory/manager.py.
"""

from __future__ import annotations

import torch

from swaserve.memory.groups import GroupLayout


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
        shape = (layout.slots_per_page, 2, num_pages, page_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each `[num_pages, page_size, kv_heads, head_dim]`."""
        slot = self.layout.layer_to_slot[layer_id]
        return self.kv[slot, 0], self.kv[slot, 1]

    def store(
        self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Scatter new K/V `[T, kv_heads, head_dim]` to flat slots `page * page_size + offset`."""
        k_cache, v_cache = self.layer_cache(layer_id)
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(self.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(self.dtype)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages (every layer slot, K and V): copy-on-write of a shared page."""
        if src:
            s = torch.tensor(src, device=self.kv.device)
            d = torch.tensor(dst, device=self.kv.device)
            self.kv[:, :, d] = self.kv[:, :, s]
