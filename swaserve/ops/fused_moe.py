"""Fused mixture-of-experts: routed tokens grouped by expert, two grouped GEMMs, a sum over top-k.

For token t and its k-th expert e = topk_ids[t, k] (slot s = t * K + k):

    h = x[t] @ w13[e].T (+ b13[e])            [2I]: gate = h[:I], up = h[I:]
    a = act(gate, up)                          silu: silu(gate) * up
                                               swigluoai (gpt-oss): gate = min(gate, limit),
                                               up = clamp(up, -limit, limit),
                                               a = (up + 1) * gate * sigmoid(1.702 * gate)
                                               gelu_pytorch_tanh (Gemma 4): gelu(gate) * up
    y = a @ w2[e].T (+ b2[e])                  [H]
    out[t] = sum_k topk_weights[t, k] * y

GEMMs accumulate in float32. Rounding points, the same in the kernels and the reference: `a` is
rounded to x's dtype (the [N, I] intermediate), so is the weighted `y` (the [N, H] buffer), the sum
over k runs in float32 and is rounded once. In float32 nothing is rounded but the sums' order.

Launches (N = T * K slots, all sizes from shapes only: no host sync, CUDA-graph capturable):

    moe_align        topk_ids -> sorted_ids, expert_ids      1 launch (N <= chunk), else 3
    _gate_up_kernel  x, w13 -> act [N, I]                    grid num_blocks * cdiv(I, BN13)
    _down_kernel     act, w2, topk_weights -> y [N, H]        grid num_blocks * cdiv(H, BN2)
    _sum_kernel      y viewed [T, K, H] -> out [T, H]          skipped when K == 1

Alignment layout (`moe_align`). Slots are grouped by expert, each expert's group padded to a
multiple of BLOCK_M, experts in increasing order, slots ascending within an expert. Example:
T = 5, K = 2 (N = 10 slots), E = 3, BLOCK_M = 4; expert 0 got slots 0 2 5 6 8, expert 1 none,
expert 2 got 1 3 4 7 9; "-" is the padding mark N = 10:

    position    0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 17 18 19
    sorted_ids  0 2 5 6 | 8 - - - | 1 3  4  7 |  9  -  -  - |  -  -  -  -
    expert_ids     0    |    0    |     2     |      2      |     -1
                ^ starts[0]       ^ starts[2]               ^ total = sum_e ceil(count_e / BM) * BM

    - starts[e] = sum_{e' < e} ceil(count_e' / BM) * BM: every group begins on a block boundary
      and fills whole blocks, so a block holds one expert's slots only.
    - padding ("-") holds the sentinel N; a GEMM row with slot >= N is masked (not loaded, not
      stored). Blocks past `total` have expert -1 and exit at once.
    - the length is an upper bound, num_blocks * BM with num_blocks = cdiv(N + min(E, N) *
      (BM - 1), BM): at most min(E, N) experts get a token and each pads by BM - 1 at most. So
      the grids depend on T, K, E and BM only.

The alignment is deterministic (no atomics): a slot's position is starts[e] plus the number of
earlier slots with expert e, counted per chunk of CHUNK slots from a one-hot [CHUNK, E_PAD]
tile. With one chunk (decode) a single program does everything; with more, a count kernel writes
per-chunk histograms, torch.cumsum turns them into per-chunk offsets, and the scatter kernel
(one program per chunk) places its slots and writes its share of the blocks' expert ids and
padding.

Preconditions: every id in [0, E) (an id outside would leave its slot's rows unwritten).

Under TRITON_INTERPRET=1 (CPU tests) bf16/fp16 tiles cannot be multiplied (they are raw uint16
there), so dots run in float32 (`DOT_F32`), exact on the bf16 inputs. On GPU, float32 inputs use
"ieee" dots (tf32 would miss the float32 tolerance). Loop bounds the interpreter must turn into
Python ints are constexpr (the reduction lengths) or `while` loops (the alignment kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from swaserve.ops.rounding import round_to

ACT_IDS = {"silu": 0, "swigluoai": 1, "gelu_pytorch_tanh": 2}
SWIGLU_ALPHA = 1.702
ALIGN_TILE = 8192  # elements of the alignment's one-hot [CHUNK, E_PAD] tile
MAX_CHUNK = 256


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    """Tiles of the two grouped GEMMs. A gate/up program computes `block_n13` gate columns and
    the same `block_n13` up columns (it reads 2 * block_n13 weight rows), so the activation
    needs no second pass; a down program computes `block_n2` output columns."""

    block_m: int  # slots per block (the alignment's padding unit)
    block_n13: int
    block_n2: int
    block_k: int
    group_m: int  # blocks sharing a column tile in launch order (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int


def moe_config(
    num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype = torch.bfloat16
) -> MoEConfig:
    """Tiles by the mean number of slots per expert, T * K / E (decode-sized: BLOCK_M 16).

    NOT MEASURED on this code yet (benchmarks/fused_moe.py times them); chosen after vLLM's
    tuned H100/H200 bf16 tables for E=128 (N=2880 and N=768): BLOCK_M 16 up to ~16 tokens per
    expert, 32 to ~48, 64 (one warpgroup, wgmma) and 128 above. Shared memory per stage is
    (BM * BK + 2 * BK * BN13) * 2 bytes for the gate/up kernel: <= 128 KB over the 3 buffers
    of 4 stages (the sm_90a compile: no spills, <= 126 registers). float32 (tests, not a
    serving dtype) takes 32 x 32 x 32 tiles at most: larger ones spill in the sm_90a compile."""
    rows = num_tokens * top_k / max(1, num_experts)
    if rows <= 4:
        cfg = MoEConfig(16, 32, 64, 128, 1, 4, 4)
    elif rows <= 16:
        cfg = MoEConfig(16, 64, 64, 128, 1, 4, 4)
    elif rows <= 48:
        cfg = MoEConfig(32, 64, 64, 128, 1, 4, 4)
    elif rows <= 160:
        cfg = MoEConfig(64, 64, 128, 64, 8, 4, 4)
    else:
        cfg = MoEConfig(128, 64, 128, 64, 8, 8, 4)
    if dtype.itemsize == 4:  # "ieee" dots on CUDA cores: smaller tiles or they spill
        cfg = MoEConfig(min(32, cfg.block_m), 32, 32, 32, cfg.group_m, 4, 3)
    return cfg


def _block_k(dim: int, block_k: int) -> int:
    """The largest power of two in [32, block_k] dividing `dim` (no K-tail masks: gpt-oss's
    2880 takes 64), else `block_k` with a masked tail."""
    bk = block_k
    while bk > 32 and dim % bk:
        bk //= 2
    return bk if dim % bk == 0 else block_k


def _dot_params(dtype: torch.dtype) -> tuple[bool, str]:
    """(DOT_F32, DOT_PRECISION) for inputs of `dtype` (see the module docstring)."""
    dot_f32 = _interpreting() and dtype != torch.float32
    return dot_f32, "ieee" if (dot_f32 or dtype == torch.float32) else "tf32"


# ---- alignment --------------------------------------------------------------------------------


@triton.jit
def _onehot(IDS, pid, N, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """(slots of chunk `pid`, [CHUNK, E_PAD] one-hot of their experts; rows past N are zero)."""
    slots = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(IDS + slots, mask=slots < N, other=-1).to(tl.int32)
    experts = tl.arange(0, E_PAD)
    return slots, (ids[:, None] == experts[None, :]).to(tl.int32)


@triton.jit
def _align_count_kernel(IDS, COUNTS, N, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """COUNTS[pid, e] = slots of chunk pid routed to expert e (all E_PAD columns written)."""
    pid = tl.program_id(0)
    _, onehot = _onehot(IDS, pid, N, CHUNK, E_PAD)
    tl.store(COUNTS + pid * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit
def _align_scatter_kernel(
    IDS, CUM, SORTED, EXPERT_IDS, N, num_chunks, num_blocks, blocks_per_program,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, NB: tl.constexpr,
    SINGLE: tl.constexpr,
):  # fmt: skip
    """Places chunk pid's slots, then writes expert ids and padding for its share of blocks.

    CUM[c, e] = slots routed to e in chunks 0..c (inclusive prefix over chunks); unused when
    SINGLE (one chunk: the totals are this program's own counts)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    slots, onehot = _onehot(IDS, pid, N, CHUNK, E_PAD)
    mine = tl.sum(onehot, axis=0)
    # total[e]: slots routed to e; before[e]: those of them in earlier chunks
    if SINGLE:
        total = mine
        before = tl.zeros((E_PAD,), tl.int32)
    else:
        total = tl.load(CUM + (num_chunks - 1) * E_PAD + experts)
        before = tl.load(CUM + pid * E_PAD + experts) - mine
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # rank of each slot among this chunk's slots of its expert (exclusive scan down the column)
    rank = tl.cumsum(onehot, axis=0) - onehot
    pos = tl.sum(onehot * (starts[None, :] + before[None, :] + rank), axis=1)
    tl.store(SORTED + pos, slots, mask=slots < N)

    # blocks [b, b_end): expert id (-1 past `total`) and the sentinel N on padding rows
    b = pid * blocks_per_program
    b_end = tl.minimum(b + blocks_per_program, num_blocks)
    rows = tl.arange(0, BLOCK_M)
    while b < b_end:
        blocks = b + tl.arange(0, NB)
        first = blocks * BLOCK_M
        inside = (first[:, None] >= starts[None, :]) & (first[:, None] < ends[None, :])
        owner = tl.sum(tl.where(inside, experts[None, :] + 1, 0), axis=1) - 1  # -1: no expert
        real_end = tl.sum(tl.where(inside, starts[None, :] + total[None, :], 0), axis=1)
        in_range = blocks < b_end
        tl.store(EXPERT_IDS + blocks, owner, mask=in_range)
        at = first[:, None] + rows[None, :]
        pad = tl.zeros((NB, BLOCK_M), tl.int32) + N
        tl.store(SORTED + at, pad, mask=in_range[:, None] & (at >= real_end[:, None]))
        b += NB


def align_num_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Blocks of the aligned layout: an upper bound that depends on shapes only."""
    return triton.cdiv(num_slots + min(num_experts, num_slots) * (block_m - 1), block_m)


def align_chunk(num_experts: int) -> int:
    """Slots per alignment program: the one-hot tile stays at ALIGN_TILE elements."""
    e_pad = max(16, triton.next_power_of_2(num_experts))
    return max(16, min(MAX_CHUNK, ALIGN_TILE // e_pad))


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [num_blocks * block_m] int32, expert_ids [num_blocks] int32): the slots
    `t * K + k` of `topk_ids` [T, K] grouped by expert in blocks of `block_m` (layout in the
    module docstring; padding holds T * K, unused blocks expert -1). `chunk` (a power of two)
    overrides the slots per alignment program."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n = ids.numel()
    e_pad = max(16, triton.next_power_of_2(num_experts))
    chunk = chunk or align_chunk(num_experts)
    num_blocks = align_num_blocks(n, num_experts, block_m)
    dev = ids.device
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    if n == 0:
        return sorted_ids, expert_ids
    num_chunks = triton.cdiv(n, chunk)
    single = num_chunks == 1
    cum = expert_ids  # unused when single
    if not single:
        counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
        _align_count_kernel[(num_chunks,)](ids, counts, n, CHUNK=chunk, E_PAD=e_pad, num_warps=4)
        cum = torch.cumsum(counts, dim=0, dtype=torch.int32)
    nb = max(1, min(64, ALIGN_TILE // e_pad))
    _align_scatter_kernel[(num_chunks,)](
        ids, cum, sorted_ids, expert_ids, n, num_chunks, num_blocks,
        triton.cdiv(num_blocks, num_chunks),
        BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, NB=nb, SINGLE=single, num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids


# ---- grouped GEMMs ----------------------------------------------------------------------------


@triton.jit
def _block_tile(
    num_blocks, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr
):
    """(block, column tile) of this program, GROUP_M blocks per column tile in launch order."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _gate_up_kernel(
    X, W, BIAS, OUT, SORTED, EXPERT_IDS,
    num_slots, num_blocks, INTER, stride_xt, stride_we, stride_wn, stride_wk, stride_be, limit,
    H: tl.constexpr, TOP_K: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """OUT[s, j] = act(gate, up)[j] for the slots s of one block and columns j of one tile, with
    gate = x[s // TOP_K] @ W[e, j], up = x[s // TOP_K] @ W[e, INTER + j] (+ bias)."""
    pid_m, pid_n = _block_tile(num_blocks, INTER, BLOCK_M, BLOCK_N, GROUP_M)
    expert = tl.load(EXPERT_IDS + pid_m)
    if expert < 0:  # past the last expert's blocks
        return
    slots = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = (slots // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = cols % INTER  # in bounds without a mask; wrapped columns are computed, never stored
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None] * stride_xt + ks[None, :]
    w_base = W + expert.to(tl.int64) * stride_we
    g_ptrs = w_base + wcols[None, :] * stride_wn + ks[:, None] * stride_wk
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if H % BLOCK_K == 0:
            a = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(g_ptrs)
            u = tl.load(u_ptrs)
        else:
            k_ok = ks < H - k * BLOCK_K
            a = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_F32:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        b_ptrs = BIAS + expert.to(tl.int64) * stride_be + wcols
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + INTER).to(tl.float32)[None, :]
    if ACT == 0:  # silu
        act = acc_g * tl.sigmoid(acc_g) * acc_u
    elif ACT == 2:  # gelu (tanh approximation): 0.5 (1 + tanh(y)) = sigmoid(2y)
        y2 = 1.5957691216057308 * (acc_g + 0.044715 * acc_g * acc_g * acc_g)  # 2 sqrt(2/pi)
        act = acc_g * tl.sigmoid(y2) * acc_u
    else:  # swigluoai
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = (up + 1.0) * gate * tl.sigmoid(1.702 * gate)  # SWIGLU_ALPHA
    out_ptrs = OUT + slots.to(tl.int64)[:, None] * INTER + cols[None, :]
    out_mask = valid[:, None] & (cols < INTER)[None, :]
    tl.store(out_ptrs, round_to(act, OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _down_kernel(
    A, W, BIAS, TOPK_W, OUT, SORTED, EXPERT_IDS,
    num_slots, num_blocks, H, stride_we, stride_wn, stride_wk, stride_be,
    INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """OUT[s, j] = topk_weights[s] * (A[s] @ W[e, j] (+ bias)) for one block and column tile."""
    pid_m, pid_n = _block_tile(num_blocks, H, BLOCK_M, BLOCK_N, GROUP_M)
    expert = tl.load(EXPERT_IDS + pid_m)
    if expert < 0:
        return
    slots = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = slots.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = cols % H
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * INTER + ks[None, :]
    w_base = W + expert.to(tl.int64) * stride_we
    w_ptrs = w_base + wcols[None, :] * stride_wn + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(INTER, BLOCK_K)):
        if INTER % BLOCK_K == 0:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = ks < INTER - k * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(BIAS + expert.to(tl.int64) * stride_be + wcols).to(tl.float32)[None, :]
    acc *= tl.load(TOPK_W + slots, mask=valid, other=0.0)[:, None]
    out_ptrs = OUT + rows[:, None] * H + cols[None, :]
    out_mask = valid[:, None] & (cols < H)[None, :]
    tl.store(out_ptrs, round_to(acc, OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_kernel(Y, OUT, H, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """OUT[t] = sum_k Y[t * TOP_K + k] in float32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ks = tl.arange(0, K_PAD)
    mask = (ks < TOP_K)[:, None] & (cols < H)[None, :]
    y = tl.load(Y + (t * TOP_K + ks)[:, None] * H + cols[None, :], mask=mask, other=0.0)
    s = tl.sum(y.to(tl.float32), axis=0)
    tl.store(OUT + t * H + cols, round_to(s, OUT.dtype.element_ty), mask=cols < H)


# ---- entry points -----------------------------------------------------------------------------


def _check(x, w13, w2, topk_weights, topk_ids, b13, b2, activation) -> tuple[int, ...]:
    t, h = x.shape
    e, two_i, h1 = w13.shape
    i = two_i // 2
    k = topk_ids.shape[1]
    assert h1 == h and two_i == 2 * i and w2.shape == (e, h, i), (x.shape, w13.shape, w2.shape)
    assert topk_ids.shape == (t, k) and topk_weights.shape == (t, k)
    assert w13.dtype == w2.dtype == x.dtype, (x.dtype, w13.dtype, w2.dtype)
    assert topk_ids.dtype in (torch.int32, torch.int64)
    assert b13 is None or b13.shape == (e, 2 * i)
    assert b2 is None or b2.shape == (e, h)
    if activation not in ACT_IDS:
        raise ValueError(f"unknown MoE activation {activation!r} (known: {sorted(ACT_IDS)})")
    return t, h, e, i, k


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    limit: float = 7.0,
) -> torch.Tensor:
    """The routed experts' weighted sum for x [T, H] (formula in the module docstring): w13
    [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_weights [T, K] float32, topk_ids
    [T, K] int32/int64 in [0, E). Returns [T, H] in x's dtype. On a CPU tensor without
    TRITON_INTERPRET=1 this is `fused_moe_reference`."""
    if x.device.type != "cuda" and not _interpreting():
        return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, b13, b2, activation, limit)
    cfg = moe_config(x.shape[0], w13.shape[0], topk_ids.shape[1], x.dtype)
    args = (x, w13, w2, topk_weights, topk_ids, b13, b2, activation, limit)
    return fused_moe_with_config(*args, cfg)


def fused_moe_with_config(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    activation: str,
    limit: float,
    config: MoEConfig,
    chunk: int | None = None,
) -> torch.Tensor:
    """`fused_moe` with given tiles (tests and tuning sweeps); `chunk` as in `moe_align`."""
    t, h, e, i, k = _check(x, w13, w2, topk_weights, topk_ids, b13, b2, activation)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    b13 = b13.contiguous() if b13 is not None else None  # the kernels read bias rows densely
    b2 = b2.contiguous() if b2 is not None else None
    n = t * k
    cfg = config
    sorted_ids, expert_ids = moe_align(topk_ids, e, cfg.block_m, chunk)
    num_blocks = expert_ids.numel()
    dot_f32, precision = _dot_params(x.dtype)
    act = torch.empty(n, i, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks * triton.cdiv(i, cfg.block_n13),)](
        x, w13, b13 if b13 is not None else w13, act, sorted_ids, expert_ids,
        n, num_blocks, i, x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2),
        b13.stride(0) if b13 is not None else 0, float(limit),
        H=h, TOP_K=k, ACT=ACT_IDS[activation], HAS_BIAS=b13 is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n13, BLOCK_K=_block_k(h, cfg.block_k),
        GROUP_M=cfg.group_m, DOT_F32=dot_f32, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    y = out if k == 1 else torch.empty(n, h, dtype=x.dtype, device=x.device)  # slot s = t * K + k
    _down_kernel[(num_blocks * triton.cdiv(h, cfg.block_n2),)](
        act, w2, b2 if b2 is not None else w2, weights, y, sorted_ids, expert_ids,
        n, num_blocks, h, w2.stride(0), w2.stride(1), w2.stride(2),
        b2.stride(0) if b2 is not None else 0,
        INTER=i, HAS_BIAS=b2 is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=_block_k(i, cfg.block_k),
        GROUP_M=cfg.group_m, DOT_F32=dot_f32, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if k > 1:
        block_h = min(1024, triton.next_power_of_2(h))
        _sum_kernel[(t, triton.cdiv(h, block_h))](
            y, out, h, TOP_K=k, K_PAD=triton.next_power_of_2(k), BLOCK_H=block_h, num_warps=4
        )
    return out


def _activation(h: torch.Tensor, activation: str, limit: float) -> torch.Tensor:
    i = h.shape[-1] // 2
    gate, up = h[..., :i], h[..., i:]
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "gelu_pytorch_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: str = "silu",
    limit: float = 7.0,
) -> torch.Tensor:
    """`fused_moe` in torch, one expert at a time over the experts that received a token, with
    the kernels' rounding points (module docstring). Syncs with the host (fine on CPU)."""
    t, h, _, _, k = _check(x, w13, w2, topk_weights, topk_ids, b13, b2, activation)
    acc = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).float()
    for e in flat.unique().tolist():
        slots = (flat == e).nonzero().squeeze(1)
        tokens = slots // k
        hid = x[tokens].float() @ w13[e].float().T
        if b13 is not None:
            hid += b13[e].float()
        a = _activation(hid, activation, limit).to(x.dtype)
        y = a.float() @ w2[e].float().T
        if b2 is not None:
            y += b2[e].float()
        acc.index_add_(0, tokens, (y * weights[slots, None]).to(x.dtype).float())
    return acc.to(x.dtype)
