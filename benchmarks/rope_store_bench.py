"""GPU run: the fused q/k norm + rotary + K/V store launch (swaserve/attention/kernels/
rope_store.py) on the big models' head shapes, at decode, mixed and prefill token counts.

Each case is first checked against the eager blocks (RMSNorm, Rotary; max abs difference of q
and k, and whether the cache holds the kernel's k and v bit for bit), then timed with CUDA
events around `--iters` launches back to back after a warm-up (the mean). GB/s counts the bytes
the launch must move: q and k read and written, v read, k and v written to the cache.
Prints one table.

Usage: python3 benchmarks/rope_store_bench.py [--iters 50] [--tokens 1 174 924 16384]
"""

from __future__ import annotations

import argparse

import torch

from swaserve.attention.kernels.rope_store import QKPrologue, qk_rope_store
from swaserve.models.blocks import RMSNorm, Rotary

# name: (q heads, kv heads, head dim, q/k norm: None, "llama" (weight) or "gemma" (1 + w))
SHAPES = {
    "llama-3.1-8b": (32, 8, 128, None),
    "qwen3-8b": (32, 8, 128, "llama"),
    "gemma-3-27b": (32, 16, 128, "gemma"),
}
PAGE = 16


def _norm(d: int, kind: str | None, seed: int) -> RMSNorm | None:
    if kind is None:
        return None
    norm = RMSNorm(d, 1e-6, kind == "gemma")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = torch.randn(d, generator=gen) * 0.5
        norm.weight.copy_(w if kind == "gemma" else w + 1)
    return norm.to("cuda", torch.bfloat16)


def case(name: str, t: int, iters: int) -> dict:
    hq, hk, d, kind = SHAPES[name]
    gen = torch.Generator().manual_seed(t)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=gen) * 2).to("cuda", torch.bfloat16)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    positions = torch.randint(0, 8192, (t,), generator=gen).cuda()
    rotary = Rotary(1.0 / (500000.0 ** (torch.arange(0, d, 2).float() / d)))
    rotary.restore_buffers(torch.device("cuda"))
    qn, kn = _norm(d, kind, 1), _norm(d, kind, 2)
    pages = (t + PAGE - 1) // PAGE + 1
    k_cache = torch.zeros(pages, PAGE, hk, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(pages * PAGE, generator=gen)[:t].cuda()
    prologue = QKPrologue(rotary, qn, kn)

    want_q, want_k = q.clone(), k.clone()
    if qn is not None:
        want_q, want_k = qn(want_q), kn(want_k)
    want_q, want_k = rotary(positions, want_q, want_k)
    qk_rope_store(positions, q, k, v, prologue, k_cache, v_cache, slots)
    err = max((q - want_q).abs().max().item(), (k - want_k).abs().max().item())
    flat_k, flat_v = k_cache.view(-1, hk, d), v_cache.view(-1, hk, d)
    stored = torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)

    for _ in range(5):  # warm-up (q and k keep turning in place: the bytes are the same)
        qk_rope_store(positions, q, k, v, prologue, k_cache, v_cache, slots)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):  # back to back: a single launch's events would time the host too
        qk_rope_store(positions, q, k, v, prologue, k_cache, v_cache, slots)
    b.record()
    b.synchronize()
    us = a.elapsed_time(b) * 1e3 / iters
    moved = t * d * 2 * (2 * hq + 2 * hk + hk + 2 * hk)  # bf16: q, k r/w; v r; k, v to cache
    return {
        "shape": name,
        "tokens": t,
        "us": us,
        "gb_s": moved / us / 1e3,
        "err": err,
        "stored": stored,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 174, 924, 16384])
    args = ap.parse_args()
    rows = [case(name, t, args.iters) for name in SHAPES for t in args.tokens]
    print(f"{'shape':14} {'tokens':>7} {'us':>9} {'GB/s':>7} {'max err':>8} cache")
    for r in rows:
        print(
            f"{r['shape']:14} {r['tokens']:7d} {r['us']:9.1f} {r['gb_s']:7.0f} "
            f"{r['err']:8.4f} {'exact' if r['stored'] else 'DIFFERS'}"
        )


if __name__ == "__main__":
    main()
