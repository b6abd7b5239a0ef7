"""The torch backend's attention math on the CPU (issue 14, item 4): `attend_fast` (torch SDPA)
against the float32 einsum reference `attend_batched`, on the built-in models' head shapes.
Each case is checked for equality first (max abs difference printed), then timed (mean of
`--iters` calls after a warm-up). Prints one table.

Usage: OMP_NUM_THREADS=2 python benchmarks/cpu_attention.py [--iters 100]
"""

from __future__ import annotations

import argparse
import time

import torch

from swaserve.attention.torch_backend import attend_batched, attend_fast

HEADS = {"smollm2-135m": (9, 3, 64), "gemma-3-270m": (4, 1, 256)}  # (H, Hkv, D)
# (rows, new tokens per row, keys): decode batches of the CPU workload and of a long context,
# and one prefill chunk
CASES = [(16, 1, 150), (16, 1, 200), (8, 1, 1532), (1, 256, 1500)]


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    lines = ["| model heads | rows x new tokens | keys | einsums ms | attend_fast ms | speed-up "
             "| max abs diff |", "|---|---|---|---|---|---|---|"]
    for model, (h, hkv, d) in HEADS.items():
        for r, n, keys in CASES:
            q = torch.randn(r, n, h, d, generator=g)
            k, v = (torch.randn(r, keys, hkv, d, generator=g) for _ in range(2))
            qpos = keys - n + torch.arange(n)
            mask = (torch.arange(keys)[None, :] <= qpos[:, None]).expand(r, n, keys)
            call = (q, k, v, mask, d**-0.5)
            diff = attend_fast(*call) - attend_batched(*call)
            ref = _time(lambda call=call: attend_batched(*call), args.iters)
            fast = _time(lambda call=call: attend_fast(*call), args.iters)
            lines.append(f"| {model} ({h}, {hkv}, D {d}) | {r} x {n} | {keys} | {ref:.3f} "
                         f"| {fast:.3f} | {ref / fast:.2f}x | {diff.abs().max().item():.1e} |")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
