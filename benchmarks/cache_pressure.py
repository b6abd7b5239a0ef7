"""CPU run: what a prefix-cache eviction costs when the device pool binds and the tree grows.

A one-layer micro Llama (dummy weights, a config written to a temporary folder) takes
`--requests` random prompts (40-120 tokens, answers of 20-80, EOS ignored) with a device KV pool
too small for `--max-num-seqs` of them at once and a host tier that keeps every evicted page. So
the waiting request at the queue's head asks the cache for pages on most steps, and the cache
often cannot give enough ("short"), while the tree keeps growing with host-only nodes.
Per 1,000 finished requests it prints the wall time, the time inside `RadixCache.evict`, its
calls, the calls that fell short, and the tree's size: an eviction's cost should not grow with
the tree.

`--sliding-window W` makes it two layers, one sliding (window W) and one full, as Gemma mixes
them: then a short eviction also runs the SWA last resorts (levels 1 and 2 of `_evict_swa`).

Usage: python benchmarks/cache_pressure.py [--requests 5000] [--kv-cache-gb 0.008]
           [--host-cache-gb 0.5] [--max-num-seqs 512] [--sliding-window 32]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from swaserve import Engine, SamplingParams

MICRO = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_hidden_layers": 1, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 2048, "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--kv-cache-gb", type=float, default=0.008)
    ap.add_argument("--host-cache-gb", type=float, default=0.5)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--sliding-window", type=int, default=0, metavar="W")
    args = ap.parse_args()
    config = dict(MICRO)
    if args.sliding_window:
        config.update(num_hidden_layers=2, sliding_window=args.sliding_window,
                      layer_types=["sliding_attention", "full_attention"])
    folder = Path(tempfile.mkdtemp()) / "micro"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    eng = Engine(model=str(folder), load_format="dummy", device="cpu", seed=0,
                 max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb,
                 max_model_len=1024, host_cache_gb=args.host_cache_gb)
    core, cache = eng.core, eng.core.cache
    stats: dict[str, float] = defaultdict(float)
    evict = cache.evict

    def timed_evict(num_pages: int, swa_only: bool = False) -> int:
        t = time.perf_counter()
        got = evict(num_pages, swa_only)
        stats["evict_s"] += time.perf_counter() - t
        stats["calls"] += 1
        stats["short"] += got < num_pages
        return got

    cache.evict = timed_evict
    rng = random.Random(0)
    for i in range(args.requests):
        ids = [rng.randint(5, 2000) for _ in range(rng.randint(40, 120))]
        core.add_request(str(i), ids, SamplingParams(
            max_tokens=rng.randint(20, 80), ignore_eos=True, temperature=0, detokenize=False))
    print("| finished | wall s | evict s | evict calls | short | tree nodes | running |")
    print("|---|---|---|---|---|---|---|")
    done = finished = 0
    t0 = last = time.perf_counter()
    while core.has_unfinished():
        outs = core.step()
        n = sum(1 for o in outs if o.finish_reason)
        done += n
        finished += n
        if done >= 1000 or not core.has_unfinished():
            now = time.perf_counter()
            print(f"| {finished} | {now - last:.2f} | {stats['evict_s']:.2f} | "
                  f"{int(stats['calls'])} | {int(stats['short'])} | {len(cache.nodes)} | "
                  f"{len(core.scheduler.running)} |", flush=True)
            last, done = now, 0
            stats.clear()
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
