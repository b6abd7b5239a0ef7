"""CPU: the engine's host work per step at many running requests, with a model small enough that
its forward is not what a step waits for (issue 14: "a scheduler and batch builder whose host
cost does not grow with the number of running requests"; the 135M built-in model at high
concurrency on a GPU is host-bound).

A tiny random Llama (1 layer, hidden 32) in float32; N requests of P-token prompts, each asking
for many tokens (EOS ignored), all admitted and decoding before the timed steps. Each phase of
`EngineCore.step` is timed on the host (step_profile's `host_timer`): drafting, schedule, page
moves, launch (batch building, the forward, sampling), the forward alone (inside launch),
resolve (read-back and commit), retire. Prints ms per step and us per running request, and the
garbage collector's time in the timed steps (engine/gc_heap.py).

Usage: python benchmarks/host_step.py [--requests 512] [--steps 50] [--spec ngram [--gate-off]]
       [--overlap] [--profile 30]   (cProfile of that many steps: the top functions by own time)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # step_profile's host_timer

from step_profile import host_timer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from swaserve import Engine, SamplingParams  # noqa: E402

PHASES = ("propose", "schedule", "move_pages", "launch", "forward", "resolve", "retire")


def tiny_llama(folder: Path) -> None:
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=50, help="timed steps")
    ap.add_argument("--spec", choices=["ngram"], default=None)
    ap.add_argument("--gate-off", action="store_true",
                    help="with --spec: the gate keeps drafting off (what speculation costs "
                    "when it does not draft)")
    ap.add_argument("--overlap", action="store_true", help="keep the overlap schedule on")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumtime")
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp()) / "tiny"
    tiny_llama(folder)
    kw = {}
    if args.spec:
        kw = {"speculative_algorithm": args.spec, "disable_adaptive_speculation": True}
    n = args.requests
    eng = Engine(model=str(folder), device="cpu", page_size=16, kv_cache_gb=0.5,
                 max_num_seqs=n, max_num_batched_tokens=max(2048, n * (args.prompt + 8)),
                 disable_overlap_schedule=not args.overlap, **kw)
    core = eng.core
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    for i in range(n):
        core.add_request(f"r{i}", [rng.randrange(3, 256) for _ in range(args.prompt)], params)
    if args.gate_off:
        class Off:  # the gate's verdict at every batch size: drafting loses
            def choose(self, batch_size: int) -> bool:
                return False

            def record(self, *a) -> None:
                pass

        core.spec.gate = Off()
    while len(core.scheduler.running) < n or core.scheduler.waiting:
        core.step()
    for _ in range(5):
        core.step()

    host: dict[str, float] = defaultdict(float)
    if core.spec is not None:
        host_timer(host, core.spec, "propose", "propose")
    host_timer(host, core.scheduler, "schedule", "schedule")
    if core.cache is not None:
        host_timer(host, core.cache, "move_pages", "move_pages")
    host_timer(host, core, "_launch", "launch")
    host_timer(host, core.runner, "forward", "forward")
    host_timer(host, core, "_resolve", "resolve")
    host_timer(host, core.scheduler, "retire", "retire")
    collections = {"s": 0.0, "n": 0, "full": 0, "t": 0.0}

    def on_gc(phase: str, info: dict) -> None:  # the collector's time in the timed steps
        if phase == "start":
            collections["t"] = time.perf_counter()
        else:
            collections["s"] += time.perf_counter() - collections["t"]
            collections["n"] += 1
            collections["full"] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    wall = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile):
            core.step()
        prof.disable()
        pstats.Stats(prof).sort_stats(args.sort).print_stats(40)

    ms = 1e3 / args.steps
    print(f"{n} running requests, {args.steps} steps, spec {args.spec} (gate off: "
          f"{args.gate_off}), overlap {args.overlap}")
    print("| phase | ms/step | us/request |")
    print("|---|---|---|")
    for phase in PHASES:
        if phase in host:
            print(f"| {phase} | {host[phase] * ms:.2f} | {host[phase] * ms * 1e3 / n:.2f} |")
    print(f"| launch minus forward | {(host['launch'] - host['forward']) * ms:.2f} | "
          f"{(host['launch'] - host['forward']) * ms * 1e3 / n:.2f} |")
    print(f"| step (wall) | {wall * ms:.2f} | {wall * ms * 1e3 / n:.2f} |")
    print(f"garbage collector: {collections['s'] * ms:.2f} ms a step, {collections['n']} "
          f"collections ({collections['full']} full); a full collection now "
          f"{_full_collection_ms():.1f} ms ({gc.get_freeze_count()} objects frozen at start)")


def _full_collection_ms() -> float:
    t = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - t) * 1e3


if __name__ == "__main__":
    main()
