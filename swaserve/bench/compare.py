"""Two engine configurations under one KV budget, one engine at a time: the shared half of the
GPU comparison benchmarks (benchmarks/window_vs_full.py, benchmarks/fp8_vs_bf16.py).

Each variant builds its engine, warms the Triton kernels up on a short prompt, then runs the
same N random prompts of `context - new` tokens plus `new` tokens each (greedy, ignore_eos),
all submitted at once (`run_tracked`), checks the memory invariants and frees the engine
before the next one is built.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from swaserve.bench.offline import run_tracked

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress to stderr, with seconds since import: stdout is kept for the table."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def comparison_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    """The flags both comparison scripts take; None means the script's default."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke run)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    return ap.parse_args(argv)


def release_memory() -> None:
    """After the caller dropped its last engine reference: collect it, give memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        log(f"freed: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")


def run_variant(
    name: str,
    make_engine: Callable[[], Any],
    describe: Callable[[Any], tuple[dict[str, Any], str]],
    num_requests: int,
    context: int,
    new: int,
    warm_tokens: Callable[[Any], int],
) -> dict[str, Any]:
    """One variant: `describe(engine)` gives its pool facts and a log line about them;
    `warm_tokens(engine)` the warm-up prompt's length. Returns the facts and `run_tracked`'s
    measurements in one dict. The prompts depend only on the model's vocabulary (seed 0), so
    every variant of one model runs the same ones."""
    t = time.perf_counter()
    eng = make_engine()
    log(f"{name}: engine up in {time.perf_counter() - t:.1f} s")
    vocab = eng.core.hf_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(context - new)]
               for _ in range(num_requests)]
    info, line = describe(eng)
    log(f"{name}: {line}")
    t = time.perf_counter()
    run_tracked(eng, [prompts[0][: min(len(prompts[0]), warm_tokens(eng))]], 4)  # compiles
    log(f"{name}: warm-up {time.perf_counter() - t:.1f} s")
    res = run_tracked(eng, prompts, new)
    log(f"{name}: {num_requests} x ({context - new} + {new}) in {res['wall_s']:.1f} s, "
        f"peak running {res['peak_running']}, preemptions {res['preemptions']}")
    eng.core.memory.check_integrity()
    del eng
    release_memory()
    return {**info, **res}


def speed_ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Variant a over variant b: requests held at once, throughput, and speed (b's wall / a's)."""
    return {
        "max_concurrent": a["max_concurrent"] / max(b["max_concurrent"], 1),
        "output_tok_s": a["output_tok_s"] / b["output_tok_s"],
        "total_tok_s": a["total_tok_s"] / b["total_tok_s"],
        "wall_s": b["wall_s"] / a["wall_s"],
    }


def write_record(out_dir: str, filename: str, record: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    log(f"wrote {path}")
