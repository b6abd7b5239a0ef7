"""Triton kernels over the paged KV pool: ragged paged attention and the K/V store.

One attention kernel covers prefill chunks over a cached prefix, decode and both mixed in one
launch (docs/architecture.md §7). Request i owns the query rows
`[query_start_loc[i], query_start_loc[i+1])` at positions `[ctx_i, seq_lens[i])` with
`ctx_i = seq_lens[i] - q_len_i`, and attends causally, within the layer's window, to keys
`[0, seq_lens[i])` read through its block table.

Work decomposition (one program = one query block x one KV head [x one key split]):

    rows of a program tile (BLOCK_M = BLOCK_Q * G_PAD):
        row r -> query  q_block * BLOCK_Q + r // G_PAD  of its request
                 head   kv_head * G + r % G_PAD        (rows with r % G_PAD >= G are padding)
    so the G query heads of one KV head share every K/V tile load (GQA).

    query blocks of request i:  [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1)
        an upper bound on ceil(q_len / BLOCK_Q) blocks; surplus programs return at once and a
        program finds its request by binary search over qsl (no host-side block list, so the
        grid depends only on T and B).

    keys of a query block with positions [first, last]:
        lo = max(0, first - window + 1) (0 without window)       hi = last
        tiles t in [lo // BLOCK_N, hi // BLOCK_N], key k = t * BLOCK_N + j, loaded iff
        lo <= k <= hi: block-table entries and pages outside the window or past the request's
        last key are never read (retired table slots hold the NULL page 0 and stay untouched).
        Tiles that every row sees whole (keys in [last - window + 1, first]) run without any
        mask; only the window-edge and causal-diagonal tiles compute masks.

Scores live in the log2 domain (`exp2`); the running max starts at -1e30 (finite), so a row
whose first tiles are fully masked keeps alpha = 1, p = 0 and never produces NaN. Sinks (an
extra logit per head with no value) seed the softmax: m = sink, l = 1.

Split-KV (flash-decoding): with SPLIT_KV each program takes a contiguous share of its block's
key tiles and writes an unnormalised partial (acc, m, l) per row; `_reduce_splits` merges them
(and adds the sink term once). Opt-in (`merge_counters`, SWASERVE_ATTN_MERGE=1): the last
program of a block to finish merges them in the same launch (`MERGE_LAST`: an arrival counter
per (query block, KV head)), which saves a launch at short contexts and loses at long ones.
The split count, chosen by `choose_num_splits`, is the grid's
third dimension and a runtime value in both kernels, so every count shares one compiled variant.
Splits past a block's last key tile return at once, and split 0 writes how many hold keys, so
the merge reads only those (a CUDA graph's count is sized for its longest context).

FP8 KV (float8_e4m3fn): the pool stores round(x / scale); loads convert to the dot dtype and
the per-layer scales are folded into the score scale (k_scale) and the output (v_scale). With
bf16 queries the dots run in float16 (`DOT_F16`, `AttentionConfig.fp8_fp16_dot`; every tile but
prefill at head_dim > 128): q is converted once per program, K/V tiles e4m3 -> f16 (exact:
|x| <= 448, 3 mantissa bits), p is rounded to fp16 for the PV dot (finer than bf16 on [0, 1]);
scores and the accumulator stay fp32. A bf16 query is exact in fp16 for 2^-17 <= |q| <= 65504
(smaller values lose low bits as subnormals, larger ones saturate). On sm_90 e4m3 -> f16 is one
packed conversion per two values and e4m3 -> bf16 three (by the instruction counts, what held
the bf16-dot path at half the memory bandwidth). V tiles are converted in registers before
their shared-memory staging (`_e4m3_to_f16`).

Fresh new tokens (`k_new`/`v_new`, FP8 caches): a request with more than one new token reads
keys [ctx, seq_len) from the step's own K/V instead of the cache (`FRESH_NEW`): the tiles wholly
past ctx are FRESH (dots in the model dtype on q as loaded, score scale without k_scale, p
times 1 / v_scale so the accumulator stays in cache units), the one tile straddling ctx is
MIXED (new keys converted to cache units), the tiles before it read the cache as above.

Under TRITON_INTERPRET=1 (CPU tests) the interpreter cannot multiply bf16/fp16 tiles (they are
raw uint16 there), so dots run in float32 (`DOT_F32`; q still goes through the fp16 rounding of
`DOT_F16`); on GPU they run in the input dtype (fp16 for an fp8 cache, see above).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from swaserve.ops.pdl import pdl_enabled, pdl_launch, pdl_wait

LOG2E = 1.4426950408889634
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # the same, inside kernels
FP8 = torch.float8_e4m3fn
MAX_SPLITS = 64
MAX_SPLIT_BYTES = 64 << 20  # split-KV partials of one launch, at most
ANY_Q_LEN = 2**31 - 1  # a launch's upper bound on q_len when it takes every request
REDUCE_BLOCK_S = 16  # partials the split merge reads per iteration
MIN_KEYS_PER_SPLIT = 256  # a split below this spends more on the merge than it saves
BALANCE_SPLIT_KEYS = 1024  # a split made only to even out the SMs' loads keeps at least this
CPU_NUM_SMS = 132  # H200: on CPU (interpreter) the heuristics behave as on the target GPU


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_compile_only = False  # set by `compile_only()`: launches compile and return


@contextlib.contextmanager
def compile_only() -> Iterator[None]:
    """Within it, this module's kernel launches compile their variant (Triton's `warmup`: no
    launch, nothing written) and return; under Triton's AsyncCompileMode the compiles run on
    its executor (swaserve/attention/warmup.py). Not for the interpreter."""
    global _compile_only
    _compile_only = True
    try:
        yield
    finally:
        _compile_only = False


def _run(kernel: triton.JITFunction, grid: tuple, *args: object, **kwargs: object) -> None:
    if _compile_only:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


# ---- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionConfig:
    """Launch configuration of `_paged_attn_kernel`; `attention_config` picks it, benchmarks and
    tuning sweeps pass their own to `paged_attention(config=...)`.

    num_stages: every K/V tile address goes through a block-table load, one more level of
    indirection for Triton's pipeliner, which splits the depth between the two: in the sm_90
    compile (Triton 3.6) num_stages 2, 3 and 4 all give K and V one shared-memory buffer (tile
    t + 1 is fetched while tile t is computed only once t's operands are read), 5 gives two
    buffers and 7 three, at more registers."""

    block_m: int  # rows per program: block_q queries x g_pad heads
    block_q: int
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    # fp8 (e4m3) cache only. Dots in float16 when the queries are bf16 (else in bf16: e4m3 ->
    # bf16 takes three conversions per two values on sm_90, e4m3 -> f16 one).
    fp8_fp16_dot: bool = True
    # With fp16 dots on the GPU: convert V tiles in registers before their shared-memory staging
    # (`_e4m3_to_f16`), else after it (Triton's choice for `.to`: byte-wise shared loads).
    fp8_v_cvt_regs: bool = True


# FP8 decode tiles (block_n, num_warps, num_stages), for block_m <= 32. NOT MEASURED yet
# (benchmarks/fp8_attention_sweep.py measures the alternatives); chosen from the sm_90 compile
# of the kernel (Triton 3.6 + ptxas, no GPU) at H32/Hkv8, D128, decode, fp16 dots, V converted
# in registers: 64/4/2 needs 114 registers (4 CTAs per SM as the bf16 decode tile, so B=64 x 8
# KV heads x 2 splits = 1024 programs fill 1.94 waves) and its main loop issues ~25 warp
# instructions per key (bf16: 23 per key for twice the bytes; the old fp8 path with bf16 dots:
# 46, a third of them slow conversions; fp16 dots with V staged as fp8: 35). 128/4/2 issues
# fewer (19.5 per key) and keeps twice the bytes per tile in flight, but at 166 registers only
# 3 CTAs fit (2.6 waves at B=64); 5 stages double-buffer K/V at 148 registers (3 CTAs).
FP8_DECODE_TILE = (64, 4, 2)


def attention_config(
    head_dim: int, group: int, max_query_len: int, kv_dtype: torch.dtype | None = None
) -> AttentionConfig:
    """Tile sizes for the GPU, used unchanged on CPU.

    BLOCK_M grows with the longest query run of the batch (16 rows for decode, up to 128 for
    prefill); BLOCK_N is 64 keys (4 pages of 16). Measured on H200, bf16, H32/Hkv8, D128: causal
    prefill of 8k tokens at ~350 TFLOP/s (SDPA flash: ~550), decode B=64 x 4k keys reading K/V at
    ~3.9 TB/s; 8 warps and 2 stages beat 4 warps or 3 stages; at D=256 (H8/Hkv4) 128x64 gave
    245 TFLOP/s against 194 for 128x32. (`head_dim` is kept for per-D tuning.) An fp8 cache
    (`kv_dtype`) takes `FP8_DECODE_TILE` for decode-sized blocks (block_m <= 32)."""
    g_pad = triton.next_power_of_2(group)
    block_m = min(128, max(16, triton.next_power_of_2(max(1, max_query_len) * g_pad)))
    block_m = max(block_m, g_pad)
    block_n, num_warps, num_stages = 64, 4 if block_m <= 32 else 8, 2
    if kv_dtype == FP8 and block_m <= 32:
        block_n, num_warps, num_stages = FP8_DECODE_TILE
    # Prefill tiles (wgmma) take the fp16-converted q as a register operand: at D=256 that
    # spills inside the key loop (sm_90 compile), so those keep bf16 dots.
    fp16_dot = block_m <= 32 or head_dim <= 128
    if head_dim > 256:  # Gemma 4's 512-dim full layers: tiles that fit 227 KiB of shared memory
        # (sm_90a compile: 128 x 64 at D=512 wanted 448 KiB; 64 x 16 takes 144 KiB for prefill,
        # 32 x 32 at most 177 KiB for decode tiles) and a [64, 512] float32 accumulator
        block_m = max(min(block_m, 64), g_pad)
        block_n = 32 if block_m <= 32 else 16
    return AttentionConfig(block_m, block_m // g_pad, block_n, num_warps, num_stages, fp16_dot)


@functools.lru_cache(maxsize=8)
def _has_fp8_cvt(device: torch.device) -> bool:
    """Whether the device has the packed e4m3 -> f16 conversion (sm_89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_NUM_SMS


def _balance(programs: int, num_sms: int) -> float:
    """The share of busy SM slots over the rounds `programs` equal programs take: 272 programs
    on 132 SMs leave 8 SMs with a third, and the other 124 idle through it (0.69)."""
    return programs / (num_sms * triton.cdiv(programs, num_sms))


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_kv_len: int,
    block_q: int,
    num_sms: int,
) -> int:
    """Key splits per (query block, KV head): a power of two in [1, MAX_SPLITS].

    Split only when every request is one query block (decode, short spec-decode runs), and
    only into splits of at least MIN_KEYS_PER_SPLIT keys. `max_kv_len` is the most keys one
    query block can see (the window bounds it on SWA layers). Two regimes:
    - fewer programs than two per SM: aim at ~4 programs per SM (rounded up to a power of
      two). On H200, decode of one 32k-key request on 8 KV heads read K/V at 0.13 TB/s
      unsplit, 2.4 at 32 splits and 2.6-3.2 at 64.
    - more: the SMs are busy, and a split costs its partials and the merge launch. Split only
      while the last round of programs leaves more than a tenth of the SM slots idle
      (`_balance`) and each split keeps BALANCE_SPLIT_KEYS keys. H200, bf16, D 128, one CUDA
      graph per launch (benchmarks/decode_splits.py, RESULTS.md stop 24): Gemma-3-27B's 16 KV
      heads at batch 17 over 8.5k keys took 337 us at 2 splits (the old rule: 4 programs per
      SM) and 288 at 4; its 1,024-key window 55 at 2 and 48 unsplit; Llama-8B at batch 64
      over 4k keys 277 at 2 and 249 unsplit."""
    if max_query_len > block_q:
        return 1
    programs = num_seqs * num_kv_heads
    by_keys = max_kv_len // MIN_KEYS_PER_SPLIT
    if by_keys < 2:
        return 1
    cap = min(MAX_SPLITS, 1 << (by_keys.bit_length() - 1))  # power of two <= by_keys
    if programs < 2 * num_sms:  # then 4 * num_sms / programs > 2: always a split
        return min(cap, triton.next_power_of_2(triton.cdiv(4 * num_sms, max(1, programs))))
    splits = 1
    while (
        splits < cap
        and max_kv_len // (2 * splits) >= BALANCE_SPLIT_KEYS
        and _balance(programs * splits, num_sms) < 0.9
    ):
        splits *= 2
    return splits


MERGE_COUNTERS = 1 << 16  # (query block, KV head) pairs one launch may merge in-kernel
_counters: dict[torch.device, torch.Tensor] = {}


def merge_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The zeroed int32 arrival counters of the in-kernel split merge on `device`, or None for
    the separate `_reduce_splits` launch: unless SWASERVE_ATTN_MERGE=1, when a launch needs
    more than MERGE_COUNTERS, or when the buffer does not exist yet and a CUDA graph is being
    captured (a buffer allocated there would belong to the graph's pool).

    Opt-in, since it loses where splits are many (H200, benchmarks/RESULTS.md stop 23; bf16,
    32/8 heads, D 128, 64 splits, one CUDA graph per kernel pair): 6.47 -> 6.16 us at batch 1
    and 130 keys, but 17.0 -> 30.8 us at 4,096 keys and 71.8 -> 102.5 at batch 8: one program
    walks up to 64 partials in a dependent loop (an L2 round trip each) where the separate
    merge spreads them over (token, head) programs, 16 at a time. Batch-1 Llama-8B decode
    (128-token prompt): 4.300 -> 4.282 ms/token.

    Invariant: every launch leaves each counter it used at zero (the last split re-arms it), so
    the buffer is shared by all launches on the device; they must run one after another, as a
    step's launches on one stream do (graphs replay on that stream too)."""
    if needed > MERGE_COUNTERS or os.environ.get("SWASERVE_ATTN_MERGE") != "1":
        return None
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _counters[device] = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
    return buf


NO_SPLIT_CAP = 1 << 30
_no_caps: dict[torch.device, torch.Tensor] = {}


def no_split_cap(device: torch.device) -> torch.Tensor:
    """A `[1]` int32 on `device` no split count reaches: the `split_cap` of launches without one
    (every split of the grid). Made on first use, which must not be inside a CUDA graph capture
    (its value would be written only at replay): TritonBackend makes it at construction."""
    if device.type == "cuda" and device.index is None:  # one key for "cuda" and "cuda:N"
        device = torch.device("cuda", torch.cuda.current_device())
    cap = _no_caps.get(device)
    if cap is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("no_split_cap() first called inside a CUDA graph capture")
        cap = _no_caps[device] = torch.full((1,), NO_SPLIT_CAP, dtype=torch.int32,
                                            device=device)  # fmt: skip
    return cap


# ---- attention kernel -------------------------------------------------------------------------


@triton.jit
def _find_seq(qsl_ptr, block_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold `block_idx` (largest i: qsl[i] // BLOCK_Q + i <= it)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= block_idx:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _e4m3_to_f16(x):
    """float8_e4m3fn -> float16, exact: the packed sm_89+ conversion (one `cvt` per two values)
    as inline PTX marked impure, which Triton cannot sink past the tile's shared-memory staging
    as it does `.to(tl.float16)`. So a V tile is converted in the registers of its coalesced
    load and staged as fp16 (read back with transposing ldmatrix), instead of being staged as
    fp8 and gathered byte by byte into the dot operand (which pairs keys a row apart)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 a<2>; mov.b32 {a0, a1}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, a0; cvt.rn.f16x2.e4m3x2 $1, a1; }",
        "=r,=r,r",
        [x],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


# Key sources of a tile (`_attn_tile`'s SOURCE)
CACHE = tl.constexpr(0)
FRESH = tl.constexpr(1)
MIXED = tl.constexpr(2)


@triton.jit
def _fresh_to_dot(x, inv_scale, q):
    """A new token's K or V (model dtype) in the units of the fp8 cache (x / scale), in q's
    dtype (the dot operand); fp16 saturates at +-65504 (the fp8 store would at +-448)."""
    x = x.to(tl.float32) * inv_scale
    if q.dtype == tl.float16:
        x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
    return x.to(q.dtype)


@triton.jit
def _attn_tile(
    t, q, qpos, lo, last, m_i, l_i, acc, bt_row, k_cache_ptr, v_cache_ptr, d, d_valid, window,
    qk_scale_log2, cap_scale, cap_log2, kv_head, stride_kp, stride_ko, stride_kh, stride_vp,
    stride_vo, stride_vh, k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh,
    ctx, row0, k_inv, v_inv,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_FULL: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_CVT_F16: tl.constexpr,
    SOURCE: tl.constexpr,
):
    """One key tile t of the online softmax: keys t * BLOCK_N + [0, BLOCK_N), read iff in
    [lo, last]; returns the updated (m_i, l_i, acc). With MASKED False the caller guarantees
    every row sees every key of the tile (no causal/window/bounds masks).

    SOURCE: where the keys come from. CACHE: the paged cache. FRESH: the tile holds only keys of
    the request's new tokens (positions >= ctx), read from the step's own K/V (`k_new_ptr`,
    `v_new_ptr`: row row0 + position) in the model dtype: the caller passes q in that dtype and
    a score scale without k_scale; p is scaled by `v_inv` (1 / v_scale) to keep the
    accumulator in cache units. MIXED: the tile that straddles ctx (always MASKED): new keys
    are brought to cache units (`k_inv`, `v_inv`) and the dot dtype of the cache tiles."""
    kpos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    off = kpos % PAGE_SIZE
    if MASKED:
        k_valid = (kpos >= lo) & (kpos <= last)
    else:
        k_valid = kpos >= 0  # all true; only MIXED reads it
    in_cache = k_valid
    is_new = k_valid
    if SOURCE == MIXED:
        is_new = kpos >= ctx
        in_cache = k_valid & (kpos < ctx)
    if SOURCE != FRESH:
        if MASKED:
            page = tl.load(bt_row + kpos // PAGE_SIZE, mask=in_cache, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row + kpos // PAGE_SIZE).to(tl.int64)
        k_offs = page * stride_kp + off * stride_ko + kv_head * stride_kh
        if D_FULL and not MASKED:
            kt = tl.load(k_cache_ptr + k_offs[None, :] + d[:, None])
        else:
            kt_mask = in_cache[None, :] & d_valid[:, None]
            kt = tl.load(k_cache_ptr + k_offs[None, :] + d[:, None], mask=kt_mask, other=0.0)
        kt = kt.to(q.dtype)  # [D_PAD, BLOCK_N]
    if SOURCE != CACHE:
        kn_offs = (row0 + kpos).to(tl.int64) * stride_knt + kv_head * stride_knh
        if SOURCE == FRESH and D_FULL and not MASKED:
            kn = tl.load(k_new_ptr + kn_offs[None, :] + d[:, None])
        else:
            kn_mask = (k_valid & is_new)[None, :] & d_valid[:, None]
            kn = tl.load(k_new_ptr + kn_offs[None, :] + d[:, None], mask=kn_mask, other=0.0)
        if SOURCE == MIXED:
            kt = tl.where(is_new[None, :], _fresh_to_dot(kn, k_inv, q), kt)
        else:
            kt = kn.to(q.dtype)  # model units: the caller's q and score scale match
    s = tl.dot(q, kt, input_precision=DOT_PRECISION)
    if USE_SOFTCAP:
        # tanh(x) = sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}), overflow-free
        x = s * cap_scale
        e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        th = (1.0 - e) / (1.0 + e)
        s = tl.where(x < 0, -th, th) * cap_log2
    else:
        s = s * qk_scale_log2
    if MASKED:
        visible = k_valid[None, :] & (kpos[None, :] <= qpos[:, None])
        if USE_WINDOW:
            visible = visible & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    if SOURCE != FRESH:
        v_offs = page * stride_vp + off * stride_vo + kv_head * stride_vh
        if D_FULL and not MASKED:
            v = tl.load(v_cache_ptr + v_offs[:, None] + d[None, :])
        else:
            v_mask = in_cache[:, None] & d_valid[None, :]
            v = tl.load(v_cache_ptr + v_offs[:, None] + d[None, :], mask=v_mask, other=0.0)
        if V_CVT_F16:
            v = _e4m3_to_f16(v)  # [BLOCK_N, D_PAD], q is fp16
        else:
            v = v.to(q.dtype)  # [BLOCK_N, D_PAD]
    if SOURCE != CACHE:
        vn_offs = (row0 + kpos).to(tl.int64) * stride_vnt + kv_head * stride_vnh
        if SOURCE == FRESH and D_FULL and not MASKED:
            vn = tl.load(v_new_ptr + vn_offs[:, None] + d[None, :])
        else:
            vn_mask = (k_valid & is_new)[:, None] & d_valid[None, :]
            vn = tl.load(v_new_ptr + vn_offs[:, None] + d[None, :], mask=vn_mask, other=0.0)
        if SOURCE == MIXED:
            v = tl.where(is_new[:, None], _fresh_to_dot(vn, v_inv, q), v)
        else:
            v = vn.to(q.dtype)
            p = p * v_inv  # the accumulator is in cache units (x v_scale at the end)
    # the rescaled accumulator goes into the dot (wgmma accumulates in place on sm_90)
    acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attn_tiles(
    t_begin, t_end, q, qpos, lo, last, m_i, l_i, acc, bt_row, k_cache_ptr, v_cache_ptr, d,
    d_valid, window, qk_scale_log2, cap_scale, cap_log2, kv_head, stride_kp, stride_ko,
    stride_kh, stride_vp, stride_vo, stride_vh, k_new_ptr, v_new_ptr, stride_knt, stride_knh,
    stride_vnt, stride_vnh, ctx, row0, k_inv, v_inv,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_FULL: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_CVT_F16: tl.constexpr,
    SOURCE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Tiles [t_begin, t_end) in order (none when t_end <= t_begin)."""
    if INTERPRET:
        # numpy >= 2.4 cannot turn the interpreter's 1-element scalars into `range` bounds
        t = t_begin
        while t < t_end:
            m_i, l_i, acc = _attn_tile(
                t, q, qpos, lo, last, m_i, l_i, acc, bt_row, k_cache_ptr, v_cache_ptr, d,
                d_valid, window, qk_scale_log2, cap_scale, cap_log2, kv_head, stride_kp,
                stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, k_new_ptr, v_new_ptr,
                stride_knt, stride_knh, stride_vnt, stride_vnh, ctx, row0, k_inv, v_inv,
                PAGE_SIZE, BLOCK_N, D_FULL, MASKED, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
                V_CVT_F16, SOURCE,
            )
            t += 1
    else:
        for t in range(t_begin, t_end):
            m_i, l_i, acc = _attn_tile(
                t, q, qpos, lo, last, m_i, l_i, acc, bt_row, k_cache_ptr, v_cache_ptr, d,
                d_valid, window, qk_scale_log2, cap_scale, cap_log2, kv_head, stride_kp,
                stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, k_new_ptr, v_new_ptr,
                stride_knt, stride_knh, stride_vnt, stride_vnh, ctx, row0, k_inv, v_inv,
                PAGE_SIZE, BLOCK_N, D_FULL, MASKED, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
                V_CVT_F16, SOURCE,
            )
    return m_i, l_i, acc


@triton.jit
def _attn_span(
    t_begin, t_end, full_lo, full_hi, q, qpos, lo, last, m_i, l_i, acc, bt_row, k_cache_ptr,
    v_cache_ptr, d, d_valid, window, qk_scale_log2, cap_scale, cap_log2, kv_head, stride_kp,
    stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, k_new_ptr, v_new_ptr, stride_knt,
    stride_knh, stride_vnt, stride_vnh, ctx, row0, k_inv, v_inv,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_FULL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_CVT_F16: tl.constexpr,
    SOURCE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Tiles [t_begin, t_end) of one SOURCE: the masked ones before full_lo (window edge), the
    unmasked [full_lo, full_hi), the masked ones from full_hi (causal diagonal). Without a
    window full_lo is the first tile (t_begin >= full_lo): no window-edge loop is compiled."""
    if USE_WINDOW:
        m_i, l_i, acc = _attn_tiles(
            t_begin, tl.minimum(full_lo, t_end), q, qpos, lo, last, m_i, l_i, acc, bt_row,
            k_cache_ptr, v_cache_ptr, d, d_valid, window, qk_scale_log2, cap_scale, cap_log2,
            kv_head, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
            k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, ctx, row0,
            k_inv, v_inv, PAGE_SIZE, BLOCK_N, D_FULL, True, USE_WINDOW, USE_SOFTCAP,
            DOT_PRECISION, V_CVT_F16, SOURCE, INTERPRET,
        )
    m_i, l_i, acc = _attn_tiles(
        tl.maximum(full_lo, t_begin), tl.minimum(full_hi, t_end), q, qpos, lo, last, m_i, l_i,
        acc, bt_row, k_cache_ptr, v_cache_ptr, d, d_valid, window, qk_scale_log2, cap_scale,
        cap_log2, kv_head, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
        k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, ctx, row0, k_inv,
        v_inv, PAGE_SIZE, BLOCK_N, D_FULL, False, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION,
        V_CVT_F16, SOURCE, INTERPRET,
    )
    m_i, l_i, acc = _attn_tiles(
        tl.maximum(full_hi, t_begin), t_end, q, qpos, lo, last, m_i, l_i, acc, bt_row,
        k_cache_ptr, v_cache_ptr, d, d_valid, window, qk_scale_log2, cap_scale, cap_log2,
        kv_head, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, k_new_ptr,
        v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, ctx, row0, k_inv, v_inv,
        PAGE_SIZE, BLOCK_N, D_FULL, True, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, V_CVT_F16,
        SOURCE, INTERPRET,
    )
    return m_i, l_i, acc


# Runtime ints that vary step to step are not specialised (Triton would compile a variant per
# "== 1" / "% 16 == 0" class of each: the block table's row stride alone doubled the variants,
# each ~1-2 s of JIT on the first step that needs it).
@triton.jit(do_not_specialize=["num_seqs", "min_q_len", "max_q_len", "window", "stride_bt"])
def _paged_attn_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    qsl_ptr,
    seq_lens_ptr,
    sinks_ptr,
    part_acc_ptr,  # [T, H, splits, D_PAD] float32 (split path only)
    part_ml_ptr,  # [T, H, splits, 2] float32: running max (log2), denominator
    part_n_ptr,  # [T, H] int32: the splits holding keys (split 0 writes it; not MERGE_LAST)
    counter_ptr,  # [>= grid0 * grid1] int32, zero between launches (MERGE_LAST only)
    split_cap_ptr,  # [1] int32: the most splits a block takes (SPLIT_KV; `split_cap`)
    k_new_ptr,  # [T, Hkv, D] the step's own K/V (FRESH_NEW only)
    v_new_ptr,
    num_seqs,
    min_q_len,  # programs of requests with fewer or more new tokens return at once (a mixed
    max_q_len,  # batch's decodes and its prefill chunks go to two launches of their own tiles)
    window,
    qk_scale_log2,  # scale * k_scale * log2(e)
    cap_scale,  # scale * k_scale / softcap
    cap_log2,  # softcap * log2(e)
    v_scale,
    k_inv,  # 1 / k_scale, 1 / v_scale (FRESH_NEW only)
    v_inv,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_vp,
    stride_vo,
    stride_vh,
    stride_bt,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # the split count is the grid's third dimension, not a constexpr
    MERGE_LAST: tl.constexpr,  # SPLIT_KV: the last split to finish merges (no `_reduce_splits`)
    DOT_F16: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_CVT_F16: tl.constexpr,
    FRESH_NEW: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (swaserve/ops/pdl.py)
    # one program row per request (grid dimension 0 = num_seqs): a launch whose requests have
    # at most BLOCK_Q new tokens (the decode launch of a mixed batch); longer ones return
    ONE_BLOCK: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(USE_PDL)  # q and this layer's new keys come from the kernel before

    if ONE_BLOCK:
        seq = pid
    else:
        seq = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if ONE_BLOCK:
        q_block = 0
    else:
        q_block = pid - (q_start // BLOCK_Q + seq)
    if (q_block * BLOCK_Q >= q_len) | (q_len < min_q_len) | (q_len > max_q_len):
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    first = ctx + q_block * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, seq_len) - 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    tile_lo = lo // BLOCK_N
    tile_hi = last // BLOCK_N + 1
    used = 1  # splits holding keys
    if SPLIT_KV:
        # The grid's split count is a CUDA graph's maximum; `split_cap` (set per replay) is
        # what this step's batch wants, at most that.
        num_splits = tl.minimum(tl.maximum(tl.load(split_cap_ptr), 1), tl.num_programs(2))
        per_split = tl.maximum(tl.cdiv(tile_hi - tile_lo, num_splits), 1)
        used = tl.maximum(tl.cdiv(tile_hi - tile_lo, per_split), 1)
        # A split past the block's last tile returns before any load or store: the merge
        # reads only the first `used` partials of a row. At short contexts most programs
        # land here. A block with one split (`used == 1`) writes its output itself.
        if split >= used:
            return
        t_begin = tile_lo + split * per_split
        t_end = tl.minimum(t_begin + per_split, tile_hi)
    else:
        t_begin = tile_lo
        t_end = tile_hi

    rows = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + rows // G_PAD  # query index within the request
    hg = rows % G_PAD
    head = kv_head * G + hg
    row_valid = (qi < q_len) & (hg < G)
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM

    q_offs = (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_F16:
        # fp8 cache: dots in float16 (module docstring); a bf16 query is exact in fp16
        # down to 2^-17, the rare |q| > 65504 saturates instead of turning into inf
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    if DOT_F32:
        q = q.to(tl.float32)
    qpos = ctx + qi

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # seeded where this program writes the output (the merge adds it otherwise)
        sink = tl.load(sinks_ptr + head, mask=hg < G, other=0.0).to(tl.float32)
        m_i = tl.where(used == 1, sink * 1.4426950408889634, m_i)
        l_i = tl.where(used == 1, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # Tiles every row of the block sees whole, run without masks: keys in
    # [last - window + 1, first] (from 0 without window). The masked tiles before them hold the
    # window edge, those after them the causal diagonal:
    #   tile_lo .. masked .. full_lo .. unmasked .. full_hi .. masked .. tile_hi
    # each intersected with this split's [t_begin, t_end).
    full_lo = tile_lo
    if USE_WINDOW:
        full_lo = tl.maximum(tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N), tile_lo)
    full_hi = tl.maximum((first + 1) // BLOCK_N, full_lo)

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    row0 = q_start - ctx  # row of k_new / v_new holding key position p: row0 + p (p >= ctx)
    if FRESH_NEW:
        # A request with more than one new token (prefill chunk) reads keys [0, ctx) from the
        # cache and [ctx, seq_len) from the step's own K/V, at full precision; tile
        # ctx // BLOCK_N straddles the two when ctx is not a multiple of BLOCK_N. A decode
        # token reads its own key from the cache like the rest.
        new_lo = tl.where(q_len > 1, ctx // BLOCK_N, tile_hi)
        new_hi = tl.where(q_len > 1, tl.cdiv(ctx, BLOCK_N), tile_hi)
        m_i, l_i, acc = _attn_span(
            t_begin, tl.minimum(t_end, new_lo), full_lo, full_hi, q, qpos, lo, last, m_i, l_i,
            acc, bt_row, k_cache_ptr, v_cache_ptr, d, d_valid, window, qk_scale_log2,
            cap_scale, cap_log2, kv_head, stride_kp, stride_ko, stride_kh, stride_vp,
            stride_vo, stride_vh, k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt,
            stride_vnh, ctx, row0, k_inv, v_inv, PAGE_SIZE, BLOCK_N, HEAD_DIM == D_PAD,
            USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, V_CVT_F16, CACHE, INTERPRET,
        )
        m_i, l_i, acc = _attn_tiles(
            tl.maximum(new_lo, t_begin), tl.minimum(new_hi, t_end), q, qpos, lo, last, m_i,
            l_i, acc, bt_row, k_cache_ptr, v_cache_ptr, d, d_valid, window, qk_scale_log2,
            cap_scale, cap_log2, kv_head, stride_kp, stride_ko, stride_kh, stride_vp,
            stride_vo, stride_vh, k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt,
            stride_vnh, ctx, row0, k_inv, v_inv, PAGE_SIZE, BLOCK_N, HEAD_DIM == D_PAD, True,
            USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, V_CVT_F16, MIXED, INTERPRET,
        )
        # fresh-only tiles: dots in the model dtype (no conversions), scores without k_scale
        q_model = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
        if DOT_F32:
            q_model = q_model.to(tl.float32)
        m_i, l_i, acc = _attn_span(
            tl.maximum(new_hi, t_begin), t_end, full_lo, full_hi, q_model, qpos, lo, last, m_i,
            l_i, acc, bt_row, k_cache_ptr, v_cache_ptr, d, d_valid, window,
            qk_scale_log2 * k_inv, cap_scale * k_inv, cap_log2, kv_head, stride_kp, stride_ko,
            stride_kh, stride_vp, stride_vo, stride_vh, k_new_ptr, v_new_ptr, stride_knt,
            stride_knh, stride_vnt, stride_vnh, ctx, row0, k_inv, v_inv, PAGE_SIZE, BLOCK_N,
            HEAD_DIM == D_PAD, USE_WINDOW, USE_SOFTCAP, DOT_PRECISION, V_CVT_F16, FRESH,
            INTERPRET,
        )
    else:
        m_i, l_i, acc = _attn_span(
            t_begin, t_end, full_lo, full_hi, q, qpos, lo, last, m_i, l_i, acc, bt_row,
            k_cache_ptr, v_cache_ptr, d, d_valid, window, qk_scale_log2, cap_scale, cap_log2,
            kv_head, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
            k_new_ptr, v_new_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh, ctx, row0,
            k_inv, v_inv, PAGE_SIZE, BLOCK_N, HEAD_DIM == D_PAD, USE_WINDOW, USE_SOFTCAP,
            DOT_PRECISION, V_CVT_F16, CACHE, INTERPRET,
        )

    store_mask = row_valid[:, None] & d_valid[None, :]
    tok = (q_start + qi).to(tl.int64)
    o_offs = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if not SPLIT_KV:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc * (v_scale / l_safe)[:, None]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
    elif used == 1:
        # The only split of its block: the output directly, no partials. `part_n` 0 tells
        # `_reduce_splits` the row is done (MERGE_LAST: no counter was taken).
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc * (v_scale / l_safe)[:, None]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
        if not MERGE_LAST:
            n_row = tl.full([BLOCK_M], 0, tl.int32)
            tl.store(part_n_ptr + tok * (tl.num_programs(1) * G) + head, n_row, mask=row_valid)
    else:
        # partials of row (tok, head, split): contiguous [T, H, splits, ...] scratch
        part = (tok * (tl.num_programs(1) * G) + head) * tl.num_programs(2) + split
        tl.store(
            part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc * v_scale, mask=store_mask
        )
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)
        if MERGE_LAST:
            # The `used` programs of this (query block, KV head) count themselves in; the last
            # to arrive merges every partial (its own included) and re-arms the counter for the
            # next launch. Release: the barrier orders all threads' partial stores before the
            # one thread's gpu-scope atomic (CUTLASS's split-K semaphore does the same); the
            # acquire side reads the partials past L1 (.cg).
            tl.debug_barrier()
            counter = counter_ptr + pid * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == used - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                o = _merge_partials(
                    part_acc_ptr, part_ml_ptr, sinks_ptr, part - split, used, head, hg < G,
                    row_valid, d, store_mask, D_PAD, BLOCK_M, USE_SINKS,
                )
                tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=store_mask)
        elif split == 0:
            n_row = tl.full([BLOCK_M], 0, tl.int32) + used
            tl.store(part_n_ptr + tok * (tl.num_programs(1) * G) + head, n_row, mask=row_valid)


@triton.jit
def _merge_partials(
    part_acc_ptr, part_ml_ptr, sinks_ptr, base, used, head, head_valid, row_valid, d,
    store_mask, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """The normalised output of rows whose `used` partials start at `base` ([BLOCK_M]): the
    online-softmax merge of (acc_j, m_j, l_j) in split order, seeded with the sink when there is
    one (the splits leave it out). Loads bypass L1: other programs wrote these during this
    launch."""
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        m = tl.load(sinks_ptr + head, mask=head_valid, other=0.0).to(tl.float32) * LOG2E_C
        den = tl.full([BLOCK_M], 1.0, tl.float32)
    o = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    s = 0
    while s < used:  # a runtime bound (the interpreter takes no range() over one)
        ms = tl.load(part_ml_ptr + (base + s) * 2, mask=row_valid, other=-1.0e30,
                     cache_modifier=".cg")  # fmt: skip
        ls = tl.load(part_ml_ptr + (base + s) * 2 + 1, mask=row_valid, other=0.0,
                     cache_modifier=".cg")  # fmt: skip
        acc = tl.load(part_acc_ptr + (base + s)[:, None] * D_PAD + d[None, :], mask=store_mask,
                      other=0.0, cache_modifier=".cg")  # fmt: skip
        m_new = tl.maximum(m, ms)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(ms - m_new)
        den = den * alpha + ls * beta
        o = o * alpha[:, None] + acc * beta[:, None]
        m = m_new
        s += 1
    return o / tl.where(den == 0.0, 1.0, den)[:, None]


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits(
    part_acc_ptr,
    part_ml_ptr,
    part_n_ptr,
    sinks_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Merge the `num_splits` partials of one (token, head) row: out = sum_j acc_j 2^(m_j - M) / L
    with M = max(m_j [, sink]), L = sum_j l_j 2^(m_j - M) [+ 2^(sink - M)]. The splits are read
    BLOCK_S at a time (the count is a runtime value: one compiled variant for every count), and
    only the `part_n` that hold keys; 0 marks a row its one split wrote whole (nothing to do).
    A row no attention program wrote (a prefill row of a mixed batch's decode launch, rewritten
    by the prefill launch after this; CUDA graph padding) reads a stale count: clamped to
    [0, num_splits], so every read stays inside the partials."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pdl_wait(USE_PDL)
    row = tok * NUM_HEADS + head
    base = row * num_splits
    used = tl.minimum(tl.maximum(tl.load(part_n_ptr + row), 0), num_splits)
    if used == 0:
        return
    d = tl.arange(0, D_PAD)
    m_max = tl.full([], -1.0e30, tl.float32)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    # while loops: the interpreter cannot take a runtime scalar argument as a range() bound
    s0 = 0
    while s0 < used:
        sp = s0 + tl.arange(0, BLOCK_S)
        m = tl.load(part_ml_ptr + (base + sp) * 2, mask=sp < used, other=-1.0e30)
        m_max = tl.maximum(m_max, tl.max(m, 0))
        s0 += BLOCK_S
    denom = tl.zeros([], tl.float32)
    if USE_SINKS:
        denom += tl.exp2(sink - m_max)
    o = tl.zeros([D_PAD], tl.float32)
    s0 = 0
    while s0 < used:
        sp = s0 + tl.arange(0, BLOCK_S)
        valid = sp < used
        m = tl.load(part_ml_ptr + (base + sp) * 2, mask=valid, other=-1.0e30)
        lsum = tl.load(part_ml_ptr + (base + sp) * 2 + 1, mask=valid, other=0.0)
        w = tl.where(valid, tl.exp2(m - m_max), 0.0)
        denom += tl.sum(lsum * w, 0)
        acc = tl.load(
            part_acc_ptr + (base + sp)[:, None] * D_PAD + d[None, :], mask=valid[:, None],
            other=0.0,
        )
        o += tl.sum(acc * w[:, None], 0)
        s0 += BLOCK_S
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + d,
        (o / denom).to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def kernel_constexprs(
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim: int,
    group: int,
    page_size: int,
    cfg: AttentionConfig,
    *,
    window: int,
    softcap: float,
    use_sinks: bool,
    num_splits: int,
    fresh_new: bool,
    interpret: bool,
    fp8_cvt: bool,
    pdl: bool = False,
    merge_last: bool = False,
    one_block: bool = False,
) -> dict:
    """The compile-time parameters of one `_paged_attn_kernel` launch (also what the sm_90a
    compile test builds kernels from, on a machine without a GPU). `fp8_cvt`: the device has
    the packed e4m3 -> f16 conversion (sm_89+); `pdl`: launched with PDL (swaserve/ops/pdl.py);
    `merge_last`: with splits, the last split of each block merges them (`merge_counters`);
    `one_block`: one program row per request (the decode launch of a mixed batch)."""
    # tl.dot needs K >= 16 when compiled for a GPU (the interpreter takes any size): heads
    # narrower than 16 (tiny test drafters) are padded and masked like any other padding.
    d_pad = max(16, triton.next_power_of_2(head_dim))
    dot_f32 = interpret and q_dtype != torch.float32
    fp8 = kv_dtype == FP8
    dot_f16 = fp8 and q_dtype == torch.bfloat16 and cfg.fp8_fp16_dot
    v_cvt_f16 = (
        fp8
        and not interpret
        and cfg.fp8_v_cvt_regs
        and (dot_f16 or q_dtype == torch.float16)
        and cfg.block_n * d_pad >= 128 * cfg.num_warps  # >= 4 values per thread (pack=4)
        and fp8_cvt
        # ptxas (Triton 3.6, sm_90a) segfaults on the fresh-tile kernel at head_dim <= 32
        # with V converted in registers (tests/kernels/test_triton_sm90_compile.py)
        and not (fresh_new and d_pad < 64)
    )
    return dict(
        G=group,
        G_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE_SIZE=page_size,
        BLOCK_M=cfg.block_m,
        BLOCK_Q=cfg.block_q,
        BLOCK_N=cfg.block_n,
        USE_WINDOW=window > 0,
        USE_SOFTCAP=bool(softcap),
        USE_SINKS=use_sinks,
        SPLIT_KV=num_splits > 1,
        MERGE_LAST=merge_last and num_splits > 1,
        DOT_F16=dot_f16,
        DOT_F32=dot_f32,
        DOT_PRECISION="ieee" if (dot_f32 or q_dtype == torch.float32) else "tf32",
        V_CVT_F16=v_cvt_f16,
        FRESH_NEW=fresh_new,
        INTERPRET=interpret,
        USE_PDL=pdl,
        ONE_BLOCK=one_block,
    )


def chunk_num_splits(
    max_query_len: int, max_kv_len: int, block_q: int, num_kv_heads: int, num_sms: int
) -> int:
    """Key splits of the prefill-tile launch of a mixed batch: a chunk of a few query blocks
    over a long context (a KV-bound step: ~185 tokens beside the decodes, over 16k keys) is a
    few dozen programs walking every key one after the other. Double the splits while the
    programs fit one per SM (ending at one to two per SM), into splits of at least
    BALANCE_SPLIT_KEYS keys; long chunks (many blocks) are not split."""
    programs = triton.cdiv(max(1, max_query_len), block_q) * num_kv_heads
    splits = 1
    while (
        splits < MAX_SPLITS
        and programs * splits <= num_sms
        and max_kv_len // (2 * splits) >= BALANCE_SPLIT_KEYS
    ):
        splits *= 2
    return splits


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    min_query_len: int | None = None,
    split_cap: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged paged attention; returns `[T, H, D]` in q's dtype.

    q `[T, H, D]`; k_cache/v_cache `[num_pages, page_size, Hkv, D]` (last dim contiguous; bf16,
    fp16, fp32 or float8_e4m3fn with `k_scale`/`v_scale`); block_table `[B, max_pages]` int32;
    query_start_loc `[B + 1]` int32; seq_lens `[B]` int32 (context + new tokens). The host ints
    `max_query_len` and `max_seq_len` pick tile sizes and splits without a device sync.
    window 0 = full attention, softcap 0 = none, sinks `[H]` (any float dtype) or None.
    `num_splits` None = `choose_num_splits`; an explicit value is rounded up to a power of two.
    `config` None = `attention_config`; an explicit one (benchmarks, tuning sweeps) must have
    `block_m == block_q * next_power_of_2(H // Hkv)`.
    k_new/v_new `[T, Hkv, D]` (optional): the step's own K/V, as stored. A request with more
    than one new token reads its new tokens' keys from them instead of from the cache (those
    cache slots are not read): with an fp8 cache always, so a prefill chunk attends to itself
    at full precision and only the cached prefix goes through fp8; with any other cache (the
    same values either way) only in a launch of chunks whose new tokens are at least half of
    the longest request's keys (`fresh_pays`); a decode token reads the cache only.
    `min_query_len` (host int, optional): the batch's shortest query run; with a default
    `config`, a batch mixing decode-sized and longer runs takes two launches, each with its own
    tiles (an explicit `num_splits` is then the decode launch's: a mixed CUDA graph's).
    `split_cap` (optional, `[1]` int32 on the device): with `num_splits` > 1, each query block
    takes at most this many of the grid's splits (its value may change between CUDA graph
    replays; the grid's count is the capture's maximum); None: every split of the grid.
    """
    t, h, d = q.shape
    num_pages, page_size, hkv, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape and h % hkv == 0
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return out
    group = h // hkv
    fresh_new = k_new is not None
    if fresh_new:
        assert v_new is not None and k_new.shape == v_new.shape == (t, hkv, d)
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1
    else:
        k_new = v_new = q  # dummy pointers, never read
    fp8 = k_cache.dtype == FP8
    launch = functools.partial(
        _launch, q, k_cache, v_cache, out, block_table, query_start_loc, seq_lens,
        max_seq_len=max_seq_len, scale=scale, window=window, softcap=softcap, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale, k_new=k_new, v_new=v_new, split_cap=split_cap,
    )
    # The fresh reads of a cache in the model dtype are a speed choice (H200, bf16,
    # benchmarks/attention_tuning.py: +5-17% on prefill chunks with little or no cached prefix,
    # -11% for a 2k chunk over a 6k prefix, slower decode-tile launches)
    fresh_pays = fresh_new and (fp8 or max_seq_len <= 2 * max_query_len)
    if config is None and min_query_len is not None:
        # A mixed batch (decodes beside a prefill chunk): one launch would give every decode a
        # prefill-sized tile (up to 128 rows for its G real ones) and 8 warps. The requests of
        # one decode tile's query block (q_len <= its BLOCK_Q) get their own launch with the
        # decode tile and its key splits; the longer ones the prefill tile. Each launch's
        # programs for the other kind return at once.
        small = attention_config(d, group, 1, k_cache.dtype)
        if min_query_len <= small.block_q < max_query_len:
            # Order matters: the decode launch's split merge writes every row of `out`, and
            # the prefill launch, after it on the stream, rewrites its own requests' rows (its
            # own merge, when it splits, skips the decode rows: zeroed split counts).
            launch(small, num_splits, (1, small.block_q), small.block_q,
                   fresh_new=fresh_new and fp8, one_block=True)
            big = attention_config(d, group, max_query_len, k_cache.dtype)
            # a query block's keys: a window bounds them (splits divide one block's keys)
            max_kv = max_seq_len if window <= 0 else min(max_seq_len, window + big.block_q - 1)
            chunk = chunk_num_splits(max_query_len, max_kv, big.block_q, hkv, _num_sms(q.device))
            launch(big, chunk, (small.block_q + 1, ANY_Q_LEN), max_query_len,
                   fresh_new=fresh_pays, own_rows=True)
            return out
    cfg = config or attention_config(d, group, max_query_len, k_cache.dtype)
    launch(cfg, num_splits, (0, ANY_Q_LEN), max_query_len, fresh_new=fresh_pays)
    return out


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    cfg: AttentionConfig,
    num_splits: int | None,
    q_lens: tuple[int, int],
    max_query_len: int,
    *,
    max_seq_len: int,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    k_scale: float,
    v_scale: float,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    fresh_new: bool,
    split_cap: torch.Tensor | None,
    one_block: bool = False,
    own_rows: bool = False,
) -> None:
    """One `_paged_attn_kernel` launch (and its split merge) over the requests whose new
    tokens number q_lens[0] to q_lens[1], writing their rows of `out`; `max_query_len` is the
    most of them (it bounds the keys a query block sees, for the splits). `one_block`: every
    such request is one query block (grid rows = requests); `own_rows`: a split merge touches
    only the rows this launch owns (the others' split counts zeroed)."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = h // hkv
    assert cfg.block_m == cfg.block_q * triton.next_power_of_2(group), cfg
    if num_splits is None:
        max_kv_len = max_seq_len if window <= 0 else min(max_seq_len, window + max_query_len - 1)
        num_splits = choose_num_splits(
            num_seqs, hkv, max_query_len, max_kv_len, cfg.block_q, _num_sms(q.device)
        )
        # The partials take [T, H, splits, D] floats, T all the batch's rows: beside a long
        # prefill chunk (the decode launch of a mixed batch) that bounds the splits.
        row_bytes = t * h * triton.next_power_of_2(max(16, d)) * 4
        while num_splits > 1 and num_splits * row_bytes > MAX_SPLIT_BYTES:
            num_splits //= 2
    num_splits = triton.next_power_of_2(max(1, num_splits))
    pdl = pdl_enabled(q.device)
    grid = (num_seqs if one_block else t // cfg.block_q + num_seqs, hkv, num_splits)
    counters = merge_counters(q.device, grid[0] * grid[1]) if num_splits > 1 else None
    consts = kernel_constexprs(
        q.dtype, k_cache.dtype, d, group, k_cache.shape[1], cfg, window=window,
        softcap=softcap, use_sinks=sinks is not None, num_splits=num_splits,
        fresh_new=fresh_new, interpret=_interpreting(), fp8_cvt=_has_fp8_cvt(q.device), pdl=pdl,
        merge_last=counters is not None, one_block=one_block,
    )
    d_pad = consts["D_PAD"]
    qk_scale = scale * k_scale
    use_sinks = sinks is not None
    sinks_arg = sinks.float().contiguous() if use_sinks else q  # dummy pointer when unused
    if num_splits > 1:
        part_acc = torch.empty((t, h, num_splits, d_pad), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((t, h, num_splits, 2), dtype=torch.float32, device=q.device)
        alloc = torch.zeros if own_rows else torch.empty
        part_n = out if counters is not None else alloc((t, h), dtype=torch.int32,
                                                        device=q.device)  # fmt: skip
    else:
        part_acc = part_ml = part_n = out  # unused
    _run(
        _paged_attn_kernel,
        grid,
        q,
        k_cache,
        v_cache,
        out,
        block_table,
        query_start_loc,
        seq_lens,
        sinks_arg,
        part_acc,
        part_ml,
        part_n,
        out if counters is None else counters,  # dummy pointer when unused
        split_cap if split_cap is not None and num_splits > 1 else no_split_cap(q.device),
        k_new,
        v_new,
        num_seqs,
        q_lens[0],
        q_lens[1],
        max(0, window),
        qk_scale * LOG2E,
        qk_scale / softcap if softcap else 0.0,
        softcap * LOG2E if softcap else 0.0,
        v_scale,
        1.0 / k_scale,
        1.0 / v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        **consts,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_launch(pdl),
    )
    if num_splits > 1 and counters is None:
        _run(
            _reduce_splits,
            (t, h),
            part_acc,
            part_ml,
            part_n,
            sinks_arg,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            NUM_HEADS=h,
            HEAD_DIM=d,
            D_PAD=d_pad,
            BLOCK_S=REDUCE_BLOCK_S,
            USE_SINKS=use_sinks,
            USE_PDL=pdl,
            num_warps=4 if d_pad <= 128 else 8,
            **pdl_launch(pdl),
        )


# ---- K/V store --------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3(x):
    """Round float32 `x` (|x| <= 448) to the nearest float8_e4m3fn value, ties to even, in
    integer arithmetic, so the final cast is exact on GPU and in the interpreter alike (the
    interpreter's own float -> fp8 cast does not round correctly).

    Normals (|x| >= 2^-6): keep 3 mantissa bits; add half an ulp (minus one, plus the kept lsb)
    to the bits and clear the 20 dropped ones; a carry bumps the exponent.
    Subnormals (spacing 2^-9): |x| / 2^-9 = mant * 2^(e - 14) with the 24-bit mantissa, rounded
    to an integer by shift and remainder (shift clamped at 25, where everything rounds to 0)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) << 31  # arithmetic shift: the sign bit alone (-0.0 keeps its sign)
    ab = bits & 0x7FFFFFFF
    normal = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    e = (ab >> 23) - 127
    mant = (ab & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(14 - e, 1), 25)
    qv = mant >> sh
    rem = mant & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    qv += ((rem > half) | ((rem == half) & ((qv & 1) == 1))).to(tl.int32)
    sub = (qv.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    r = tl.where(ab < 0x3C800000, sub, normal) | sign  # 0x3C800000 == bits of 2^-6
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,
    stride_co,
    stride_ch,
    stride_dp,
    stride_do,
    stride_dh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padded token (e.g. a CUDA-graph batch): nothing to store
        return
    hh = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (hh < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + tok * stride_kt + hh[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + hh[:, None] * stride_vh + d[None, :], mask=mask)
    _write_slot(k, v, slot, hh, d, mask, k_cache_ptr, v_cache_ptr, stride_cp, stride_co,
                stride_ch, stride_dp, stride_do, stride_dh, k_scale, v_scale, PAGE_SIZE, FP8)


@triton.jit
def _write_slot(
    k, v, slot, hh, d, mask, k_cache_ptr, v_cache_ptr, stride_cp, stride_co, stride_ch,
    stride_dp, stride_do, stride_dh, k_scale, v_scale, PAGE_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """Write one token's k/v `[heads, D]` tiles to flat `slot` of the caches; an fp8 cache
    takes `x / scale` saturated at the largest finite e4m3 value (e4m3fn has no inf)."""
    if FP8:
        k = _round_to_e4m3(tl.minimum(tl.maximum(k.to(tl.float32) / k_scale, -448.0), 448.0))
        v = _round_to_e4m3(tl.minimum(tl.maximum(v.to(tl.float32) / v_scale, -448.0), 448.0))
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    kc = k_cache_ptr + page * stride_cp + off * stride_co + hh[:, None] * stride_ch + d[None, :]
    vc = v_cache_ptr + page * stride_dp + off * stride_do + hh[:, None] * stride_dh + d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter k/v `[T, Hkv, D]` to flat slots `page * page_size + offset` of the layer's caches
    `[num_pages, page_size, Hkv, D]`. An fp8 cache stores `x / scale` rounded to e4m3
    (saturated at ±448); a negative slot skips its token."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _run(
        _store_kv_kernel,
        (t,),
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        H_PAD=triton.next_power_of_2(hkv),
        D_PAD=triton.next_power_of_2(d),
        PAGE_SIZE=k_cache.shape[1],
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )
