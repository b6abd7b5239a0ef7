"""CPU float32 GEMMs through oneDNN on weights held once, in oneDNN's blocked layout.

At decode sizes (a few to a few hundred rows) `F.linear` on this CPU (MKL) reads its weight far
below the memory bandwidth: Gemma 3 270M's tied 262,144 x 640 head at 16 rows takes ~120 ms,
oneDNN on the dense weight ~50 ms, oneDNN on the weight reordered to its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) ~32 ms (benchmarks/RESULTS.md, CPU results).

A `PackedWeight` REPLACES the dense weight: the reordered tensor is the only copy (the dense one
is freed once the reorder is made, so resident weight memory does not grow; blocks that do not
divide the shape are zero-padded, a few rows at most). Its layout, decoded and checked when
packed, is

    blocks[b, k, j] = W[b * B + j, k]      b < ceil(N / B), k < K' (>= K), j < B

(B rows interleaved per block; B = 64 for float32 on AVX-512), so the rows of W can still be
gathered from it: a tied embedding table packed this way serves both the lookup (`rows`) and the
head's GEMM (`linear`) from one storage. A layout that does not decode leaves lookups refused
(`rows` raises) and `cpu_pack` leaves such a tied table dense (its head then runs F.linear).

`PackedLinear` and `PackedEmbedding` replace `nn.Linear` / `nn.Embedding` modules
(`swaserve/ops/cpu_pack.py` decides which); they have no `weight` parameter: reading `.weight`
raises, `dense_weight()` makes a dense copy for the rare reader that needs one.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

# The rows oneDNN is told to expect when it picks the blocked layout; decode steps run about
# this many (the layout then serves any row count: prefill chunks run as fast as on the dense
# weight or faster, benchmarks/RESULTS.md).
BATCH_HINT = 16
_BLOCK_CANDIDATES = (64, 48, 32, 16, 8, 1)  # 1: the plain row-major layout


def available() -> bool:
    """oneDNN with the linear ops inductor's CPU backend uses."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, n) for n in ("_linear_pointwise", "_reorder_linear_weight", "_nbytes")
    )


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, W, bias)` through oneDNN; `weight` dense [N, K] or oneDNN-packed, x float32
    with any leading dims."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    if x2.shape[0] == 0:
        return x.new_empty(*lead, n)
    out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight, bias, "none", [None], "")
    return out.view(*lead, n)


class PackedWeight:
    """A float32 [N, K] weight stored once in oneDNN's blocked layout (see the module doc)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedWeight: a 2-D float32 CPU tensor, not {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.shape = torch.Size(weight.shape)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.nbytes = int(torch.ops.mkldnn._nbytes(self.packed))
        # [ceil(N / B), K', B] float32 view of `packed`'s memory, or None (lookups refused).
        # It borrows that memory: it lives exactly as long as this object (never handed out).
        self._blocks = _decode_blocks(self.packed, self.nbytes, weight)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def gatherable(self) -> bool:
        return self._blocks is not None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return onednn_linear(x, self.packed, bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] (a new tensor, shape ids.shape + [K]): `F.embedding(ids, W)`."""
        if self._blocks is None:
            raise RuntimeError("this PackedWeight's layout was not decoded: no row lookups")
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise IndexError(f"index out of range in a [{self.shape[0]}, ...] table")
        b = self._blocks.shape[2]
        out = self._blocks[flat // b, : self.shape[1], flat % b]  # [T, K]
        return out.view(*ids.shape, self.shape[1])

    def converted(self, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
        """A dense [N, K] copy in `dtype` and the largest row norm, both read straight from the
        blocked layout in one pass (gatherable only): 0.1 s for Gemma 3's table, where
        gathering its rows takes 0.9."""
        if self._blocks is None:
            raise RuntimeError("this PackedWeight's layout was not decoded: no row lookups")
        n, k = self.shape
        blocks = self._blocks[:, :k, :]  # [nb, K, B]; rows past N are zero
        out = torch.empty(blocks.shape[0], blocks.shape[2], k, dtype=dtype)
        out.copy_(blocks.transpose(1, 2))
        return out.view(-1, k)[:n], float(torch.linalg.vector_norm(blocks, dim=1).max())

    def dense(self) -> torch.Tensor:
        """A dense [N, K] copy (a second copy of the weight: for rare readers only)."""
        return self.packed.to_dense()  # oneDNN's reorder back to the plain layout


def _decode_blocks(
    packed: torch.Tensor, nbytes: int, weight: torch.Tensor
) -> torch.Tensor | None:
    """The [ceil(N / B), K', B] view of `packed`'s memory if its layout is the row-interleaved
    one of the module doc (checked against `weight` on sampled blocks), else None."""
    n, k = weight.shape
    numel = nbytes // 4
    buf = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    flat = torch.frombuffer(buf, dtype=torch.float32, count=numel)
    for b in _BLOCK_CANDIDATES:
        nb = -(-n // b)
        if numel % (nb * b) or numel // (nb * b) < k:
            continue
        blocks = flat.view(nb, numel // (nb * b), b)
        if all(_block_matches(blocks, weight, i, b) for i in _sample_blocks(nb)):
            return blocks
    return None


def _sample_blocks(nb: int) -> list[int]:
    """First, last and a spread of block indices in between (a wrong layout guess fails on the
    first block already; the others guard against surprises away from it)."""
    return sorted({0, nb - 1, *(i * nb // 9 for i in range(1, 9))})


def _block_matches(blocks: torch.Tensor, weight: torch.Tensor, i: int, b: int) -> bool:
    n, k = weight.shape
    rows = weight[i * b : min(n, (i + 1) * b)]
    return torch.equal(blocks[i, :k, : rows.shape[0]], rows.t())


def _refuse_weight(module: nn.Module) -> torch.Tensor:
    raise RuntimeError(
        f"{type(module).__name__}: the weight is packed for oneDNN (swaserve/ops/cpu_linear.py) "
        "and has no dense tensor; call the module, or dense_weight() for a copy "
        "(--disable-fused-ops keeps dense weights)"
    )


class PackedLinear(nn.Module):
    """`nn.Linear` (y = x W^T + b) on a `PackedWeight`; the bias stays a parameter."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packed = weight
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        return _refuse_weight(self)

    def dense_weight(self) -> torch.Tensor:
        return self.packed.dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PackedEmbedding(nn.Module):
    """`nn.Embedding` lookups from a gatherable `PackedWeight` (a tied table: the model's head
    runs `linear` on the same weight)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        if not weight.gatherable:
            raise ValueError("PackedEmbedding needs a gatherable PackedWeight")
        self.packed = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    @property
    def weight(self) -> torch.Tensor:
        return _refuse_weight(self)

    def dense_weight(self) -> torch.Tensor:
        return self.packed.dense()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.packed.rows(ids)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, packed"


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The [N, K] weight of an `nn.Linear` / `nn.Embedding` or of its packed replacement (then
    a dense copy)."""
    if isinstance(module, (PackedLinear, PackedEmbedding)):
        return module.dense_weight()
    return module.weight
