"""Exact greedy tokens from a float32 CPU head, screened in bfloat16 (issue 14, item 4).

A greedy CPU decode step of Gemma 3 270M spends ~40% of its time in the tied 262,144 x 640
head: 16 rows of float32 logits read 671 MB and take ~36 ms, of which only the argmax is kept.
On a CPU with AVX512-BF16 the same GEMM on a bfloat16 copy takes ~20 ms through oneDNN, ~16
through native/bf16_screen.c (`cpu_native`; the same arithmetic with the sums in another
order, which the bound allows; used where it is built and the table is 16k x 2j). Its logits
are not the float32 ones, but their error has a rigorous bound, so the screen can name every
token that could be the float32 argmax; those few (median 1, mean ~12 on Gemma) are then
rescored in float32 from the packed float32 table. The token is the float32 argmax, ties to
the lowest id as `row_argmax`: greedy output does not change.

The bound, for one row x and vocabulary row w (K = hidden, u = 2^-8 bfloat16's unit roundoff,
g = K 2^-24 / (1 - K 2^-24) the float32 dot product's, S = sum |x_i w_i| <= |x| |w|):

    the screen (x, w rounded to bf16; products exact, sums in fp32):
        |y~ - y| <= (2u + u^2 + g (1 + u)^2) S
    its output rounded to bf16:                 + 2u / (1 - 2u) |y~|  (nearest: half that)
    any float32 evaluation y^ of the same dot product (the reference):
        |y^ - y| <= g S

With a = c |x| max|w| (c the sum of the S factors, with a margin), every token j whose
float32 logit could be the largest has y~_j + a + b |y~_j| >= max_k (y~_k - a - b |y~_k|)
(b = 2u / (1 - 2u)); the right side is at least m - a - b |m| for m = max y~, and the left is
increasing in y~_j, so the candidates are the y~_j at or above one threshold per row. Where a
logit could overflow (|x| max|w| not small enough, NaN and inf rows included), the float32
head decides instead.

Used for steps whose every request is plain greedy (no logprobs, penalties or min_tokens) and
without drafts to verify (`EngineCore._launch`); the rest computes the float32 logits. It holds
a bfloat16 copy of the head (half the float32 table: 335 MB for Gemma 3). `--disable-fused-ops`
(the eager reference) leaves it out, as does a CPU without AVX512-BF16 (no faster GEMM there)
and a model that soft-caps its logits.
"""

from __future__ import annotations

import math
import os

import torch

from swaserve.ops import cpu_native
from swaserve.ops.cpu_linear import BATCH_HINT, PackedWeight

_U = 2.0**-8  # bfloat16 unit roundoff (8 significant bits, round to nearest even)
_FINITE = 1e37  # |x| max|w| below this: no float32 or bfloat16 logit overflows
# More candidates than this in a step (flat logits: random-token prompts give tens of
# thousands at first) take the float32 head: ~3.1 us each to rescore (each a strided gather
# from the packed table), ~36 ms for the whole head on Gemma 3 at 16 rows, so the break-even is
# near 11,000; the cap stays below it (steps of 3,300-3,800 on cpu_step.py's workload: 55 -> ~30
# ms each with the cap at 2,048 before).
_MAX_RESCORED = 8192
_BLOCK = 256  # columns whose maximum is tested before any of them is (`candidates`)


def _gamma(k: int) -> float:
    """The relative error bound of a float32 sum of k products: k 2^-24 / (1 - k 2^-24)."""
    e = k * 2.0**-24
    return e / (1.0 - e)


def screen_available() -> bool:
    """A CPU whose bfloat16 GEMMs beat float32 (AVX512-BF16 dot products)."""
    is_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(is_bf16 and is_bf16()) and torch.backends.mkldnn.is_available()


