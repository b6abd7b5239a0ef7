"""Skinny GEMM for decode: y = [rmsnorm](x) @ W^T [+ bias] [+ residual] for a few rows of x.

At batch 1 a decode step is the weights read once; cuBLAS reads them at ~94% of the copy ceiling
on the H200 but splits K for these shapes (a second, reduce kernel per GEMM), and the RMSNorm in
front of the q/k/v and gate/up GEMMs, the gated activation in front of the down GEMM and the
residual add behind the o and down GEMMs are launches of their own (at batch 1 about 3 us each
with its gap, against ~120 us of GEMMs per Llama-8B layer). Here one program owns BLOCK_N output
columns for every row of x and walks the whole of K (no split, no reduce), so the norm or the
activation can ride in front and the residual add behind:

    x      = act(gate) * up                                   (the down GEMV: from gate|up)
    ss[m]  = sum_k x[m, k]^2                                  (accumulated in the same K walk)
    acc    = sum_k W[n, k] * (x[m, k] * g[k])                 g = norm weight (1 + w for Gemma)
    y[m,n] = acc * rsqrt(ss[m] / K + eps)  [+ bias[n]] [+ residual[m, n]]

The norm's scale is a per-row scalar, so it moves behind the dot product: nothing waits for a
pass over x before the weights stream. Numerics: float32 accumulation, one rounding of y to the
output dtype (HF rounds the normalised x, the GEMM output and the residual sum each on their
own; the differences are of one bf16 step, like split-K's reduction order).

The products accumulate elementwise in registers ([rows, BLOCK_N, BLOCK_K] float32) and are
summed over K once, after the loop; K is a constexpr so the loop is a `tl.range` the compiler
pipelines. A `use_dot` config instead runs tensor-core dots on x padded to 16 rows and rounded
to the weights' dtype (the GEMM's input, as on the cuBLAS path), for 3 to 16 rows.
`benchmarks/gemv_bench.py` times the tiles against cuBLAS per shape.

The q/k/v GEMV can also finish the attention prologue (`RopeStore`, models without q/k norms
and with full-width neox rotary: Llama, Mistral): its programs then own half-tiles of rotary
partners (columns c .. c + P - 1 and c + D/2 .. c + D/2 + P - 1 of one head, P = BLOCK_N / 2;
the weight rows are gathered, so any column set reads as fast), rotate q and k in the
epilogue and write k and v to the token's cache slot: one launch a layer instead of two
(`qk_rope_store`). Numerics are those of `qk_rope_store` on this GEMV's rounded output. H200,
batch-1 Llama-8B decode: 4.300 -> 4.246 ms/token (benchmarks/RESULTS.md, stop 23)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from swaserve.attention.kernels.paged_attention import _round_to_e4m3
from swaserve.ops.activation import ACT_IDS, gated
from swaserve.ops.pdl import pdl_enabled, pdl_launch, pdl_wait
from swaserve.ops.rmsnorm import NormParams
from swaserve.ops.rounding import round_to, rounded

MAX_ROWS = 2  # rows the engine's path takes; at 4 cuBLAS won by 10-45% on Llama-8B's shapes
# Rows an explicit config takes (`row_config`), only when SWASERVE_GEMV_ROWS asks for more than
# MAX_ROWS. With one tensor-core tile for every projection the engine lost (H100, 2026-12-05,
# benchmarks/RESULTS.md: smollm2's verify graph 1.97-2.52 ms against cuBLAS's 1.14-1.41): that
# tile took 35.7 us on down (ROW_TILES).
MAX_DOT_ROWS = 16
# Models this small (hidden size) take steps of up to SMALL_MODEL_ROWS tokens through the GEMV
# by default (`swaserve.ops.gemv_rows`), with ROW_TILES past MAX_ROWS: on smollm2-135m (576) the
# verify graph of a speculative step went 1.23-1.29 -> 1.05-1.08 ms (8 rows) and 1.14-1.17 ->
# 0.97-1.00 (5 rows); on Llama-8B's shapes (4096) cuBLAS wins past two rows (H200, 2026-12-05).
# Nothing between was timed: 1024 (Qwen3-0.6B's width) is a guess on the side of the win.
SMALL_HIDDEN = 1024
SMALL_MODEL_ROWS = 8


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program
    block_k: int  # K per loop step, as rows x block_k x block_n products held in registers
    num_warps: int
    num_stages: int
    use_dot: bool = False  # tensor-core dots on x padded to 16 rows (up to MAX_DOT_ROWS)


def default_config(m: int, n: int, k: int, norm: bool = False, act: bool = False) -> GemvConfig:
    """The tile for an [m, k] x [n, k]^T product (m <= MAX_ROWS), from `gemv_bench.py`'s sweeps
    on the H200 (benchmarks/RESULTS.md, stop 18; Llama-3.1-8B's shapes: the best tile of each
    variant at one and two rows, but q/k/v at one row, whose best had 2 stages). Every program
    reads all of x (and the norm weight) from L2 once, so wide N takes more columns per program
    when those reads double (a norm in front) and the vocabulary head, where the weights
    dominate, fewer and longer K steps. Two rows with the activation in front hold gate and up
    for both: 8 warps (51.6 -> 33.5 us on down)."""
    warps = 4
    if m == 1 and n >= 65536:
        block_n, block_k = 4, 2048
    elif norm and n >= 16384:
        block_n, block_k = (16 if m == 1 else 8), 1024
    elif m == 1 or norm:
        block_n, block_k = 8, 512
    else:
        block_n, block_k = 16, 512
        warps = 8 if act else 4
    block_k = min(block_k, triton.next_power_of_2(k))
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=3)


# The engine's tiles past MAX_ROWS (`row_config`), when SWASERVE_GEMV_ROWS asks for more rows: a
# verify step of speculative decoding ([last, d_1..d_K] per request) or a small decode batch.
# From gemv_bench.py's sweep on smollm2-135m's shapes at 5 and 8 rows (H200, 2026-12-05,
# benchmarks/RESULTS.md): tensor-core tiles for q/k/v, o and gate/up (4.2, 3.2, 4.6 us against
# cuBLAS's 5.3, 5.1, 6.2 with their norm and add launches), the elementwise tile for down with
# its activation in front (7.5 against 8.1; the tensor-core tile took 35.7 there: one tile for
# every projection was why the engine lost with it).
DOT_TILE = GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=4, use_dot=True)
ROW_TILES = {
    "qkv": GemvConfig(block_n=16, block_k=128, num_warps=8, num_stages=4, use_dot=True),
    "o": DOT_TILE,
    "gate_up": GemvConfig(block_n=32, block_k=64, num_warps=4, num_stages=4, use_dot=True),
    "down": GemvConfig(block_n=4, block_k=256, num_warps=4, num_stages=3),
}


@dataclass(frozen=True)
class RopeStore:
    """The attention prologue the q/k/v GEMV finishes (module docstring): rotary at
    `positions` [m] (`inv_freq` [D / 2] float32, `rot_scale` YaRN's attention scaling), then
    k and v to flat `slots` [m] (int64; negative: padding, stored nowhere) of the layer's
    caches [pages, page_size, Hkv, D] (fp8 with the layer's scales). The output's columns are
    q [Hq D] | k [Hkv D] | v [Hkv D]."""

    positions: torch.Tensor
    inv_freq: torch.Tensor
    rot_scale: float
    slots: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: float
    v_scale: float
    q_dim: int  # Hq * D
    kv_dim: int  # Hkv * D
    head_dim: int


def rope_store_fits(head_dim: int, half: int, block_n: int) -> bool:
    """Whether a GEMV tile of `block_n` columns can own whole rotary half-tiles of a head."""
    p = block_n // 2
    return 2 * half == head_dim and p > 0 and half % p == 0


def row_config(rows: int, projection: str) -> GemvConfig | None:
    """The config the engine passes for a step of `rows` tokens through `projection` (a
    ROW_TILES key): None (`default_config`) up to MAX_ROWS; past it (at most MAX_DOT_ROWS) the
    tile SWASERVE_GEMV_ROW_TILE names ("n/k/warps/stages", "/dot" for the tensor-core variant)
    for every projection, else the projection's ROW_TILES entry. The engine takes rows past
    MAX_ROWS only when SWASERVE_GEMV_ROWS asks (an experiment)."""
    if rows <= MAX_ROWS:
        return None
    spec = os.environ.get("SWASERVE_GEMV_ROW_TILE")
    if not spec:
        return ROW_TILES[projection]
    parts = spec.split("/")
    n, k, warps, stages = (int(v) for v in parts[:4])
    return GemvConfig(n, k, warps, stages, use_dot=parts[4:] == ["dot"])


@triton.jit
def _gemv_kernel(
    X, W, B, R, G, Y, WS,
    M, N, stride_xm, stride_wn, stride_rm, stride_ym, eps, g_offset,
    POS, INV_FREQ, SLOTS, K_CACHE, V_CACHE, rot_scale, k_scale, v_scale,  # ROPE only
    stride_cp, stride_co, stride_ch, stride_dp, stride_do, stride_dh,
    K: tl.constexpr,  # a constexpr: the loop is a pipelined `tl.range` (one variant per K)
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_WSCALE: tl.constexpr,  # e4m3 weights with a scale per output row (WS, fp8_linear.py)
    ACT: tl.constexpr,  # -1, or x = act(X[:, :K]) * X[:, K:] (activation.ACT_IDS)
    USE_DOT: tl.constexpr,  # tensor-core dots on x padded to BLOCK_M >= 16 rows (see module)
    INTERPRET: tl.constexpr,  # TRITON_INTERPRET=1: dots in float32 (bf16 tiles are raw there)
    NUM_STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (ops/pdl.py)
    ROPE: tl.constexpr = False,  # the q/k/v GEMV finishing the prologue (`RopeStore`)
    Q_DIM: tl.constexpr = 0, KV_DIM: tl.constexpr = 0, HEAD_D: tl.constexpr = 0,
    PAGE_SIZE: tl.constexpr = 0, FP8: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    pdl_wait(USE_PDL)  # x, the residual and Y belong to the kernels around this one
    HALF_N: tl.constexpr = BLOCK_N // 2
    j = tl.arange(0, BLOCK_N)
    if ROPE:  # half-tiles of rotary partners: c + j for j < P, c + D/2 + (j - P) after
        PER_HEAD: tl.constexpr = HEAD_D // BLOCK_N  # programs per head
        rn = (pid // PER_HEAD) * HEAD_D + (pid % PER_HEAD) * HALF_N + j % HALF_N \
            + (j // HALF_N) * (HEAD_D // 2)
    else:
        rn = pid * BLOCK_N + j
    rn_load = tl.minimum(rn, N - 1)  # rows past N load row N - 1 (unmasked) and are not stored
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    w_ptrs = W + rn_load.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
    # products accumulate elementwise; the one reduction over K comes after the loop
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    ss = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if K % BLOCK_K == 0:
            x_ok = m_ok[:, None]
            w = tl.load(w_ptrs)
        else:
            k_ok = (k0 + rk) < K
            x_ok = m_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=x_ok, other=0.0).to(tl.float32)
        if ACT >= 0:  # x holds the gate; the up half sits K further along the row
            up = tl.load(x_ptrs + K, mask=x_ok, other=0.0).to(tl.float32)
            x = rounded(gated(x, up, ACT, X.dtype.element_ty), X.dtype.element_ty)
        if HAS_NORM:
            ss += x * x
            if K % BLOCK_K == 0:
                g = tl.load(G + k0 + rk).to(tl.float32)
            else:
                g = tl.load(G + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)
            x = x * (g + g_offset)[None, :]
        if USE_DOT:
            if INTERPRET or W.dtype.element_ty == tl.float32:
                acc += tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
            elif W.dtype.element_ty == tl.float8e4nv:  # e4m3 codes are exact in bf16
                acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            else:  # x (normalised or gated) rounded to the weights' dtype, as the GEMM's input
                acc += tl.dot(x.to(W.dtype.element_ty), tl.trans(w))
        else:
            acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:
        y = acc
    else:
        y = tl.sum(acc, 2)
    if HAS_WSCALE:  # W = codes * WS[n]: the row's scale, like the norm's, rides behind the sum
        y = y * tl.load(WS + rn_load)[None, :]
    if HAS_NORM:
        y = y * tl.rsqrt(tl.sum(ss, 1) / K + eps)[:, None]
    if HAS_BIAS:
        y += tl.load(B + rn_load).to(tl.float32)[None, :]
    mask = m_ok[:, None] & (rn < N)[None, :]
    if ROPE:
        y = _rope_store_epilogue(
            y, rn, j, pid, rm, m_ok, mask, POS, INV_FREQ, SLOTS, K_CACHE, V_CACHE, rot_scale,
            k_scale, v_scale, stride_cp, stride_co, stride_ch, stride_dp, stride_do, stride_dh,
            Y.dtype.element_ty, Q_DIM, KV_DIM, HEAD_D, PAGE_SIZE, FP8, BLOCK_M, BLOCK_N,
        )
    if HAS_RES:
        res = tl.load(R + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0)
        y += res.to(tl.float32)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], round_to(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store_epilogue(
    y, rn, j, pid, rm, m_ok, mask, POS, INV_FREQ, SLOTS, K_CACHE, V_CACHE, rot_scale, k_scale,
    v_scale, stride_cp, stride_co, stride_ch, stride_dp, stride_do, stride_dh,
    dtype: tl.constexpr, Q_DIM: tl.constexpr, KV_DIM: tl.constexpr, HEAD_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """y [rows, columns] of this program's half-tiles, rounded as stored, then rotated where it
    is q or k (`qk_rope_store`'s arithmetic: cos, sin and each product rounded to the dtype);
    k and v columns also go to their row's cache slot. Returns what the GEMV stores."""
    HALF_N: tl.constexpr = BLOCK_N // 2
    PER_HEAD: tl.constexpr = HEAD_D // BLOCK_N
    y = rounded(y, dtype)
    # the partner of column j is column j +- P: flip the [2, P] halves (bit-exact)
    yp = tl.reshape(tl.flip(tl.reshape(y, [BLOCK_M, 2, HALF_N]), 1), [BLOCK_M, BLOCK_N])
    inv_freq = tl.load(INV_FREQ + (pid % PER_HEAD) * HALF_N + j % HALF_N).to(tl.float32)
    pos = tl.load(POS + rm, mask=m_ok, other=0).to(tl.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    cos = rounded(tl.cos(freqs) * rot_scale, dtype)
    sin = rounded(tl.sin(freqs) * rot_scale, dtype)
    sign = tl.where(j < HALF_N, -1.0, 1.0)[None, :]  # rotate_half: (-x2, x1)
    turned = rounded(rounded(y * cos, dtype) + sign * rounded(yp * sin, dtype), dtype)
    is_v = rn >= Q_DIM + KV_DIM  # one program's columns lie in one of q, k, v (whole heads)
    y = tl.where(is_v[None, :], y, turned)
    if pid * BLOCK_N >= Q_DIM:  # k or v: the token's cache slot too
        slot = tl.load(SLOTS + rm, mask=m_ok, other=-1).to(tl.int64)
        col = tl.where(is_v, rn - Q_DIM - KV_DIM, rn - Q_DIM)
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        head = col // HEAD_D
        d = col % HEAD_D
        kc = K_CACHE + page[:, None] * stride_cp + off[:, None] * stride_co \
            + (head * stride_ch + d)[None, :]
        vc = V_CACHE + page[:, None] * stride_dp + off[:, None] * stride_do \
            + (head * stride_dh + d)[None, :]
        c = y
        if FP8:
            scale = tl.where(is_v, v_scale, k_scale)[None, :]
            c = _round_to_e4m3(tl.minimum(tl.maximum(y / scale, -448.0), 448.0))
        ok = mask & (slot >= 0)[:, None]
        tl.store(tl.where(is_v[None, :], vc, kc), c.to(K_CACHE.dtype.element_ty), mask=ok)
    return y


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: NormParams | None = None,
    residual: torch.Tensor | None = None,
    act: str | None = None,
    config: GemvConfig | None = None,
    rope_store: RopeStore | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[norm](x) @ weight^T [+ bias] [+ residual] for x of [m, k] (m <= MAX_ROWS, unit
    stride along k) and a contiguous weight of [n, k]; returns a new contiguous [m, n] tensor
    in x's dtype. `norm` is an RMSNorm over k (blocks.RMSNorm), `residual` an [m, n] tensor.
    With `act` (a `blocks.ACTIVATIONS` name) x is a merged gate|up output of [m, 2k] and the
    product's input is act(gate) * up, rounded as `act_and_mul` rounds it. With `rope_store`
    (the q/k/v GEMV, `rope_store_fits` for its tile) q and k come out rotated and k and v are
    also written to the cache. With `weight_scale` (float32, one per output row: an
    `Fp8Linear`'s) the weight holds float8 e4m3 codes and W = codes * weight_scale[n]: the
    product reads half the bytes, its input x stays in its own dtype (weights-only fp8)."""
    m, k = x.shape
    if act is not None:
        k //= 2
    n = weight.shape[0]
    bad_act = act is not None and (norm is not None or x.shape[1] != 2 * k)
    if (
        m > (MAX_DOT_ROWS if config is not None else MAX_ROWS)
        or weight.shape[1] != k
        or x.stride(1) != 1
        or not weight.is_contiguous()
        or bad_act
        or (weight.dtype == torch.float8_e4m3fn) != (weight_scale is not None)
    ):
        raise ValueError(
            f"gemv takes x [<= {MAX_ROWS}, K] ({MAX_DOT_ROWS} rows with an explicit config; "
            f"2 K with `act`, which takes no norm) with unit "
            f"stride and a contiguous [N, K] weight; got x {tuple(x.shape)} strides "
            f"{x.stride()}, weight {tuple(weight.shape)} {weight.dtype} (e4m3 weights, and "
            f"only they, take a weight_scale: {weight_scale is not None}), act {act}, "
            f"norm {norm is not None}"
        )
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(m, n, k, norm is not None, act is not None)
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(1) == 1
    g = norm.weight if norm is not None else x
    use_pdl = pdl_enabled(x.device)
    rs = rope_store
    if rs is not None:
        d = rs.head_dim
        assert n == rs.q_dim + 2 * rs.kv_dim and rs.q_dim % d == 0 and rs.kv_dim % d == 0
        assert rope_store_fits(d, rs.inv_freq.shape[0], cfg.block_n), (d, cfg)
        assert rs.k_cache.dtype == rs.v_cache.dtype and rs.k_cache.stride(3) == 1
        caches = (rs.positions, rs.inv_freq, rs.slots, rs.k_cache, rs.v_cache,
                  float(rs.rot_scale), float(rs.k_scale), float(rs.v_scale),
                  *rs.k_cache.stride()[:3], *rs.v_cache.stride()[:3])  # fmt: skip
        rope = dict(ROPE=True, Q_DIM=rs.q_dim, KV_DIM=rs.kv_dim, HEAD_D=d,
                    PAGE_SIZE=rs.k_cache.shape[1], FP8=rs.k_cache.dtype == torch.float8_e4m3fn)
    else:
        caches = (x, x, x, x, x, 1.0, 1.0, 1.0, 0, 0, 0, 0, 0, 0)  # dummies, never read
        rope = {}
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else x, residual if residual is not None else x,
        g, y, weight_scale if weight_scale is not None else x, m, n, x.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0, y.stride(0),
        norm.eps if norm is not None else 0.0,
        1.0 if norm is not None and norm.unit_offset else 0.0,
        *caches,
        K=k, HAS_BIAS=bias is not None, HAS_RES=residual is not None, HAS_NORM=norm is not None,
        HAS_WSCALE=weight_scale is not None,
        ACT=-1 if act is None else ACT_IDS[act], USE_DOT=cfg.use_dot,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", NUM_STAGES=cfg.num_stages,
        BLOCK_M=max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        USE_PDL=use_pdl, **rope, **pdl_launch(use_pdl),
    )  # fmt: skip
    return y
