"""The decode GEMV (swaserve/ops/gemv.py) against cuBLAS on the projections of one decode step.

For each weight shape and row count, in the variant the engine runs (the RMSNorm fused in front
of q/k/v and gate/up, the residual add behind o, the activation in front of down and the add
behind it, plain for the head): cuBLAS (`F.linear`, what the engine runs otherwise, with
swaserve's RMSNorm or act_and_mul kernel in front, a torch add behind), then every candidate
GemvConfig at the first row count, the six fastest at the others (checked first against a
float32 reference: max |diff| within a few bf16 steps of the output's scale, or it is not
timed). Rows past `gemv.MAX_ROWS` (`--rows 4 8 16`) sweep the tensor-core variant's tiles
(`use_dot`) instead, or the elementwise ones, or both (`--row-tiles`); the engine takes
`gemv.row_config`'s tile there only with SWASERVE_GEMV_ROWS > 2.
Each timing is a CUDA graph of launches over rotating copies of the weight (more bytes than
the L2 holds, as the layers of a model are), replayed; time per launch, and the weight bytes
read per second.

Usage (GPU machine, repo root): python3 benchmarks/gemv_bench.py
    [--model llama-8b|gemma-27b|smollm2-135m] [--rows 1 2] [--shapes qkv o gate_up down head]
Prints a table last; JSON lines to $OUT/gemv_bench.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from swaserve.models.blocks import RMSNorm  # noqa: E402
from swaserve.ops.activation import act_and_mul  # noqa: E402
from swaserve.ops.gemv import MAX_ROWS, GemvConfig, gemv  # noqa: E402
from swaserve.ops.rmsnorm import rmsnorm  # noqa: E402

SHAPES = {  # name: (N, K)
    "llama-8b": {
        "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
        "down": (4096, 14336), "head": (128256, 4096),
    },
    "gemma-27b": {
        "qkv": (8192, 5376), "o": (5376, 4096), "gate_up": (43008, 5376),
        "down": (5376, 21504),
    },
    # the built-in chat model (9 heads, 3 K/V heads of 64): its speculative verify steps
    "smollm2-135m": {
        "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
        "head": (49152, 576),
    },
}  # fmt: skip
CANDIDATES = [  # at the first row count; products in registers per program <= 16,384
    GemvConfig(bn, bk, w, s)
    for bn in (2, 4, 8, 16, 32)
    for bk in (512, 1024, 2048)
    for w in (4, 8)
    for s in (1, 2, 3)
    if bn * bk <= 16384 and (bn, w) != (2, 8)
]
DOT_CANDIDATES = [  # the tensor-core variant, for rows past gemv.MAX_ROWS
    GemvConfig(bn, bk, w, s, use_dot=True)
    for bn in (16, 32, 64)
    for bk in (64, 128, 256)
    for w in (4, 8)
    for s in (3, 4)
]
# the elementwise variant past gemv.MAX_ROWS (`--row-tiles fma|both`): rows x n x k products
# in registers, at most 8,192 a program at 8 rows
ROW_CANDIDATES = [
    GemvConfig(bn, bk, 4, s)
    for bn in (2, 4, 8, 16)
    for bk in (32, 64, 128, 256)
    for s in (2, 3)
    if bn * bk <= 1024
]
# what the engine's decode GEMV path runs per projection (models/llama.py, forward_gemv)
VARIANT = {"qkv": "norm", "o": "res", "gate_up": "norm", "down": "act", "head": None}
L2_BYTES = 50 << 20
OUT = Path(os.environ.get("OUT", "bench_out"))


def timed(fn, weights: list[torch.Tensor], replays: int = 10) -> float:
    """Microseconds per call of fn(w), over a graph that calls it once per weight copy."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in weights:
            fn(w)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (replays * len(weights)))
    return best