class GreedyHead:
    """`row_argmax(hidden @ W.T)` for a packed float32 head W `[V, K]` (a gatherable
    `PackedWeight`), through a bfloat16 screen and a float32 rescoring of its candidates."""

    def __init__(self, weight: PackedWeight) -> None:
        if not weight.gatherable:
            raise ValueError("GreedyHead needs a gatherable PackedWeight (its rows rescored)")
        self.exact = weight
        k = weight.shape[1]
        dense, max_norm = weight.converted(torch.bfloat16)
        v = weight.shape[0]
        lib = cpu_native.library()
        self.screen = self.pairs = None
        if lib is not None and lib.swa_bf16_screen_available() and v % 16 == 0 and k % 2 == 0:
            # native/bf16_screen.c's layout: [V / 16, K / 2, 16] bfloat16 pairs
            self.pairs = dense.view(v // 16, 16, k // 2, 2).transpose(1, 2).contiguous()
        else:
            self.screen = torch.ops.mkldnn._reorder_linear_weight(dense, BATCH_HINT)
        del dense
        g = _gamma(k)
        c = 2 * _U + _U * _U + g * (1 + _U) ** 2 + g
        # a margin of 1% on the factor: the norms are float32 sums (off by ~K 2^-24)
        self._a_scale = c * 1.01 * max_norm
        self._max_norm = max_norm
        # bfloat16 dot products flush denormal products and sums (each off by < 2^-126)
        self._a_floor = (k + 1) * 2.0**-125
        # the output's rounding to bfloat16: u / (1 - u) |y~| to nearest; 2u / (1 - 2u) covers
        # a kernel that truncates instead (not seen on this project's CPUs, cheap to allow)
        self._b = 2 * _U / (1 - 2 * _U) * 1.01

    def logits_screen(self, x: torch.Tensor) -> torch.Tensor:
        """The bfloat16 logits `[T, V]` of float32 rows `x` `[T, K]`."""
        xb = x.to(torch.bfloat16).contiguous()
        if self.pairs is None:
            return torch.ops.mkldnn._linear_pointwise(xb, self.screen, None, "none", [None], "")
        t, (v, k) = xb.shape[0], self.exact.shape
        out = torch.empty(t, v, dtype=torch.bfloat16)
        if cpu_native.library().swa_bf16_screen(
            out.data_ptr(), xb.data_ptr(), self.pairs.data_ptr(), t, v, k
        ):
            raise MemoryError("the bfloat16 screen could not allocate its row buffer")
        return out

    def candidates(
        self, x: torch.Tensor, screen: torch.Tensor, limit: int | None = None
    ) -> torch.Tensor | None:
        """`[N, 2]` (row, token) pairs: every token that may be its row's float32 argmax; None
        when some logit could overflow float32 (then the float32 head decides, NaN and inf
        included), or when there are more than `limit` (the native scan then stops counting:
        no second pass lists pairs the caller would not rescore)."""
        xn = x.double().norm(dim=1)
        if not bool((xn * self._max_norm < _FINITE).all()):  # also False for NaN rows
            return None
        a = (xn * self._a_scale + self._a_floor)[:, None]
        lib = cpu_native.library()
        if lib is not None and screen.is_contiguous():  # its SCAN_BLOCK is _BLOCK
            return _native_candidates(lib, screen, a, self._b, limit)
        blocks, tail = _blocks(screen)
        m = _block_max(blocks)  # [T, nb] float64
        if tail.shape[1]:
            m = torch.cat([m, tail.double().amax(dim=1, keepdim=True)], dim=1)
        # each block's largest logit bounds its row's largest float32 logit from below
        lo = (m - a - self._b * m.abs()).amax(dim=1, keepdim=True)
        # a token may be the argmax iff y + a + b|y| >= lo (the left side increases with y):
        # first the blocks whose largest passes, then their tokens
        keep = (m + a + self._b * m.abs() >= lo).nonzero()  # [N, 2] (row, block)
        d = lo - a  # y >= thr, solved
        thr = torch.where(d >= 0, d / (1 + self._b), d / (1 - self._b))[:, 0]
        thr = _down_to_float32(thr)
        pairs = []
        nb = blocks.shape[1]
        inner = keep[keep[:, 1] < nb]
        hit = (blocks[inner[:, 0], inner[:, 1]] >= thr[inner[:, 0], None]).nonzero()
        pairs.append(torch.stack([inner[hit[:, 0], 0], inner[hit[:, 0], 1] * _BLOCK + hit[:, 1]],
                                 dim=1))
        rows = keep[keep[:, 1] == nb, 0]  # rows whose short last block passed
        if rows.numel():
            hit = (tail[rows] >= thr[rows, None]).nonzero()
            pairs.append(torch.stack([rows[hit[:, 0]], nb * _BLOCK + hit[:, 1]], dim=1))
        out = torch.cat(pairs)
        return None if limit is not None and out.shape[0] > limit else out

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 greedy token of each row of `x` `[T, K]` (int64 `[T]`)."""
        x = x.float()
        if x.shape[0] == 0:
            return torch.zeros(0, dtype=torch.int64)
        pairs = self.candidates(x, self.logits_screen(x), _MAX_RESCORED)
        if pairs is None:
            return self.exact.linear(x).max(dim=1).indices
        row, tok = pairs[:, 0], pairs[:, 1]
        exact = (x[row] * self.exact.rows(tok)).sum(dim=1)
        t = x.shape[0]
        best = torch.full((t,), float("-inf")).scatter_reduce(0, row, exact, "amax")
        first = torch.full((t,), torch.iinfo(torch.int64).max, dtype=torch.int64)
        return first.scatter_reduce(0, row[exact == best[row]], tok[exact == best[row]], "amin")


def _native_candidates(
    lib, screen: torch.Tensor, a: torch.Tensor, b: float, limit: int | None
) -> torch.Tensor | None:
    """`GreedyHead.candidates` past its overflow check, in one pass of native/bf16_screen.c
    (~0.6 ms against ~1.4 for the torch ops on [16, 262144]): the same blocks, floor,
    threshold and float32 rounding, in float64 likewise; pairs in row then token order."""
    t, v = screen.shape
    a = a.reshape(t).contiguous()
    cap = _MAX_RESCORED if limit is None else limit
    while True:
        pairs = torch.empty(max(cap, 1), 2, dtype=torch.int64)
        n = lib.swa_screen_candidates(
            screen.data_ptr(), t, v, a.data_ptr(), b, pairs.data_ptr(), cap
        )
        if n < 0:
            raise MemoryError("the candidate scan could not allocate its buffers")
        if n <= cap:
            return pairs[:n]
        if limit is not None:
            return None
        cap = n  # no limit: a second scan lists them all


def _blocks(screen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`screen` `[T, V]` as `[T, V // _BLOCK, _BLOCK]` (a view) and its last `V % _BLOCK`
    columns `[T, V % _BLOCK]`."""
    t, v = screen.shape
    n = v // _BLOCK * _BLOCK
    return screen[:, :n].view(t, n // _BLOCK, _BLOCK), screen[:, n:]


def _block_max(blocks: torch.Tensor) -> torch.Tensor:
    """The largest value of each bfloat16 block (float64 `[T, nb]`), from integer maxima of its
    bits: ~0.13 ms on [16, 262144] where a bfloat16 reduction takes 0.8. A bfloat16's bits as
    int16 are ordered as its value among non-negative values and reversed among negative ones:
    a block's largest value is its largest bits when those are >= 0 (some value is), else its
    smallest bits (every value negative: the one nearest zero)."""
    bits = blocks.view(torch.int16)
    hi, lo = bits.amax(dim=2), bits.amin(dim=2)
    return torch.where(hi >= 0, hi, lo).view(torch.bfloat16).double()


def _down_to_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 `x` rounded down to float32: comparing a float32 (or bfloat16) y against it
    keeps every y >= x."""
    f = x.float()
    return torch.where(f.double() > x, torch.nextafter(f, torch.full_like(f, -torch.inf)), f)


def greedy_head_for(model: torch.nn.Module) -> GreedyHead | None:
    """The screened head of a model whose float32 head `cpu_pack` packed (gatherable), or None:
    no AVX512-BF16, a dense or non-gatherable head, logits soft-capped after the head (Gemma's
    `final_softcap`: the screen bounds raw logits) or scaled by other than a positive power of
    two (Cohere's `logit_scale` factor, Granite's `logits_scaling` divisor), or
    SWASERVE_GREEDY_SCREEN=0 (A/B runs)."""
    from swaserve.models.blocks import head_module

    if os.environ.get("SWASERVE_GREEDY_SCREEN") == "0" or not screen_available():
        return None
    if getattr(model, "final_softcap", None):
        return None
    # Cohere's `logit_scale` multiplies the logits, Granite's `logits_scaling` divides them: only
    # a positive power of two keeps the raw argmax exactly (another factor can round two logits
    # to a tie, a negative one reverses; a power of two only shifts the exponent)
    for factor in (getattr(model, "logit_scale", 1.0), getattr(model, "logits_scaling", 1.0)):
        if float(factor) <= 0 or math.frexp(float(factor))[0] != 0.5:
            return None
    packed = getattr(head_module(model), "packed", None)
    if not isinstance(packed, PackedWeight) or not packed.gatherable:
        return None
    return GreedyHead(packed)
