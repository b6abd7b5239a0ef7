"""CPU run: time to first token of a second request sharing a 1,500-token prefix with a first
request that has already finished, prefix cache on vs off (Gemma 3 270M, eager torch on CPU).

Each trial draws a fresh random prefix (no hit from an earlier trial), runs the first request
(prefix + 20 tokens, 8 generated), then times the second (prefix + 25 other tokens,
max_tokens=1: prefill plus the first sample) on both engines. Prints the median TTFTs, their
ratio and the cached tokens. Usage: python benchmarks/cpu_prefix_cache.py [trials]
"""

from __future__ import annotations

import platform
import random
import statistics
import sys
import time

import torch

from swaserve import Engine, SamplingParams

PREFIX = 1500


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    p = SamplingParams(max_tokens=1, temperature=0)
    t = time.perf_counter()
    out = engine.generate(prompt_token_ids=[prompt], sampling_params=p, use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens


def main() -> int:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(
        torch.__version__,
        platform.processor() or platform.machine(),
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    engines = {
        "on": Engine(model="gemma-3-270m", device="cpu", kv_cache_gb=1),
        "off": Engine(model="gemma-3-270m", device="cpu", kv_cache_gb=1, disable_prefix_cache=True),
    }
    rng = random.Random(0)
    first_params = SamplingParams(max_tokens=8, temperature=0)
    times: dict[str, list[float]] = {"on": [], "off": []}
    cached = []
    for trial in range(trials + 1):  # trial 0 warms up
        prefix = [2] + [rng.randrange(1000, 30000) for _ in range(PREFIX - 1)]
        first = prefix + [rng.randrange(1000, 30000) for _ in range(20)]
        second = prefix + [rng.randrange(1000, 30000) for _ in range(25)]
        for name, engine in engines.items():
            engine.generate(prompt_token_ids=[first], sampling_params=first_params, use_tqdm=False)
            dt, hit = ttft(engine, second)
            if trial:
                times[name].append(dt)
                if name == "on":
                    cached.append(hit)
            print(f"trial {trial} cache {name}: TTFT {dt * 1000:.0f} ms, cached {hit}", flush=True)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"median TTFT, second request, {PREFIX}-token shared prefix, {len(second)} tokens:")
    print(f"  cache off {off * 1000:.0f} ms, cache on {on * 1000:.0f} ms: {off / on:.1f}x lower")
    print(f"  cached tokens {sorted(set(cached))}")
    print(engines["on"].memory_stats() | {"groups": "..."})
    return 0


if __name__ == "__main__":
    sys.exit(main())