def measure(
    name: str, weights: list[torch.Tensor], norm: RMSNorm, m: int, tiles: list[GemvConfig]
) -> tuple[dict, dict[GemvConfig, float]]:
    """One (shape, row count), in the variant the engine runs it (VARIANT): cuBLAS with the
    separate launches the variant replaces, the default tile, each tile in `tiles`."""
    n, k = weights[0].shape
    nbytes = n * k * 2
    x = torch.randn(m, k, device=weights[0].device, dtype=torch.bfloat16)
    res = torch.randn(m, n, device=x.device, dtype=torch.bfloat16)
    variant = VARIANT[name]
    kw = {"norm": norm} if variant == "norm" else {"residual": res} if variant == "res" else {}
    if variant == "act":  # x is gate|up: act_and_mul, cuBLAS, the residual add
        gu = torch.randn(m, 2 * k, device=x.device, dtype=torch.bfloat16)
        a = act_and_mul(gu[:, :k], gu[:, k:], "silu")
        ref = (a.float() @ weights[0].float().T) + res.float()
        t_cublas = timed(lambda w: F.linear(act_and_mul(gu[:, :k], gu[:, k:], "silu"), w) + res,
                         weights)  # fmt: skip
        x, kw = gu, {"residual": res, "act": "silu"}
    elif variant == "norm":
        ref = F.linear(rmsnorm(x, norm), weights[0]).float()
        t_cublas = timed(lambda w: F.linear(rmsnorm(x, norm), w), weights)
    elif variant == "res":
        ref = (x.float() @ weights[0].float().T) + res.float()
        t_cublas = timed(lambda w: F.linear(x, w) + res, weights)
    else:
        ref = x.float() @ weights[0].float().T
        t_cublas = timed(lambda w: F.linear(x, w), weights)
    tol = 4e-2 * max(1.0, ref.abs().max().item() / 8)
    t_plain_cublas = timed(lambda w: F.linear(x[:, :k], w), weights)
    times: dict[GemvConfig, float] = {}
    for cfg in tiles:
        try:
            err = (gemv(x, weights[0], config=cfg, **kw).float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001 (out of resources for this tile)
            print(f"  {name} m={m} {cfg}: {type(e).__name__}", flush=True)
            continue
        if err > tol:
            print(f"  {name} m={m} {cfg}: WRONG err {err:.3g}", flush=True)
            continue
        times[cfg] = timed(lambda w, c=cfg: gemv(x, w, config=c, **kw), weights)
    best_cfg = min(times, key=times.get)
    best = times[best_cfg]
    row = {
        "shape": name, "n": n, "k": k, "m": m, "variant": variant or "plain",
        "cublas_us": t_cublas, "cublas_plain_us": t_plain_cublas,
        "default_us": timed(lambda w: gemv(x, w, **kw), weights) if m <= MAX_ROWS else None,
        "best_us": best, "best": best_cfg.__dict__,
        "plain_best_us": timed(lambda w: gemv(x[:, :k].contiguous(), w, config=best_cfg), weights),
        "cublas_tbs": nbytes / t_plain_cublas / 1e6, "best_tbs": nbytes / best / 1e6,
    }  # fmt: skip
    return row, times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", nargs="+", help="a subset of the model's shapes (default all)")
    ap.add_argument("--row-tiles", default="dot", choices=["dot", "fma", "both"],
                    help="tiles swept past gemv.MAX_ROWS: tensor-core, elementwise, or both")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    log = open(OUT / "gemv_bench.jsonl", "a")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows_out = []
    for name, (n, k) in SHAPES[args.model].items():
        if args.shapes and name not in args.shapes:
            continue
        copies = max(2, -(-4 * L2_BYTES // (n * k * 2)))
        weights = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)
        ]
        norm = RMSNorm(k, 1e-5).to(dev)
        norm.weight.data = torch.rand(k, device=dev) + 0.5
        past = {"dot": DOT_CANDIDATES, "fma": ROW_CANDIDATES,
                "both": DOT_CANDIDATES + ROW_CANDIDATES}[args.row_tiles]
        first = {False: CANDIDATES, True: past}
        tiles = {}
        for m in args.rows:
            dot = m > MAX_ROWS
            row, times = measure(name, weights, norm, m, tiles.get(dot, first[dot]))
            for cfg, t in times.items():
                log.write(json.dumps({"shape": name, "m": m, "cfg": cfg.__dict__, "us": t}) + "\n")
            if dot not in tiles:  # more rows: only the six fastest tiles of the first count
                tiles[dot] = sorted(times, key=times.get)[:6]
            log.write(json.dumps(row) + "\n")
            log.flush()
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        del weights
        torch.cuda.empty_cache()
    print(
        f"\n{args.model}: us per call; cuBLAS = F.linear plus the separate launches the "
        "variant replaces (RMSNorm kernel in front, or a residual add behind)"
    )
    print(
        "| shape | m | variant | cuBLAS | GEMV default | GEMV best | best tile (n/k/warps/stages) "
        "| plain cuBLAS (TB/s) | plain GEMV, best tile (TB/s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        b = r["best"]
        cfg = f"{b['block_n']}/{b['block_k']}/{b['num_warps']}/{b['num_stages']}" + (
            " dot" if b["use_dot"] else ""
        )
        print(
            f"| {r['shape']} | {r['m']} | {r['variant']} | {r['cublas_us']:.1f} "
            f"| {'-' if r['default_us'] is None else round(r['default_us'], 1)} "
            f"| {r['best_us']:.1f} | {cfg} "
            f"| {r['cublas_plain_us']:.1f} ({r['cublas_tbs']:.2f}) "
            f"| {r['plain_best_us']:.1f} ({r['best_tbs']:.2f}) |"
        )


if __name__ == "__main__":
    main()
