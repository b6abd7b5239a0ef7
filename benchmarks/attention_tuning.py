"""Paged attention tiles on the GPU: prefill against torch SDPA on the same shapes, decode and
mixed batches against the copy ceiling (issue 14: the prefill bar and the kernel's share of a
mixed step).

Each variant (tile config, the new tokens' K/V passed fresh as the step holds them or read
from the cache, a mixed batch in one launch or two) is first compared with the default
launch reading the cache on the timed inputs (max |diff| < 2e-2; it is not timed otherwise),
then timed (`triton.testing.do_bench`, median). Peers: torch SDPA with the FLASH_ATTENTION backend
(FlashAttention 2 in torch) and with CUDNN_ATTENTION (SDPA's own choice on the H200) on the
same shapes, where SDPA has the mask (no windows, equal lengths). `--sweep` times every
candidate tile on the first shape of each kind. Prints a table last; JSON lines to
$OUT/attention_tuning.jsonl.

Usage (GPU machine, repo root):
  python3 benchmarks/attention_tuning.py [--only prefill|decode|mixed] [--sweep]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from swaserve.attention.kernels.paged_attention import (  # noqa: E402
    AttentionConfig,
    attention_config,
    paged_attention,
)

dev = torch.device("cuda")
PS = 16
OUT = Path(os.environ.get("OUT", "bench_out"))
results: list[dict] = []

# prefill tiles for --sweep: (block_m, block_n, num_warps, num_stages); block_q = block_m / G
PREFILL = [
    (128, 64, 8, 2),  # the default
    (128, 64, 8, 3),
    (128, 64, 8, 5),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 32, 8, 2),
    (128, 32, 8, 5),
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (64, 64, 4, 5),
    (64, 32, 4, 2),
    (64, 32, 4, 5),
    (64, 64, 8, 2),
    (64, 128, 8, 2),
]
PREFILL_SHORT = [(128, 128, 8, 3), (64, 64, 4, 2)]  # the sweep's best (2026-12-02, H200)
# decode tiles (block_m stays the decode tile's): (block_n, num_warps, num_stages)
DECODE = [
    (64, 4, 2),  # the default
    (32, 2, 2),
    (32, 4, 2),
    (64, 2, 2),
    (64, 4, 3),
    (64, 4, 4),
    (64, 8, 2),
    (128, 4, 2),
    (128, 4, 3),
    (128, 8, 2),
    (256, 4, 2),
    (256, 8, 2),
]
DECODE_SHORT = [(128, 4, 3)]


def paged_inputs(qlens, ctxs, h, hkv, d, seed=0):
    """Random paged K/V (pages shuffled) for requests of qlens new tokens over ctxs cached,
    and the new tokens' K/V rows `[T, Hkv, D]` as the step holds them (the fresh reads)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    seq = [q + c for q, c in zip(qlens, ctxs)]
    npg = [math.ceil(s / PS) for s in seq]
    total = sum(npg) + 1
    perm = (torch.randperm(total - 1, device=dev, generator=g) + 1).int()
    bt = torch.zeros(len(seq), max(npg), dtype=torch.int32, device=dev)
    i = 0
    for r, n in enumerate(npg):
        bt[r, :n] = perm[i : i + n]
        i += n
    kc = torch.randn(total, PS, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
    vc = torch.randn(total, PS, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
    q = torch.randn(sum(qlens), h, d, device=dev, dtype=torch.bfloat16, generator=g)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev)
    sl = torch.tensor(seq, dtype=torch.int32, device=dev)
    ks, vs = [], []
    for r, (n, c) in enumerate(zip(qlens, ctxs)):
        pos = torch.arange(c, c + n, device=dev)
        pages = bt[r, pos // PS].long()
        ks.append(kc[pages, pos % PS])
        vs.append(vc[pages, pos % PS])
    args = dict(q=q, k_cache=kc, v_cache=vc, block_table=bt, query_start_loc=qsl, seq_lens=sl,
                max_query_len=max(qlens), max_seq_len=max(seq), scale=d**-0.5,
                min_query_len=min(qlens))
    return args, torch.cat(ks).contiguous(), torch.cat(vs).contiguous()


def attn_flops(qlens, ctxs, h, d, window):
    """4 H D x (keys each query sees): the two dots of attention, as FlashAttention counts."""
    keys = 0
    for n, c in zip(qlens, ctxs):
        seen = torch.arange(c, c + n, dtype=torch.float64) + 1
        if window:
            seen = seen.clamp(max=window)
        keys += seen.sum().item()
    return 4 * h * d * keys


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=40)  # ms


def config_of(c: tuple, group: int) -> AttentionConfig:
    """A prefill tile (4 fields) or a decode one (3 fields, the decode tile's rows)."""
    if len(c) == 4:
        bm, bn, nw, ns = c
        return AttentionConfig(bm, bm // triton.next_power_of_2(group), bn, nw, ns)
    bn, nw, ns = c
    base = attention_config(128, group, 1)
    return AttentionConfig(base.block_m, base.block_q, bn, nw, ns)


def sdpa_peer(qlens, ctxs, h, hkv, d, window, backend):
    """torch SDPA on the same shapes (contiguous bf16), or None where it has no such mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    if window or len(set(qlens)) != 1 or len(set(ctxs)) != 1:
        return None
    b, n, c = len(qlens), qlens[0], ctxs[0]
    q = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n + c, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if backend == "flash":  # GQA by expanded heads (the same FLOPs)
        k = k.repeat_interleave(h // hkv, 1)
        v = v.repeat_interleave(h // hkv, 1)
    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    kw = dict(is_causal=True) if c == 0 else dict(attn_mask=causal_lower_right(n, n + c))
    if backend == "cudnn":
        kw["enable_gqa"] = True

    def run():
        with sdpa_kernel([be]):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    try:
        return bench(run)
    except Exception as e:  # noqa: BLE001 - reported
        print(f"  sdpa {backend}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def variants(kind: str, group: int, sweep: bool) -> list[tuple[str, dict]]:
    """(label, paged_attention keywords) to time; "fresh" passes the new tokens' K/V rows as
    TritonBackend does for steps with chunks (paged_attention reads them where that pays)."""
    out = []
    if kind == "prefill":
        out += [("paged default", {}), ("fresh default", {"fresh": True})]
        for c in PREFILL_SHORT:
            out.append(("fresh " + "/".join(map(str, c)), {"config": c, "fresh": True}))
        for c in PREFILL[1:] if sweep else PREFILL_SHORT:
            out.append(("paged " + "/".join(map(str, c)), {"config": c}))
    elif kind == "decode":
        out.append(("default", {}))
        for c in DECODE[1:] if sweep else DECODE_SHORT:
            out.append(("/".join(map(str, c)), {"config": c}))
    else:  # mixed: two launches (one per tile kind), or one with the prefill tile
        out += [
            ("fresh, two launches", {"fresh": True}),
            ("paged, two launches", {}),
            ("paged, one launch (prefill tile)", {"config": PREFILL[0]}),
        ]
    return out


def run_family(kind, name, qlens, ctxs, h, hkv, d, window, bw, sweep=False):
    group = h // hkv
    x, k_new, v_new = paged_inputs(qlens, ctxs, h, hkv, d)
    base = paged_attention(**x, window=window)  # the default config and launches, cache reads
    flops = attn_flops(qlens, ctxs, h, d, window)
    kv_bytes = sum(min(c + n, window or 1 << 30) for n, c in zip(qlens, ctxs)) * hkv * d * 4
    if kind == "prefill":
        for be in ("flash", "cudnn"):
            ms = sdpa_peer(qlens, ctxs, h, hkv, d, window, be)
            if ms is not None:
                r = dict(kind=kind, shape=name, config=f"sdpa-{be}", ms=ms,
                         tflops=flops / ms / 1e9)
                results.append(r)
                print(json.dumps(r), flush=True)
    for lab, kw in variants(kind, group, sweep):
        args = dict(x, window=window)
        if "config" in kw:
            args.update(config=config_of(kw["config"], group), min_query_len=None)
        if kw.get("fresh"):
            args.update(k_new=k_new, v_new=v_new)
        run = functools.partial(paged_attention, **args)
        try:
            out = run()
            err = (out.float() - base.float()).abs().max().item()
            ok = err < 2e-2 and not out.isnan().any().item()
            ms = bench(run) if ok else float("nan")
        except Exception as e:  # noqa: BLE001 - reported, not timed
            err, ok, ms = f"{type(e).__name__}: {str(e)[:120]}", False, float("nan")
        r = dict(kind=kind, shape=name, config=lab, ok=ok, err=err, ms=ms,
                 tflops=flops / ms / 1e9, tbs=kv_bytes / ms / 1e9,
                 of_copy=kv_bytes / ms / 1e6 / bw)
        results.append(r)
        print(json.dumps(r), flush=True)


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() / ms / 1e6  # GB/s, bytes read + written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["prefill", "decode", "mixed"], default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="every candidate tile on the first shape of each kind")
    args = ap.parse_args()
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    fams = []
    if args.only in (None, "prefill"):
        fams += [
            ("prefill", "llama 1x8k", [8192], [0], 32, 8, 128, 0),
            ("prefill", "llama 4x2k", [2048] * 4, [0] * 4, 32, 8, 128, 0),
            ("prefill", "llama 2k over 6k", [2048], [6144], 32, 8, 128, 0),
            ("prefill", "gemma27b 8k full", [8192], [0], 32, 16, 128, 0),
            ("prefill", "gemma27b 8k w1024", [8192], [0], 32, 16, 128, 1024),
            ("prefill", "d256 8k H8/Hkv4", [8192], [0], 8, 4, 256, 0),
        ]
    ctx256 = torch.randint(100, 1900, (256,), generator=gen).tolist()
    ctx512 = torch.randint(100, 1900, (512,), generator=gen).tolist()
    if args.only in (None, "decode"):
        fams += [
            ("decode", "llama B256 ctx U[100,1900]", [1] * 256, ctx256, 32, 8, 128, 0),
            ("decode", "llama B512 ctx U[100,1900]", [1] * 512, ctx512, 32, 8, 128, 0),
            ("decode", "llama B64 ctx 4096", [1] * 64, [4095] * 64, 32, 8, 128, 0),
            ("decode", "gemma27b B48 ctx 8k full", [1] * 48, [8191] * 48, 32, 16, 128, 0),
            ("decode", "gemma27b B48 ctx 8k w1024", [1] * 48, [8191] * 48, 32, 16, 128, 1024),
        ]
    if args.only in (None, "mixed"):
        # one prefill chunk beside 255 or 511 decodes (the offline run's mixed steps)
        fams += [
            ("mixed", "llama 1024 chunk + 255 decodes", [1024] + [1] * 255, [0] + ctx256[:255],
             32, 8, 128, 0),
            ("mixed", "llama 256 chunk over 512 + 511 decodes", [256] + [1] * 511,
             [512] + ctx512[:511], 32, 8, 128, 0),
            ("mixed", "gemma27b 2048 chunk + 47 decodes w1024", [2048] + [1] * 47,
             [0] + [8191] * 47, 32, 16, 128, 1024),
        ]
    for i, fam in enumerate(fams):
        sweep = args.sweep and (i == 0 or fam[0] != fams[i - 1][0])  # first of each kind
        run_family(*fam, bw, sweep=sweep)
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    with open(OUT / "attention_tuning.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print("\n| kind | shape | config | ms | TFLOP/s | KV TB/s | of copy |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("ok", True) is False:
            print(f"| {r['kind']} | {r['shape']} | {r['config']} | FAIL {r['err']} | | | |")
            continue
        print(f"| {r['kind']} | {r['shape']} | {r['config']} | {r['ms']:.3f} | "
              f"{r.get('tflops', 0):.0f} | {r.get('tbs', 0):.2f} | {r.get('of_copy', 0):.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
