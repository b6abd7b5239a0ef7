"""Triton paged-attention kernels against the torch reference, on CPU under the interpreter.

Every test name contains `triton` (`pytest -k triton`). The kernels run with the same tile sizes
as on the GPU, so problems are tiny. Set SWASERVE_TEST_TRITON_CUDA=1 to run the same tests
compiled on a CUDA device instead of interpreted.

Poisoned storage: the caches start as NaN and only keys a query may see get real values; the
NULL page 0, retired table slots, keys before a request's window and slots past its length stay
NaN, so any read of them turns the output into NaN.
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

import swaserve.attention.kernels.paged_attention as pa  # noqa: E402
from swaserve.attention.base import AttentionInputs, slot_mapping  # noqa: E402
from swaserve.attention.kernels.paged_attention import (  # noqa: E402
    MAX_SPLITS,
    attention_config,
    choose_num_splits,
    paged_attention,
    store_kv,
)
from swaserve.attention.torch_backend import attend  # noqa: E402

DEVICE = torch.device("cuda" if _CUDA else "cpu")
FP8 = torch.float8_e4m3fn
NULL = 0


@dataclass
class Case:
    """A ragged batch over a poisoned paged cache, with its dense reference."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    qlens: list[int]
    ctxs: list[int]
    tables: list[list[int]]  # with retired slots NULL
    page_size: int
    window: int
    k_scale: float = 1.0
    v_scale: float = 1.0
    # the new tokens' own K/V `[T, Hkv, D]` at full precision: a request with more than one new
    # token reads them (their cache slots are NaN), a decode token the cache (its rows are NaN)
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None

    def run(self, **kw) -> torch.Tensor:
        # as the backend calls it: with the shortest query run (mixed batches: two launches)
        kw.setdefault("min_query_len", min(self.qlens))
        return paged_attention(
            self.q, self.k_cache, self.v_cache, self.block_table, self.qsl, self.seq_lens,
            max_query_len=max(self.qlens), max_seq_len=int(self.seq_lens.max()),
            window=self.window, k_scale=self.k_scale, v_scale=self.v_scale, k_new=self.k_new,
            v_new=self.v_new, **kw,
        )

    def reference(
        self, scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        hkv, d = self.k_cache.shape[2:]
        kf = self.k_cache.float().reshape(-1, hkv, d) * self.k_scale
        vf = self.v_cache.float().reshape(-1, hkv, d) * self.v_scale
        out = torch.empty(self.q.shape, dtype=torch.float32, device=self.q.device)
        row = 0
        for n, ctx, table in zip(self.qlens, self.ctxs, self.tables):
            start = max(0, ctx - self.window + 1) if self.window else 0
            slots = slot_mapping(table, start, ctx + n, self.page_size).to(self.q.device)
            qpos = torch.arange(ctx, ctx + n)[:, None]
            kpos = torch.arange(start, ctx + n)[None, :]
            mask = kpos <= qpos
            if self.window:
                mask &= kpos > qpos - self.window
            keys, vals = kf[slots], vf[slots]
            if self.k_new is not None and n > 1:  # the last n keys are the new tokens'
                keys[-n:] = self.k_new[row : row + n].float()
                vals[-n:] = self.v_new[row : row + n].float()
            out[row : row + n] = attend(
                self.q[row : row + n].float(), keys, vals, mask.to(self.q.device), scale,
                softcap or None, sinks,
            )
            row += n
        return out


def make_case(
    qlens: list[int],
    ctxs: list[int],
    *,
    page_size: int = 4,
    num_kv_heads: int = 2,
    group: int = 1,
    head_dim: int = 32,
    window: int = 0,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    seed: int = 0,
    fresh: bool = False,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    seq = [n + c for n, c in zip(qlens, ctxs)]
    num_table_pages = [math.ceil(s / page_size) for s in seq]
    num_pages = 1 + sum(num_table_pages) + 3  # NULL + used + spare (never referenced)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    k_scale = v_scale = 1.0
    if kv_dtype == FP8:
        k_scale, v_scale = 0.05, 0.02
    tables = []
    for n, ctx, npg in zip(qlens, ctxs, num_table_pages):
        table, perm = perm[:npg], perm[npg:]
        start = max(0, ctx - window + 1) if window else 0
        for p in range(start, ctx + n):  # real values only where some query may look
            k[table[p // page_size], p % page_size] = torch.randn(
                num_kv_heads, head_dim, generator=gen
            )
            v[table[p // page_size], p % page_size] = torch.randn(
                num_kv_heads, head_dim, generator=gen
            )
        for i in range(start // page_size):  # retire pages wholly before the window
            table[i] = NULL
        tables.append(table)
    k_new = v_new = None
    if fresh:  # the new tokens' K/V live outside the cache: poison their slots
        k_new = torch.empty(sum(qlens), num_kv_heads, head_dim)
        v_new = torch.empty_like(k_new)
        row = 0
        for n, ctx, table in zip(qlens, ctxs, tables):
            for p in range(ctx, ctx + n):
                slot = (table[p // page_size], p % page_size)
                if n > 1:
                    k_new[row], v_new[row] = k[slot], v[slot]
                    k[slot] = v[slot] = float("nan")
                else:
                    k_new[row] = v_new[row] = float("nan")
                row += 1
        k_new, v_new = k_new.to(DEVICE, dtype), v_new.to(DEVICE, dtype)
    if kv_dtype == FP8:
        k = (k / k_scale).clamp(-448, 448)  # NaN stays NaN
        v = (v / v_scale).clamp(-448, 448)
    width = max(num_table_pages) + 1  # one extra column of NULL padding
    bt = torch.tensor([t + [NULL] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(qlens), num_kv_heads * group, head_dim, generator=gen)
    return Case(
        q.to(DEVICE, dtype), k.to(DEVICE, kv_dtype), v.to(DEVICE, kv_dtype), bt.to(DEVICE),
        qsl.to(DEVICE), torch.tensor(seq, dtype=torch.int32, device=DEVICE), list(qlens),
        list(ctxs), tables, page_size, window, k_scale, v_scale, k_new, v_new,
    )


def check(case: Case, atol: float = 1e-4, **kw) -> None:
    scale = kw.pop("scale", case.q.shape[-1] ** -0.5)
    out = case.run(scale=scale, **kw)
    ref = case.reference(scale, kw.get("softcap", 0.0), kw.get("sinks"))
    assert not out.isnan().any(), "read poisoned storage (NULL page, retired or unseen key)"
    err = (out.float() - ref).abs().max().item()
    assert err < atol, f"max |err| {err}"


# ---- ragged batches: prefill over cached prefixes, decode, mixed -------------------------------


@pytest.mark.parametrize(
    "group,head_dim,page_size",
    [(1, 16, 4), (4, 32, 16), (8, 64, 4), (3, 32, 1), (2, 48, 4)],
)
def test_triton_prefill_over_cached_prefix(group, head_dim, page_size):
    # one fresh prefill, one chunk over a cached prefix, one long chunk (BLOCK_M 128 at G=1)
    case = make_case(
        [9, 13, 70 if group == 1 else 21], [0, 140, 5], page_size=page_size, group=group,
        head_dim=head_dim, seed=group,
    )
    check(case)


@pytest.mark.parametrize("group,window", [(1, 0), (4, 3), (8, 0), (4, 9), (2, 150)])
def test_triton_decode(group, window):
    case = make_case(
        [1, 1, 1, 1], [0, 6, 17, 200], group=group, head_dim=32, window=window, seed=10 + group
    )
    check(case)


@pytest.mark.parametrize("window", [0, 5])
def test_triton_mixed_batch(window):
    # decodes and prefill chunks interleaved in one launch
    case = make_case(
        [1, 12, 1, 7, 1], [190, 0, 3, 19, 0], group=4, head_dim=32, window=window, seed=20
    )
    check(case)


@pytest.mark.parametrize(
    "window,page_size", [(2, 4), (4, 4), (11, 4), (3, 16), (1, 4), (100, 16)]
)
def test_triton_window_vs_page(window, page_size):
    # windows smaller than, equal to and larger than a page; retired slots are NULL
    case = make_case(
        [6, 1, 17], [13, 29 if window < 100 else 300, 9], page_size=page_size, group=2,
        window=window, seed=30 + window,
    )
    assert any(NULL in t for t in case.tables)
    check(case)


@pytest.mark.parametrize(
    "softcap,use_sinks,window", [(5.0, False, 0), (0.0, True, 0), (3.0, True, 4)]
)
def test_triton_softcap_and_sinks(softcap, use_sinks, window):
    case = make_case([5, 1, 18], [7, 150, 2], group=4, window=window, seed=40)
    sinks = torch.randn(case.q.shape[1], device=DEVICE) * 2 if use_sinks else None
    check(case, softcap=softcap, sinks=sinks)


def test_triton_head_dim_256():
    case = make_case([3, 1, 9], [8, 140, 0], num_kv_heads=1, group=2, head_dim=256, seed=50)
    check(case, atol=2e-4)


@pytest.mark.parametrize("qlens,ctxs", [([3, 1, 40], [8, 140, 0]), ([1, 1], [70, 5])])
def test_triton_head_dim_512(qlens, ctxs):
    """Gemma 4's full layers: the 512-dim tiles (64 x 16 for chunks, 32 x 32 for decode)."""
    case = make_case(qlens, ctxs, num_kv_heads=1, group=8, head_dim=512, seed=51)
    check(case, atol=2e-4)


# ---- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 4.0)])
def test_triton_bf16(window, softcap):
    case = make_case(
        [1, 11, 4], [140, 2, 0], group=4, window=window, dtype=torch.bfloat16, seed=60
    )
    check(case, atol=3e-2, softcap=softcap)


@pytest.mark.parametrize("q_dtype,window", [(torch.float32, 0), (torch.bfloat16, 5)])
def test_triton_fp8_kv(q_dtype, window):
    # reference = the same math on the dequantised cache (the kernel folds the scales in)
    case = make_case(
        [1, 9, 3], [160, 4, 0], group=4, window=window, dtype=q_dtype, kv_dtype=FP8, seed=70
    )
    check(case, atol=1e-4 if q_dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(
    "qlens,ctxs,window,group,head_dim,q_dtype",
    [
        ([1, 1, 1], [63, 64, 200], 0, 4, 32, torch.float32),  # decode: the cache only
        ([1, 9, 3], [160, 4, 0], 5, 4, 32, torch.bfloat16),  # mixed, window < chunk
        ([150], [0], 0, 1, 16, torch.float32),  # fresh-only tiles, masked and unmasked
        ([70, 2], [64, 130], 40, 8, 48, torch.float32),  # ctx on a tile edge, D padded
        ([100], [37], 0, 4, 32, torch.bfloat16),  # straddling tile then fresh-only ones
    ],
)
def test_triton_fp8_kv_fresh_new_tokens(qlens, ctxs, window, group, head_dim, q_dtype):
    """k_new/v_new: a prefill chunk's keys from the step's own K/V, its prefix from the fp8
    cache; decode tokens from the cache alone. Whatever must not be read holds NaN."""
    case = make_case(qlens, ctxs, group=group, head_dim=head_dim, window=window, dtype=q_dtype,
                     kv_dtype=FP8, seed=75, fresh=True)
    check(case, atol=1e-4 if q_dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize(
    "qlens,ctxs,window,group,q_dtype",
    [
        ([150], [0], 0, 1, torch.float32),  # one launch, fresh-only tiles
        ([40, 1, 9], [20, 30, 0], 5, 4, torch.bfloat16),  # mixed: the chunks' launch is fresh
        ([33, 1], [30, 31], 0, 4, torch.float32),  # straddling tiles, keys <= 2 x new tokens
    ],
)
def test_triton_fresh_new_tokens_model_dtype_cache(qlens, ctxs, window, group, q_dtype):
    """A cache in the model dtype: a launch of chunks whose new tokens are at least half the
    longest request's keys reads them from k_new/v_new (their cache slots hold NaN here), the
    decode tokens read the cache."""
    case = make_case(qlens, ctxs, group=group, window=window, dtype=q_dtype, seed=76,
                     fresh=True)
    check(case, atol=1e-4 if q_dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("num_splits", [4, 32])
def test_triton_fp8_kv_fresh_split(num_splits):
    case = make_case([1, 1, 2], [150, 3, 70], group=4, kv_dtype=FP8, seed=77, fresh=True)
    check(case, num_splits=num_splits)


# ---- split-KV (flash-decoding) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "num_splits,window,use_sinks",
    [(2, 0, False), (4, 0, True), (8, 7, False), (32, 0, True)],
)
def test_triton_split_kv_matches_unsplit(num_splits, window, use_sinks):
    # 32 splits over at most 3 key tiles: most splits are empty and must merge as zero
    case = make_case([1, 1, 2], [150, 3, 70], group=4, window=window, seed=80 + num_splits)
    sinks = torch.randn(case.q.shape[1], device=DEVICE) if use_sinks else None
    scale = 0.2
    split = case.run(scale=scale, sinks=sinks, num_splits=num_splits)
    whole = case.run(scale=scale, sinks=sinks, num_splits=1)
    ref = case.reference(scale, sinks=sinks)
    assert not split.isnan().any()
    assert (split - whole).abs().max().item() < 1e-5
    assert (split - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("use_sinks,window", [(False, 0), (True, 0), (False, 200)])
def test_triton_split_merge_in_kernel(use_sinks, window, monkeypatch):
    """SWASERVE_ATTN_MERGE=1: the last split of each (query block, KV head) merges the
    partials in the attention kernel: no `_reduce_splits` launch, the counters are back at zero
    afterwards (the next launch, a CUDA graph replay, relies on it), and the output equals the
    separate merge's (the default) and the reference, empty splits included."""
    case = make_case([1, 1, 1, 2], [700, 3, 300, 520], group=4, window=window, seed=71)
    sinks = torch.randn(case.q.shape[1], device=DEVICE) if use_sinks else None
    kernels = []
    real = pa._run
    monkeypatch.setattr(pa, "_run", lambda k, *a, **kw: (kernels.append(k), real(k, *a, **kw)))
    monkeypatch.setenv("SWASERVE_ATTN_MERGE", "1")
    fused = case.run(scale=0.2, sinks=sinks, num_splits=16)
    assert pa._reduce_splits not in kernels and pa._paged_attn_kernel in kernels
    assert not pa.merge_counters(DEVICE, 1).any()
    monkeypatch.delenv("SWASERVE_ATTN_MERGE")
    kernels.clear()
    separate = case.run(scale=0.2, sinks=sinks, num_splits=16)
    assert pa._reduce_splits in kernels
    ref = case.reference(0.2, sinks=sinks)
    assert not fused.isnan().any()
    assert (fused - separate).abs().max().item() < 1e-5
    assert (fused - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("cap,window,use_sinks", [(1, 0, True), (3, 0, False), (2, 7, True),
                                                   (64, 0, False)])
def test_triton_split_cap(cap, window, use_sinks, monkeypatch):
    """A CUDA graph's launch keeps its grid of 32 splits while `split_cap` says how many a
    block takes this replay: any cap equals the reference, and at cap 1 every block writes
    its output itself, bit-equal to the unsplit launch (the merge still runs and skips it)."""
    case = make_case([1, 1, 2], [150, 3, 70], group=4, window=window, seed=60 + cap)
    sinks = torch.randn(case.q.shape[1], device=DEVICE) if use_sinks else None
    kernels = []
    real = pa._run
    monkeypatch.setattr(pa, "_run", lambda k, *a, **kw: (kernels.append(k), real(k, *a, **kw)))
    capped = case.run(scale=0.2, sinks=sinks, num_splits=32,
                      split_cap=torch.tensor([cap], dtype=torch.int32, device=DEVICE))
    assert kernels == [pa._paged_attn_kernel, pa._reduce_splits]
    whole = case.run(scale=0.2, sinks=sinks, num_splits=1)
    ref = case.reference(0.2, sinks=sinks)
    assert not capped.isnan().any()
    assert (capped - ref).abs().max().item() < 1e-4
    if cap == 1:
        assert torch.equal(capped, whole)
    else:  # the first request's 151 keys (3 tiles) split, then merge: another rounding
        assert (capped - whole).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "qlens,ctxs,window,use_sinks,fresh",
    [
        ([1, 1, 40, 1], [600, 700, 10, 530], 0, False, False),  # decodes split, chunk whole
        ([1, 3, 1, 9, 2], [900, 620, 0, 30, 515], 0, True, False),  # short verify runs too
        ([1, 40, 1], [700, 5, 560], 300, False, False),  # windowed
        ([1, 1, 24], [600, 650, 100], 0, False, "fp8"),  # fp8, the chunk reads its own K/V
        ([1, 40, 1], [30, 0, 35], 0, True, "bf16"),  # bf16: the chunk's launch reads it fresh
        ([1, 40, 1], [2100, 2500, 300], 0, True, False),  # a chunk over a long context: split
        ([1, 30, 2], [2100, 2200, 3], 0, False, "fp8"),  # split, fresh fp8 chunk
    ],
)
def test_triton_mixed_batch_two_launches(qlens, ctxs, window, use_sinks, fresh, monkeypatch):
    """A batch of decode-sized runs beside longer ones: one launch per kind (the decodes with
    the decode tile and key splits), equal to one launch for all and to the reference."""
    dtype = torch.bfloat16 if fresh == "bf16" else torch.float32
    case = make_case(qlens, ctxs, group=4, head_dim=32, window=window, seed=90 + len(qlens),
                     dtype=dtype, kv_dtype=FP8 if fresh == "fp8" else dtype, fresh=bool(fresh))
    sinks = torch.randn(case.q.shape[1], device=DEVICE) if use_sinks else None
    launches = []
    real = pa._launch

    def spy(*args, **kw):
        launches.append((args[7].block_m, args[8], args[9]))  # cfg, num_splits, q_lens
        return real(*args, **kw)

    monkeypatch.setattr(pa, "_launch", spy)
    two = case.run(scale=0.2, sinks=sinks)
    assert [q for _, _, q in launches] == [(1, 4), (5, pa.ANY_Q_LEN)], launches
    assert launches[0][0] == 16 and launches[1][0] > 16
    # the chunk's launch splits its keys where its few blocks see a long context
    assert (launches[1][1] > 1) == (max(c + q for c, q in zip(ctxs, qlens)) > 2048), launches
    one = case.run(scale=0.2, sinks=sinks, min_query_len=None)
    assert len(launches) == 3
    ref = case.reference(0.2, sinks=sinks)
    assert not two.isnan().any()
    atol = 1e-4 if not fresh else 3e-2
    assert (two.float() - one.float()).abs().max().item() < (1e-5 if not fresh else 1e-2)
    assert (two.float() - ref).abs().max().item() < atol


def test_triton_split_kv_heuristic():
    # decode of one long request on 8 KV heads: split towards 4 programs per SM, capped
    assert choose_num_splits(1, 8, 1, 32768, block_q=4, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(4, 8, 1, 16384, block_q=4, num_sms=132) == 32
    # enough programs already: no split
    assert choose_num_splits(256, 8, 1, 32768, block_q=4, num_sms=132) == 1
    # short contexts (or a small window) never split
    assert choose_num_splits(1, 2, 1, 300, block_q=4, num_sms=132) == 1
    # each split keeps >= 256 keys; the result is a power of two
    assert choose_num_splits(4, 8, 1, 1500, block_q=4, num_sms=132) == 4
    # prefill blocks are never split
    assert choose_num_splits(1, 2, 64, 32768, block_q=16, num_sms=132) == 1
    # two or more programs per SM: split only to even out the last round of programs, into
    # splits of >= 1,024 keys (H200, benchmarks/decode_splits.py): Gemma-3-27B at batch 17
    # (272 programs, 0.69 of the slots busy) goes to 4 over 9k keys, not at all over its
    # 1,024-key window; Llama-8B at batch 64 (512 programs, 0.97) does not split
    assert choose_num_splits(17, 16, 1, 9216, block_q=1, num_sms=132) == 4
    assert choose_num_splits(17, 16, 1, 1024, block_q=1, num_sms=132) == 1
    assert choose_num_splits(64, 8, 1, 4096, block_q=1, num_sms=132) == 1
    assert choose_num_splits(48, 16, 1, 1024, block_q=1, num_sms=132) == 1


def test_triton_graph_split_rule():
    """The splits of decode graphs (swaserve/engine/cuda_graph.py): a bucket's grid holds the
    most any of its batch sizes wants at the longest context, and a replay asks for what its
    real batch wants (Gemma-3-27B: 17 requests replay the 32 bucket, whose own size would not
    split its full layers; with few programs a replay keeps the longest context's count, so
    batch-1 decode walks one tile per split)."""
    from swaserve.engine.cuda_graph import SplitRule

    gemma = SplitRule(16, 1, block_q=1, num_sms=132, windows=[1024, None], longest=131072)
    assert gemma.grid(range(17, 33)) == [1, 4]
    assert gemma(17, 9216) == [1, 4] and gemma(32, 9216) == [1, 1]
    assert gemma(17, 600) == [1, 1]  # 272 programs: the real context decides
    assert gemma(4, 600) == gemma(4, 131072) == [4, 16]  # 64 programs: the longest does
    llama = SplitRule(8, 1, block_q=4, num_sms=132, windows=[None], longest=131072)
    assert llama.grid(range(1, 2)) == llama(1, 256) == [MAX_SPLITS]
    verify = SplitRule(8, 8, block_q=4, num_sms=132, windows=[None], longest=131072)
    assert verify(1, 32768) == [1]  # 8 queries: more than one query block, never split


def test_triton_attention_config():
    dec = attention_config(128, 4, 1)
    assert (dec.block_m, dec.block_q, dec.block_n) == (16, 4, 64)
    pre = attention_config(128, 4, 2048)
    assert (pre.block_m, pre.block_q, pre.block_n) == (128, 32, 64)
    big = attention_config(256, 2, 2048)
    assert (big.block_m, big.block_n, big.num_warps) == (128, 64, 8)
    wide = attention_config(64, 32, 1)  # more heads per KV head than 16 rows
    assert (wide.block_m, wide.block_q) == (32, 1)


# ---- store and copy ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, FP8])
def test_triton_store_kv(kv_dtype):
    gen = torch.Generator().manual_seed(90)
    t, hkv, d, ps, pages = 7, 2, 32, 4, 6
    k = (torch.randn(t, hkv, d, generator=gen) * 3).to(DEVICE)
    v = (torch.randn(t, hkv, d, generator=gen) * 3).to(DEVICE)
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 1e-5, 0.0])  # saturation and subnormals
    if kv_dtype != FP8:
        # the model's K/V come in the cache dtype (the interpreter truncates fp32 -> bf16)
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    slots = torch.tensor([5, 0 * ps + 1, 23, 12, -1, 8, 22], device=DEVICE)  # -1: skipped
    kc = torch.zeros(pages, ps, hkv, d, device=DEVICE).to(kv_dtype)
    vc = torch.zeros_like(kc)
    k_scale, v_scale = (0.05, 0.02) if kv_dtype == FP8 else (1.0, 1.0)
    store_kv(k, v, kc, vc, slots, k_scale, v_scale)

    def want(x: torch.Tensor, scale: float) -> torch.Tensor:
        if kv_dtype == FP8:
            return (x.float() / scale).clamp(-448, 448).to(FP8)
        return x.to(kv_dtype)

    keep = slots >= 0
    for cache, x, scale in ((kc, k, k_scale), (vc, v, v_scale)):
        flat = cache.view(-1, hkv, d)
        exp = torch.zeros_like(flat)
        exp[slots[keep]] = want(x[keep], scale)
        assert torch.equal(flat.view(torch.uint8), exp.view(torch.uint8))


def test_triton_fp8_rounding_exhaustive():
    # every e4m3 value, the midpoints between neighbours (ties to even) and points near them
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = codes[~codes.isnan()].unique().sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), vals * 1.01, vals * 0.99])
    x = x.clamp(-448, 448)
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 256))  # 256 values per token: [2, 128]
    n = x.numel() // 256
    k = x.view(n, 2, 128)
    kc = torch.zeros(n, 1, 2, 128).to(FP8)
    vc = torch.zeros_like(kc)
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    store_kv(k.to(DEVICE), k.to(DEVICE), kc, vc, torch.arange(n).to(DEVICE))
    got = kc.cpu().reshape(-1).view(torch.uint8)
    exp = x.to(FP8).view(torch.uint8)
    assert torch.equal(got, exp), x[got != exp][:8]


# ---- backend -----------------------------------------------------------------------------------


def test_triton_backend_prepare_matches_slot_mapping():
    from swaserve.attention.triton_backend import TritonBackend
    from swaserve.memory.groups import build_layout

    layout = build_layout([3, None])  # one swa and one full group
    assert layout.num_groups == 2
    backend = TritonBackend(layout, page_size=4, device=DEVICE)
    inputs = AttentionInputs(
        query_lens=[3, 1, 6],
        context_lens=[5, 9, 0],
        page_tables=[[[0, 4, 7], [1, 2, 3]], [[0, 0, 8], [5, 6, 9]], [[10, 11], [12, 13]]],
    )
    meta = backend.prepare(inputs)
    assert meta.query_start_loc.tolist() == [0, 3, 4, 10]
    assert meta.seq_lens.tolist() == [8, 10, 6]
    assert meta.context_lens.tolist() == [5, 9, 0]
    assert (meta.max_query_len, meta.max_seq_len, meta.decode_only) == (6, 10, False)
    for g, gm in enumerate(meta.groups):
        want = torch.cat(
            [slot_mapping(pt[g], c, c + n, 4) for pt, c, n in
             zip(inputs.page_tables, inputs.context_lens, inputs.query_lens)]
        )
        assert gm.slot_mapping.cpu().tolist() == want.tolist()
        assert gm.block_table.dtype == torch.int32
        assert gm.block_table.shape == (3, 3)
        assert gm.block_table[2, 2].item() == NULL  # padding is the NULL page


# ---- engine: triton == torch on tiny random HF models ------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from tests.helpers import save_random_hf_model
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
    )
    configs = {
        "llama": transformers.LlamaConfig(**common, num_hidden_layers=2),
        "gemma3": transformers.Gemma3TextConfig(
            **common, num_hidden_layers=3, sliding_window=5, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            attn_logit_softcapping=5.0,
        ),
    }
    out = {}
    for name, cfg in configs.items():
        folder = tmp_path_factory.mktemp(name)
        save_random_hf_model(cfg, folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_triton_engine_logits_match_torch(tiny_models, name):
    from swaserve import Engine
    from tests.helpers import engine_prompt_logits

    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = {}
    for backend in ("torch", "triton"):
        engine = Engine(
            model=str(tiny_models[name]), device=DEVICE.type, dtype="float32", page_size=4,
            max_num_batched_tokens=7, kv_cache_gb=0.01, attention_backend=backend,
        )
        logits[backend] = engine_prompt_logits(engine, ids)
        # and a few decode steps through the same path
        out = engine.generate(prompt_token_ids=[ids[:9]], sampling_params=_greedy(6))
        logits[backend + "_gen"] = out[0].token_ids
        engine.core.memory.check_integrity()
    err = (logits["torch"] - logits["triton"]).abs().max().item()
    assert err < 1e-3, f"{name}: max |logit diff| {err}"
    assert logits["torch_gen"] == logits["triton_gen"]


@pytest.mark.parametrize("name", ["gemma3"])
def test_triton_engine_fp8_kv_matches_torch_fp8(tiny_models, name):
    """FP8 KV through the whole engine: calibrated per-layer scales, quantise on store,
    dequantise in the kernel; the torch reference reads the same stored fp8 values."""
    from swaserve import Engine, SamplingParams
    from tests.helpers import engine_prompt_logits

    ids = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, scales = {}, {}
    for backend in ("torch", "triton"):
        engine = Engine(
            model=str(tiny_models[name]), device=DEVICE.type, dtype="float32", page_size=4,
            max_num_batched_tokens=7, kv_cache_gb=0.01, attention_backend=backend,
            kv_cache_dtype="fp8_e4m3",
        )
        assert engine.core.kv.kv.dtype == torch.float8_e4m3fn
        scales[backend] = engine.core.kv.k_scales
        logits[backend] = engine_prompt_logits(engine, ids)
        # decode steps (own key from the cache) mixed with a second prompt's chunks (own keys
        # fresh): the same tokens and logprobs from both backends
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
        outs = engine.generate(prompt_token_ids=[ids[:9], ids[3:23]], sampling_params=params)
        logits[backend + "_gen"] = [o.outputs[0].token_ids for o in outs]
        logits[backend + "_lp"] = torch.tensor(
            [lp.logprob for o in outs for lp in o.outputs[0].logprobs]
        )
        engine.core.memory.check_integrity()
    assert scales["torch"] == scales["triton"] and all(s > 0 for s in scales["torch"])
    err = (logits["torch"] - logits["triton"]).abs().max().item()
    assert err < 1e-3, f"{name}: fp8 max |logit diff| {err}"
    assert logits["torch_gen"] == logits["triton_gen"]
    assert (logits["torch_lp"] - logits["triton_lp"]).abs().max().item() < 1e-3


def _greedy(n: int):
    from swaserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0)
