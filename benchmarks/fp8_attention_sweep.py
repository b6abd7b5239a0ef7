"""FP8-KV decode attention: tile/dtype candidates, correctness first, then timings.

GPU (one call, repo root):   python benchmarks/fp8_attention_sweep.py
CPU (interpreter, tiny shapes, correctness only):   python benchmarks/fp8_attention_sweep.py --tiny

Order on the GPU: every candidate `AttentionConfig` is checked against the dense torch
reference on a ragged decode batch over a poisoned fp8 cache (NaN outside the visible keys,
k/v scales 0.05/0.02), at the timed shape and split count; the default configs also on mixed
prefill + decode batches (fp8 and bf16, with and without a window). Then the copy bandwidth
(as in benchmarks/attention_kernels.py), then decode B=64, H32/Hkv8, D128, page 16 at 4k and
32k keys for the bf16 cache (default config) and for every fp8 candidate. A candidate that
fails its check is not timed. Timings: `triton.testing.do_bench` (CUDA events, median, after
a warm-up call that compiles). Prints a markdown table last; writes JSON to --out (default
$OUT, else ./bench_out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

TINY = "--tiny" in sys.argv
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere
else:
    os.environ["SWASERVE_TEST_TRITON_CUDA"] = "1"  # the test helpers then build on CUDA

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402

from swaserve.attention.kernels.paged_attention import (  # noqa: E402
    FP8,
    AttentionConfig,
    _paged_attn_kernel,
    attention_config,
    choose_num_splits,
    paged_attention,
)
from tests.kernels.test_triton_attention import make_case  # noqa: E402

H, HKV, D, PS = 32, 8, 128, 16  # the timed shape (Llama-3.1-8B attention)
G = H // HKV

# (label, block_n, num_warps, num_stages, fp8_fp16_dot, fp8_v_cvt_regs) for decode blocks
# (block_m = 16 rows = 4 queries x 4 heads). "bf16dot" is the fp8 path before fp16 dots;
# "f16" converts V after its shared-memory staging (Triton's `.to`), "f16v" before it.
CANDIDATES = [
    ("bf16dot 64/4/2", 64, 4, 2, False, False),
    ("f16 64/4/2", 64, 4, 2, True, False),
    ("f16v 64/4/2", 64, 4, 2, True, True),
    ("f16v 64/4/3", 64, 4, 3, True, True),
    ("f16v 64/4/5", 64, 4, 5, True, True),
    ("f16v 64/8/2", 64, 8, 2, True, True),
    ("f16v 64/8/5", 64, 8, 5, True, True),
    ("f16v 128/4/2", 128, 4, 2, True, True),
    ("f16v 128/4/5", 128, 4, 5, True, True),
    ("f16v 128/8/2", 128, 8, 2, True, True),
    ("f16v 128/8/5", 128, 8, 5, True, True),
]
# bf16 outputs of O(1) values against the fp32 reference on the dequantised K/V: bf16 rounding
# is 2^-9 relative; a wrong kernel (keys or dims out of order) is off by O(1)
ATOL, RTOL = 1e-2, 1e-2


def decode_config(block_n, num_warps, num_stages, fp16_dot, v_regs, group=G) -> AttentionConfig:
    base = attention_config(D, group, 1)  # decode rows: block_m / block_q
    return AttentionConfig(
        base.block_m, base.block_q, block_n, num_warps, num_stages, fp16_dot, v_regs
    )


def max_err(case, **kw) -> tuple[float, bool]:
    """Kernel vs `Case.reference` (tests/kernels): max |err| and whether every element is
    within ATOL + RTOL |ref| (bf16 outputs); a NaN (a read of poisoned storage) fails."""
    scale = case.q.shape[-1] ** -0.5
    out = case.run(scale=scale, **kw).float()
    ref = case.reference(scale)
    if out.isnan().any():
        return float("inf"), False
    err = (out - ref).abs()
    return err.max().item(), bool((err <= ATOL + RTOL * ref.abs()).all())


def _compiled() -> set:
    """The compiled `_paged_attn_kernel`s so far (best effort: Triton 3.x internals; empty under
    the interpreter)."""
    try:
        return {k for c in _paged_attn_kernel.device_caches.values() for k in c[0].values()}
    except Exception:
        return set()


def _kernel_info(kernels: set) -> dict:
    """Registers, spills and shared memory of newly compiled kernels (best effort)."""
    info = {}
    for k in kernels:
        try:
            info = {"regs": k.n_regs, "spills": k.n_spills, "shared_bytes": k.metadata.shared}
        except Exception:
            pass
    return info


def check_candidates(shape: dict, dec_qlens, dec_ctxs, mixed: list, num_splits) -> tuple:
    """Returns (records, failed labels, {label: kernel info})."""
    records, failed, kinfo = [], [], {}
    t0 = time.perf_counter()
    fp8_dec = make_case(dec_qlens, dec_ctxs, dtype=torch.bfloat16, kv_dtype=FP8, seed=1, **shape)
    for label, bn, nw, ns, f16, vreg in CANDIDATES:
        cfg = decode_config(bn, nw, ns, f16, vreg, group=shape["group"])
        before = _compiled()
        try:
            err, ok = max_err(fp8_dec, config=cfg, num_splits=num_splits)
        except Exception as e:  # e.g. out of shared memory: report, do not time
            err, ok = repr(e), False
        kinfo[label] = _kernel_info(_compiled() - before)
        records.append({"check": f"fp8 decode, {label}", "max_err": err, "ok": ok, **kinfo[label]})
        if not ok:
            failed.append(label)
        shown = err if isinstance(err, str) else f"{err:.2e}"
        print(f"check fp8 decode {label:16s} max_err={shown} {'OK' if ok else 'FAIL'} "
              f"{kinfo[label]}", flush=True)
    fp8_fresh = ("fp8 decode, new token fresh", dec_qlens, dec_ctxs, 0, FP8, True)
    for name, qlens, ctxs, window, kv, *fresh in [*mixed, fp8_fresh]:  # default configs
        case = make_case(qlens, ctxs, dtype=torch.bfloat16, kv_dtype=kv, window=window, seed=2,
                         fresh=bool(fresh), **shape)
        err, ok = max_err(case)
        records.append({"check": f"default config, {name}", "max_err": err, "ok": ok})
        if not ok:
            failed.append(f"default:{name}")
        print(f"check default {name:30s} max_err={err:.2e} {'OK' if ok else 'FAIL'}", flush=True)
    print(f"checks took {time.perf_counter() - t0:.1f} s", flush=True)
    return records, failed, kinfo


def tiny() -> int:
    shape = dict(page_size=4, num_kv_heads=2, group=4, head_dim=32)
    mixed = [
        ("fp8 mixed", [9, 1, 1], [0, 40, 7], 0, FP8),
        ("fp8 mixed, window 5", [6, 1], [13, 29], 5, FP8),
        ("fp8 mixed, new tokens fresh", [70, 1], [13, 29], 0, FP8, True),
        ("bf16 mixed", [9, 1], [0, 40], 0, None),
    ]
    records, failed, _ = check_candidates(shape, [1, 1, 1], [0, 17, 150], mixed, num_splits=2)
    write_json({"mode": "tiny", "checks": records, "failed": failed})
    return 1 if failed else 0


def write_json(data: dict) -> None:
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fp8_attention_sweep.json"
    path.write_text(json.dumps(data, indent=1, default=str))
    print(f"wrote {path}", flush=True)


def time_decode(paged_inputs, ctx: int, kv_dtype, todo: list, bw: float) -> list[dict]:
    """Decode B x 1 query over ctx keys each (as benchmarks/attention_kernels.py decode_bench)
    for every (label, config) of `todo`, on one set of inputs."""
    q, kc, vc, bt, qsl, sl, _ = paged_inputs(
        [1] * ARGS.batch, [ctx - 1] * ARGS.batch, H, HKV, D, kv_dtype=kv_dtype
    )
    kv_bytes = 2 * ARGS.batch * ctx * HKV * D * kc.element_size()
    runs = []
    for label, cfg in todo:

        def f(cfg=cfg):
            return paged_attention(
                q, kc, vc, bt, qsl, sl, max_query_len=1, max_seq_len=ctx, scale=D**-0.5,
                config=cfg,
            )

        f()  # compile outside the timing
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
        gbs = kv_bytes / ms / 1e6
        dt = str(kv_dtype).split(".")[-1]
        runs.append({
            "config": label, "context": ctx, "kv_dtype": dt, "us": ms * 1e3, "gb_s": gbs,
            "pct_copy_bw": 100 * gbs / bw, "cfg": cfg,
        })
        print(f"{label:16s} ctx={ctx:6d} {dt:14s} {ms * 1e3:8.1f} us {gbs:7.0f} GB/s "
              f"{100 * gbs / bw:5.1f}% of copy", flush=True)
    return runs


def time_prefill(paged_inputs, n: int, ctx: int) -> list[dict]:
    """One causal prefill chunk of n tokens over ctx cached keys (default configs): bf16 cache,
    fp8 cache read for every key, and fp8 with the chunk's own K/V passed fresh (`k_new`, the
    engine's path); TFLOP/s of the causal attention."""
    flops = 4 * H * D * n * (ctx + (n + 1) / 2)
    runs = []
    for label, kv_dtype, fresh in [("bf16 cache", None, False), ("fp8 cache", FP8, False),
                                   ("fp8, chunk fresh", FP8, True)]:
        q, kc, vc, bt, qsl, sl, _ = paged_inputs([n], [ctx], H, HKV, D, kv_dtype=kv_dtype)
        k_new = torch.randn(n, HKV, D, device=q.device, dtype=q.dtype) if fresh else None
        v_new = torch.randn_like(k_new) if fresh else None

        args = (q, kc, vc, bt, qsl, sl)
        kw = dict(max_query_len=n, max_seq_len=n + ctx, scale=D**-0.5, k_new=k_new, v_new=v_new)

        def f(args=args, kw=kw):
            return paged_attention(*args, **kw)

        f()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
        runs.append({"prefill": label, "tokens": n, "context": ctx, "us": ms * 1e3,
                     "tflops": flops / ms / 1e9})
        print(f"prefill {label:18s} n={n} ctx={ctx} {ms * 1e3:8.1f} us "
              f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)
    return runs


