"""GPU run: the Triton fused MoE (swaserve/ops/fused_moe.py) against its torch reference and a
dense bf16 roofline, at gpt-oss-120b's and Qwen3-30B-A3B's expert shapes.

Order: correctness first (kernel vs `fused_moe_reference` at every T, and a CUDA-graph capture of
the decode sizes replayed bit-equal to eager), then the copy-bandwidth ceiling, then timings.
Prints a table last. Weights are random, built on the device. Needs torch and triton only (the
module is loaded without running swaserve/__init__.py). Exit status 1 if a check failed.

Columns: fused / graph = the op eager / replayed from a CUDA graph (T <= 128); align = the
alignment step alone; ref = the torch reference; dense = two dense bf16 GEMMs with the same
M = T * K rows against one expert's weights (the compute roofline); bw = the bytes the op must
move at least (every routed expert's weights once, x in, out out) over the measured copy
bandwidth; bound = max(dense, bw); eff = bound / fused.

Usage (repo root, on the GPU machine): python3 benchmarks/fused_moe.py
"""

from __future__ import annotations

import importlib
import sys
import time
import types
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
DEV = torch.device("cuda")
DTYPE = torch.bfloat16
TOKENS = [1, 16, 128, 1024, 8192]
GRAPH_TOKENS = [1, 16, 128]
MODELS = [  # name, H, I, E, K, activation, biases
    ("gpt-oss-120b", 2880, 2880, 128, 4, "swigluoai", True),
    ("Qwen3-30B-A3B", 2048, 768, 128, 8, "silu", False),
]


def load_fused_moe() -> types.ModuleType:
    """swaserve.ops.fused_moe without running swaserve/__init__.py (it imports the engine and
    its dependencies; this benchmark needs torch and triton only)."""
    for name, path in (("swaserve", ROOT / "swaserve"), ("swaserve.ops", ROOT / "swaserve/ops")):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(path)]
            sys.modules[name] = pkg
    return importlib.import_module("swaserve.ops.fused_moe")


fm = load_fused_moe()


def bench_ms(fn, rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=rep)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3)


def routing(t: int, e: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(t, e, device=DEV, generator=gen)
    vals, ids = logits.topk(k, dim=-1)
    return torch.softmax(vals, dim=-1), ids.to(torch.int32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def main() -> int:
    torch.manual_seed(0)
    gen = torch.Generator(device=DEV).manual_seed(0)
    failures: list[str] = []
    rows: list[tuple] = []
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    for name, h, i, e, k, act, biases in MODELS:
        t0 = time.time()
        w13 = torch.randn(e, 2 * i, h, device=DEV, dtype=DTYPE, generator=gen) * h**-0.5
        w2 = torch.randn(e, h, i, device=DEV, dtype=DTYPE, generator=gen) * i**-0.5
        b13 = torch.randn(e, 2 * i, device=DEV, dtype=DTYPE, generator=gen) if biases else None
        b2 = torch.randn(e, h, device=DEV, dtype=DTYPE, generator=gen) if biases else None
        expert_bytes = (3 * i * h + (3 * i + h if biases else 0)) * w13.element_size()
        for t in TOKENS:
            x = torch.randn(t, h, device=DEV, dtype=DTYPE, generator=gen)
            weights, ids = routing(t, e, k, gen)
            args = (x, w13, w2, weights, ids, b13, b2, act)
            cfg = fm.moe_config(t, e, k, DTYPE)

            # correctness first
            got = fm.fused_moe(*args)
            want = fm.fused_moe_reference(*args)
            err = relative_error(got, want)
            ok = err < 2e-2 and bool(torch.isfinite(got).all())
            if not ok:
                failures.append(f"{name} T={t}: max error {err:.3g} of max |ref|")
            graph_ms = float("nan")
            if t in GRAPH_TOKENS:
                try:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        fm.fused_moe(*args)  # compiled before capture
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        graphed = fm.fused_moe(*args)
                    graph.replay()
                    torch.cuda.synchronize()
                    if not torch.equal(graphed, got):
                        failures.append(f"{name} T={t}: graph replay differs from eager")
                    graph_ms = bench_ms(graph.replay)
                except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                    failures.append(f"{name} T={t}: graph capture failed: {exc!r}"[:300])

            # timings
            fused_ms = bench_ms(lambda: fm.fused_moe(*args))  # noqa: B023
            align_ms = bench_ms(lambda: fm.moe_align(ids, e, cfg.block_m))  # noqa: B023
            ref_ms = bench_ms(lambda: fm.fused_moe_reference(*args), rep=20)  # noqa: B023
            m = t * k
            a1 = torch.randn(m, h, device=DEV, dtype=DTYPE, generator=gen)
            a2 = torch.randn(m, i, device=DEV, dtype=DTYPE, generator=gen)
            w13t, w2t = w13[0].T, w2[0].T
            dense_ms = bench_ms(lambda: (a1 @ w13t, a2 @ w2t))  # noqa: B023
            experts_hit = ids.unique().numel()
            min_bytes = experts_hit * expert_bytes + 2 * t * h * x.element_size()
            bw_ms = min_bytes / bw * 1e3
            bound = max(dense_ms, bw_ms)
            flops = 2 * m * 3 * i * h
            rows.append(
                (name, t, cfg.block_m, fused_ms, graph_ms, align_ms, ref_ms, dense_ms, bw_ms,
                 bound / fused_ms, flops / fused_ms / 1e9, min_bytes / fused_ms / 1e9, err, ok)
            )  # fmt: skip
            print(f"{name} T={t}: fused {fused_ms * 1e3:.1f} us, ref {ref_ms * 1e3:.1f} us, "
                  f"err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)  # fmt: skip
        del w13, w2, b13, b2
        torch.cuda.empty_cache()
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)

    print()
    print("| model | T | BM | fused us | graph us | align us | ref us | dense us | bw us | eff "
          "| TFLOP/s | TB/s | err | ok |")  # fmt: skip
    print("|" + "---|" * 14)
    for r in rows:
        name, t, bm, fused, graph, align, ref, dense, bwt, eff, tflops, tbs, err, ok = r
        print(f"| {name} | {t} | {bm} | {fused * 1e3:.1f} | {graph * 1e3:.1f} | "
              f"{align * 1e3:.1f} | {ref * 1e3:.0f} | {dense * 1e3:.1f} | {bwt * 1e3:.1f} | "
              f"{eff:.0%} | {tflops:.0f} | {tbs:.2f} | {err:.1e} | "
              f"{'ok' if ok else 'FAIL'} |")  # fmt: skip
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
