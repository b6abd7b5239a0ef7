"""Decode attention: key splits x tile on the GPU, against the copy ceiling (issue 14: the
Gemma-3-27B decode-heavy step, where the attention ran at 64% of the ceiling on its sliding
layers and 83% on its full ones, stop 24).

For each shape, every (splits, tile) variant is checked against the default launch (max |diff|
< 2e-2) and timed in a CUDA graph (`triton.testing.do_bench_cudagraph`, median; the split
merge included). Prints a
table last; JSON lines to $OUT/decode_splits.jsonl.

Usage (GPU machine, repo root): python3 benchmarks/decode_splits.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from attention_tuning import config_of, copy_bandwidth, paged_inputs  # noqa: E402

from swaserve.attention.kernels.paged_attention import paged_attention  # noqa: E402

SPLITS = [1, 2, 4, 8]
TILES = [(64, 4, 2), (128, 4, 2), (32, 4, 2)]  # block_n, warps, stages
SHAPES = [  # name, batch, context, H, Hkv, D, window
    ("gemma27b B17 ctx 8.5k w1024", 17, 8500, 32, 16, 128, 1024),
    ("gemma27b B17 ctx 8.5k full", 17, 8500, 32, 16, 128, 0),
    ("gemma27b B48 ctx 8k w1024", 48, 8191, 32, 16, 128, 1024),
    ("llama B256 ctx 1000", 256, 1000, 32, 8, 128, 0),
    ("llama B64 ctx 4k", 64, 4095, 32, 8, 128, 0),
    ("llama B16 ctx 2k", 16, 2047, 32, 8, 128, 0),
]


def bench(fn) -> float:
    """Median ms of `fn` replayed in a CUDA graph: at tens of microseconds a kernel launched
    from Python measures the host (the first run of this script: 107-188 us for batch 1)."""
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=50)


def main() -> None:
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    for name, b, ctx, h, hkv, d, window in SHAPES:
        x, _, _ = paged_inputs([1] * b, [ctx] * b, h, hkv, d)
        base = paged_attention(**x, window=window)
        kv_bytes = b * min(ctx + 1, window or 1 << 30) * hkv * d * 4
        for splits in SPLITS:
            for tile in TILES:
                args = dict(
                    x,
                    window=window,
                    num_splits=splits,
                    config=config_of(tile, h // hkv),
                    min_query_len=None,
                )
                try:
                    o = paged_attention(**args)
                    err = (o.float() - base.float()).abs().max().item()
                    ok = err < 2e-2
                    ms = bench(lambda a=args: paged_attention(**a)) if ok else float("nan")
                except Exception as e:  # noqa: BLE001 - reported, not timed
                    ok, err, ms = False, f"{type(e).__name__}: {str(e)[:100]}", float("nan")
                r = dict(
                    shape=name,
                    splits=splits,
                    tile="/".join(map(str, tile)),
                    ok=ok,
                    err=err,
                    us=ms * 1e3,
                    of_copy=kv_bytes / ms / 1e6 / bw,
                )
                rows.append(r)
                print(json.dumps(r), flush=True)
        dflt = dict(x, window=window)
        r = dict(
            shape=name,
            splits="default",
            tile="default",
            ok=True,
            err=0.0,
            us=bench(lambda a=dflt: paged_attention(**a)) * 1e3,
        )
        r["of_copy"] = kv_bytes / (r["us"] / 1e3) / 1e6 / bw
        rows.append(r)
    with open(out / "decode_splits.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\n| shape | splits | tile | us | of copy |\n|---|---|---|---|---|")
    for name in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == name and r["ok"]]
        best = sorted(mine, key=lambda r: r["us"])[:4]
        dflt = [r for r in mine if r["splits"] == "default"]
        for r in dflt + [r for r in best if r not in dflt]:
            print(f"| {name} | {r['splits']} | {r['tile']} | {r['us']:.1f} | {r['of_copy']:.0%} |")


if __name__ == "__main__":
    main()
