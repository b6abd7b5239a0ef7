"""GPU run: Triton paged attention against the torch reference, then timings.

Order: correctness first (kernel vs dense reference on random paged inputs, bf16 and fp8 KV),
then the copy-bandwidth ceiling, then kernel timings with torch SDPA as the peer on the same
shapes. Prints a table last. Usage (on the GPU machine): python benchmarks/attention_kernels.py

`--merge` runs only the split-merge part: the in-kernel merge (the last split merges) against
the separate `_reduce_splits` launch (the default) on the same inputs, 200 launches of
each back to back so that a missing release/acquire would show as a mismatch, then both timed
in CUDA graphs at batch 1 and 8.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton

from swaserve.attention.kernels.paged_attention import paged_attention
from swaserve.attention.torch_backend import attend

dev = torch.device("cuda")
PS = 16
rows: list[str] = []


def paged_inputs(qlens, ctxs, h, hkv, d, dtype=torch.bfloat16, kv_dtype=None, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    seq = [q + c for q, c in zip(qlens, ctxs)]
    npg = [math.ceil(s / PS) for s in seq]
    total = sum(npg) + 1
    perm = (torch.randperm(total - 1, device=dev, generator=g) + 1).tolist()
    tables, i = [], 0
    for n in npg:
        tables.append(perm[i : i + n])
        i += n
    w = max(npg)
    bt = torch.tensor([t + [0] * (w - len(t)) for t in tables], dtype=torch.int32, device=dev)
    kc = torch.randn(total, PS, hkv, d, device=dev, generator=g).to(kv_dtype)
    vc = torch.randn(total, PS, hkv, d, device=dev, generator=g).to(kv_dtype)
    q = torch.randn(sum(qlens), h, d, device=dev, dtype=dtype, generator=g)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    sl = torch.tensor(seq, dtype=torch.int32, device=dev)
    return q, kc, vc, bt, qsl, sl, tables


def check(name, qlens, ctxs, h=32, hkv=8, d=128, window=0, kv_dtype=None, softcap=0.0):
    q, kc, vc, bt, qsl, sl, tables = paged_inputs(qlens, ctxs, h, hkv, d, kv_dtype=kv_dtype)
    out = paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=max(qlens),
                          max_seq_len=int(max(q + c for q, c in zip(qlens, ctxs))),
                          scale=d**-0.5, window=window, softcap=softcap)
    err = 0.0
    s = 0
    for r, (n, c) in enumerate(zip(qlens, ctxs)):
        pages = torch.tensor(tables[r], device=dev)
        k = kc[pages].reshape(-1, hkv, d)[: c + n].float()
        v = vc[pages].reshape(-1, hkv, d)[: c + n].float()
        qpos = torch.arange(c, c + n, device=dev)[:, None]
        kpos = torch.arange(0, c + n, device=dev)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        ref = attend(q[s : s + n].float(), k, v, mask, d**-0.5, softcap or None)
        err = max(err, (out[s : s + n].float() - ref).abs().max().item())
        s += n
    ok = err < 2e-2
    rows.append(f"check {name:40s} max_err={err:.2e} {'OK' if ok else 'FAIL'}")
    return ok


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() / ms / 1e6  # GB/s, bytes read + written


def decode_bench(b, ctx, kv_dtype, bw):
    h, hkv, d = 32, 8, 128
    q, kc, vc, bt, qsl, sl, _ = paged_inputs([1] * b, [ctx - 1] * b, h, hkv, d, kv_dtype=kv_dtype)
    f = lambda: paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=1, max_seq_len=ctx,
                                scale=d**-0.5)
    f()
    ms = triton.testing.do_bench(f, warmup=10, rep=50)
    kv_bytes = 2 * b * ctx * hkv * d * kc.element_size()
    gbs = kv_bytes / ms / 1e6
    # Peer: torch SDPA on the same amount of (contiguous, bf16) KV.
    qq = torch.randn(b, h, 1, d, device=dev, dtype=torch.bfloat16)
    kk = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
    vv = torch.randn_like(kk)
    g = lambda: F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
    g()
    ms2 = triton.testing.do_bench(g, warmup=10, rep=50)
    sd = 2 * b * ctx * hkv * d * 2 / ms2 / 1e6
    rows.append(
        f"decode B={b:3d} ctx={ctx:6d} kv={str(kv_dtype).split('.')[-1]:14s} "
        f"{ms * 1e3:8.1f} us {gbs:7.0f} GB/s = {gbs / bw:5.1%} of copy | "
        f"sdpa bf16 {ms2 * 1e3:8.1f} us {sd:7.0f} GB/s = {sd / bw:5.1%}"
    )


def _decode_call(b, ctx, splits, seed=0):
    h, hkv, d = 32, 8, 128
    q, kc, vc, bt, qsl, sl, _ = paged_inputs([1] * b, [ctx - 1] * b, h, hkv, d, seed=seed)
    out = torch.empty_like(q)
    return lambda: paged_attention(q, kc, vc, bt, qsl, sl, max_query_len=1, max_seq_len=ctx,
                                   scale=d**-0.5, num_splits=splits, out=out)


def _with_merge(in_kernel: bool, f):
    os.environ["SWASERVE_ATTN_MERGE"] = "1" if in_kernel else "0"
    try:
        return f()
    finally:
        os.environ.pop("SWASERVE_ATTN_MERGE")


def merge_check() -> bool:
    ok = True
    for b, ctx, splits in ((1, 130, 64), (1, 8192, 64), (4, 30000, 64), (64, 4096, 8)):
        f = _decode_call(b, ctx, splits, seed=b)
        want = _with_merge(False, lambda f=f: f().clone())
        outs = _with_merge(True, lambda f=f: [f().clone() for _ in range(200)])
        err = max((o.float() - want.float()).abs().max().item() for o in outs)
        bad = sum(not torch.equal(o, outs[0]) for o in outs)
        good = err < 1e-2 and bad == 0
        ok &= good
        rows.append(f"merge check B={b} ctx={ctx} splits={splits}: max|in-kernel - separate| "
                    f"{err:.1e}, launches unlike the first {bad}/200 {'OK' if good else 'FAIL'}")
    for b, ctx in ((1, 130), (1, 4096), (8, 4096)):
        f = _decode_call(b, ctx, 64)
        for in_kernel in (False, True, False, True):
            f_ = functools.partial(_with_merge, in_kernel, f)
            f_()
            us = triton.testing.do_bench_cudagraph(f_, rep=200) * 1e3  # captures f_ itself
            rows.append(f"decode B={b} ctx={ctx} 64 splits, merge "
                        f"{'in kernel' if in_kernel else 'separate '}: {us:6.2f} us")
    return ok


def main() -> int:
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    if "--merge" in sys.argv:
        ok = merge_check()
        print("\n".join(rows))
        return 0 if ok else 1
    ok = True
    ok &= check("prefill 2x300 causal", [300, 300], [0, 0])
    ok &= check("chunk 128 over 1000 cached + decodes", [128, 1, 1], [1000, 513, 77])
    ok &= check("window 100, mixed", [200, 1, 1], [300, 700, 50], window=100)
    ok &= check("GQA 8, d=256, softcap", [64, 1], [100, 900], h=8, hkv=1, d=256, softcap=30.0)
    ok &= check("fp8 kv decode", [1] * 4, [2000] * 4, kv_dtype=torch.float8_e4m3fn)
    bw = copy_bandwidth()
    rows.append(f"copy bandwidth (read+write) {bw:.0f} GB/s")
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for ctx in (4096, 32768):
            decode_bench(64, ctx, kv_dtype, bw)
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
