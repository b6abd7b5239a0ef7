"""Which part of a full parameter one tensor-parallel rank holds, and the copy of checkpoint
tensors (addressed in the full parameter's coordinates) into that part.

Along one dimension `dim`, a rank keeps the full tensor's index ranges `ranges`, laid end to
end in its local tensor, then zeros up to the local size (a vocabulary not divisible by T):

    full, along dim:   [ ... lo0 ===== hi0 ... lo1 ===== hi1 ... ]
    local, along dim:  [ lo0 ===== hi0 | lo1 ===== hi1 | 0 0 0 ]
                         offset 0        hi0 - lo0       padding

Two ranges describe a fused gate/up weight (each rank keeps its rows of both halves); one range
every other split. The other dimensions are whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    full_shape: tuple[int, ...]
    dim: int
    ranges: tuple[tuple[int, int], ...]

    def kept(self) -> int:
        """Elements of the local tensor that come from the full one (not padding)."""
        rest = 1
        for i, n in enumerate(self.full_shape):
            if i != self.dim:
                rest *= n
        return rest * sum(hi - lo for lo, hi in self.ranges)

    def take(self, full: torch.Tensor, local_size: int | None = None) -> torch.Tensor:
        """This rank's local tensor from the full one (padded with zeros to `local_size`)."""
        parts = [full.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges]
        out = torch.cat(parts, dim=self.dim)
        pad = (local_size or out.shape[self.dim]) - out.shape[self.dim]
        if pad:
            shape = list(out.shape)
            shape[self.dim] = pad
            out = torch.cat([out, out.new_zeros(shape)], dim=self.dim)
        return out

    def copy_into(self, local: torch.Tensor, index: tuple | None, t: torch.Tensor) -> int:
        """Write checkpoint tensor `t`, which fills `full[index]` (index: None, or a tuple of
        ints and step-less slices over the leading dims), into the local tensor: the parts of
        it inside the kept ranges. Returns the elements written; ValueError on a shape that
        does not fit `full[index]`."""
        spans, squeezed = self._spans(index)
        want = tuple(b - a for (a, b), sq in zip(spans, squeezed) if not sq)
        if tuple(t.shape) != want:
            raise ValueError(f"shape {tuple(t.shape)} != {want} of the full parameter")
        a, b = spans[self.dim]
        t_dim = self.dim - sum(squeezed[: self.dim])  # the dim of t along `dim`, if any
        written, offset = 0, 0
        for lo, hi in self.ranges:
            x, y = max(a, lo), min(b, hi)
            if x < y:
                dst = [slice(s0, s1) if not sq else s0 for (s0, s1), sq in zip(spans, squeezed)]
                dst[self.dim] = slice(offset + x - lo, offset + y - lo)
                src = t
                if not squeezed[self.dim]:
                    src = t.narrow(t_dim, x - a, y - x)
                else:
                    dst[self.dim] = offset + x - lo
                local[tuple(dst)].copy_(src)
                written += src.numel()
            offset += hi - lo
        return written

    def _spans(self, index: tuple | None) -> tuple[list[tuple[int, int]], list[bool]]:
        """Per dim of the full tensor: the [start, stop) that `index` selects, and whether the
        dim is indexed by an int (absent from the indexed tensor)."""
        spans = [(0, n) for n in self.full_shape]
        squeezed = [False] * len(self.full_shape)
        for d, ix in enumerate(index or ()):
            n = self.full_shape[d]
            if isinstance(ix, slice):
                if ix.step not in (None, 1):
                    raise ValueError(f"strided index {ix} into a sharded parameter")
                start, stop, _ = ix.indices(n)
                spans[d] = (start, stop)
            else:
                i = int(ix) % n
                spans[d] = (i, i + 1)
                squeezed[d] = True
        return spans, squeezed