def gpu() -> int:
    from attention_kernels import copy_bandwidth, paged_inputs

    dev = torch.device("cuda")
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(dev), flush=True)
    shape = dict(page_size=PS, num_kv_heads=HKV, group=G, head_dim=D)
    mixed = [
        ("fp8 prefill 300 + decodes", [300, 1, 1, 37], [0, 1000, 77, 500], 0, FP8),
        ("fp8 mixed, window 100", [200, 1, 1], [300, 700, 50], 100, FP8),
        ("fp8 prefill 300 + decodes, fresh", [300, 1, 1, 37], [0, 1000, 77, 500], 0, FP8, True),
        ("fp8 chunk 200 over 300, fresh", [200, 1], [300, 700], 100, FP8, True),
        ("bf16 prefill 300 + decodes", [300, 1, 1, 37], [0, 1000, 77, 500], 0, None),
    ]
    # the timed split counts; the check uses the first, so it compiles the timed kernel
    ctxs = ARGS.contexts
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    block_q = attention_config(D, G, 1).block_q
    splits = {c: choose_num_splits(ARGS.batch, HKV, 1, c, block_q, sms) for c in ctxs}
    # longest context 4070: a block table of 256 columns, divisible by 16 as in the timed runs,
    # so the check compiles (and reports registers of) the very kernels that are timed
    records, failed, kinfo = check_candidates(
        shape, [1] * 6, [0, 16, 300, 1000, 2047, 4070], mixed, num_splits=splits[ctxs[0]]
    )
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write) {bw:.0f} GB/s; splits per context {splits}", flush=True)

    default_fp8 = attention_config(D, G, 1, FP8)
    runs = []
    for ctx in ctxs:
        for kv_dtype in (torch.bfloat16, FP8):
            if kv_dtype == FP8:
                todo = [(lbl, decode_config(*c)) for lbl, *c in CANDIDATES if lbl not in failed]
            else:
                todo = [("default", attention_config(D, G, 1))]
            for run in time_decode(paged_inputs, ctx, kv_dtype, todo, bw):
                run["is_default"] = kv_dtype != FP8 or run["cfg"] == default_fp8
                run["attention_config"] = asdict(run.pop("cfg"))
                run.update(kinfo.get(run["config"], {}))
                runs.append(run)
            torch.cuda.empty_cache()

    prefill = time_prefill(paged_inputs, 8192, 0) + time_prefill(paged_inputs, 2048, 6144)
    write_json({
        "prefill": prefill,
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "triton": triton.__version__, "batch": ARGS.batch, "shape": dict(H=H, Hkv=HKV, D=D,
        page_size=PS), "copy_bw_gb_s": bw, "splits": splits,
        "default_fp8_config": asdict(default_fp8), "checks": records, "failed": failed,
        "runs": runs,
    })
    print(f"\ncopy bandwidth {bw:.0f} GB/s; default fp8 decode config "
          f"{default_fp8.block_n}/{default_fp8.num_warps}/{default_fp8.num_stages} (marked *); "
          f"labels: dots, BLOCK_N/num_warps/num_stages\n")
    bf16_us = {r["context"]: r["us"] for r in runs if r["kv_dtype"] == "bfloat16"}
    print("| config | context | KV dtype | us | GB/s of KV read | % of copy bw | time / bf16 "
          "| regs/spills |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        star = " *" if r["is_default"] and r["kv_dtype"] != "bfloat16" else ""
        regs = f"{r['regs']}/{r['spills']}" if "regs" in r else ""
        ctx = f"{r['context'] // 1024}k" if r["context"] % 1024 == 0 else str(r["context"])
        print(f"| {r['config']}{star} | {ctx} | {r['kv_dtype']} | {r['us']:.1f} | "
              f"{r['gb_s']:,.0f} | {r['pct_copy_bw']:.1f}% | "
              f"{r['us'] / bf16_us[r['context']]:.2f} | {regs} |")
    print("\n| prefill (H32/Hkv8, D128) | tokens | cached | us | TFLOP/s |\n|---|---|---|---|---|")
    for r in prefill:
        print(f"| {r['prefill']} | {r['tokens']} | {r['context']} | {r['us']:.0f} | "
              f"{r['tflops']:.0f} |")
    if failed:
        print(f"\nFAILED checks (not timed): {failed}")
    return 1 if failed else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU interpreter, correctness only")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4096, 32768])
    return p.parse_args()


if __name__ == "__main__":
    ARGS = parse_args()
    if not ARGS.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --tiny for the CPU correctness pass")
    sys.exit(tiny() if ARGS.tiny else gpu())
