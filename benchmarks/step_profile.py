"""GPU run (issue 14, item 1): where the time of a step goes, on the offline throughput
workload of the vLLM peer (1,000 requests, prompt and output lengths uniform in [100, 1024],
`random.Random(0)` in the peer's order, same `dataset_digest`), Llama-3.1-8B shape, dummy bf16
weights, swaserve's defaults.

Each engine step is timed by phase on the host (schedule, page moves, launch = batch building
+ forward and sampling enqueued, resolve = waiting for the tokens and committing them, retire)
and on the device (CUDA events around the launched work). Steps are split by kind: decode
steps through a decode CUDA graph, and the others (prefill chunks, mixed batches, decode
batches above the decode graphs' buckets: piecewise graphs up to their token limit, else
eager); "graph mixed" steps replay a mixed graph (engine/mixed_graph.py). The GPU's busy
share is its event time over the wall time.

Prints a table last; JSON to $OUT/step_profile.json.
Usage: PYTHONPATH=. python benchmarks/step_profile.py [--num-prompts 1000] [--max-steps N]
       [--engine-arg piecewise_cuda_graph_max_tokens=0 ...] [--label NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import time
from collections import defaultdict

import torch

from swaserve import Engine, SamplingParams

VOCAB = 128256


def make_requests(n: int, seed: int = 0, lo: int = 100, hi: int = 1024):
    """The peer's requests (bench_vllm.py make_requests): per request prompt length, output
    length, then the prompt's ids, all from one random.Random(seed) stream."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(lo, hi), rng.randint(lo, hi)
        reqs.append(([rng.randint(100, VOCAB - 100) for _ in range(plen)], olen))
    return reqs


def digest(reqs) -> str:
    h = hashlib.sha256()
    for ids, olen in reqs:
        h.update(json.dumps([ids, olen]).encode())
    return h.hexdigest()[:16]


def _engine_arg(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if value in ("True", "False"):
        return key, value == "True"
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def host_timer(host: dict, obj: object, name: str, phase: str, gpu: list | None = None) -> None:
    """Wrap `obj.name` so that each call adds its host seconds to `host[phase]`; with `gpu`,
    also appends (phase, start, end) CUDA events around the call (its device time, when it
    enqueues one graph's work)."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        if gpu is not None:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        try:
            return fn(*a, **k)
        finally:
            if gpu is not None:
                e.record()
                gpu.append((phase, s, e))
            host[phase] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps")
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an Engine keyword (int, float or str), e.g. max_num_batched_tokens=8192")
    ap.add_argument("--label", default="defaults")
    ap.add_argument("--torch-profile-steps", type=int, default=0, metavar="N",
                    help="instead of the table: N steps after the warm-up under torch.profiler, "
                         "then the kernels by GPU time (and a chrome trace under $OUT)")
    ap.add_argument("--host-profile-steps", type=int, default=0, metavar="N",
                    help="instead of the table: N steps after the warm-up under cProfile, then "
                         "the host's functions by own time (and $OUT/host.prof)")
    ap.add_argument("--workload", default="offline",
                    help="a workload of benchmarks/vs_vllm.py (its model, KV budget, requests)")
    args = ap.parse_args()
    kw = dict(_engine_arg(a) for a in args.engine_arg)
    model = "llama-3.1-8b"
    if args.workload != "offline":
        from vs_vllm import WORKLOADS, _requests  # imports this module: only here, lazily

        w = WORKLOADS[args.workload]
        model = w.model
        kw = {"kv_cache_gb": w.kv_gib, "disable_prefix_cache": True, "max_model_len":
              w.max_model_len, "max_num_batched_tokens": w.budget, **kw}
    t0 = time.perf_counter()
    eng = Engine(model=model, load_format="dummy", seed=0, **kw)
    start_s = time.perf_counter() - t0
    core = eng.core
    if args.workload == "latency":  # batch 1: one 128-token prompt, as vs_vllm times it
        rng = random.Random(0)
        reqs = [([rng.randint(100, VOCAB - 100) for _ in range(128)], 1024)]
    elif args.workload != "offline":
        reqs = _requests(args.workload, w)
    else:
        reqs = make_requests(args.num_prompts)
    for i, (ids, olen) in enumerate(reqs):
        core.add_request(str(i), ids, SamplingParams(max_tokens=olen, ignore_eos=True,
                                                     temperature=0))
    host = defaultdict(float)  # phase -> seconds, this step
    stats = defaultdict(lambda: defaultdict(float))  # kind -> field -> total
    graph_hit = [False]

    host_timer(host, core.scheduler, "schedule", "schedule")
    if core.cache is not None:
        host_timer(host, core.cache, "move_pages", "page_moves")
    host_timer(host, core, "_resolve", "resolve")
    host_timer(host, core.scheduler, "retire", "retire")
    decode_logits = core.runner.decode_logits

    def decode_probe(*a, **k):
        out = decode_logits(*a, **k)
        graph_hit[0] = out is not None
        return out

    core.runner.decode_logits = decode_probe
    mixed_logits = core.runner.mixed_logits
    mixed_hit = [False]

    def mixed_probe(*a, **k):
        out = mixed_logits(*a, **k)
        mixed_hit[0] = out is not None
        return out

    core.runner.mixed_logits = mixed_probe
    launch = core._launch
    events = []  # (kind, start event, end event)

    def launch_timed(batch):
        t = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = launch(batch)
        end.record()
        host["launch"] += time.perf_counter() - t
        kind = ("graph decode" if graph_hit[0] else "graph mixed" if mixed_hit[0]
                else "mixed/prefill/big")  # fmt: skip
        events.append((kind, start, end))
        tokens = sum(batch.num_new_tokens)
        stats[kind]["tokens"] += tokens
        stats[kind]["requests"] += len(batch)
        return out

    core._launch = launch_timed
    steps, out_tokens = 0, 0
    wall0 = time.perf_counter() if args.warmup_steps <= 0 else None  # 0: count every step
    while core.has_unfinished():
        host.clear()
        graph_hit[0] = mixed_hit[0] = False
        n_events = len(events)
        t = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t
        steps += 1
        if args.torch_profile_steps and steps == args.warmup_steps:
            _kernel_profile(core, args.torch_profile_steps)
            return
        if args.host_profile_steps and steps == args.warmup_steps:
            _host_profile(core, args.host_profile_steps)
            return
        if steps == args.warmup_steps:
            torch.cuda.synchronize()
            wall0 = time.perf_counter()
            for kind in list(stats):
                stats[kind].clear()
            events.clear()
            continue
        if wall0 is None:
            continue
        out_tokens += sum(len(o.new_token_ids) for o in outs)
        kind = events[-1][0] if len(events) > n_events else "no launch"
        s = stats[kind]
        s["steps"] += 1
        s["step_s"] += dt
        for phase, v in host.items():
            s[phase] += v
        if args.max_steps and steps >= args.max_steps:
            break
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall0
    gpu = defaultdict(float)
    for kind, a, b in events:
        gpu[kind] += a.elapsed_time(b) / 1e3
    phases = ["schedule", "page_moves", "launch", "resolve", "retire"]
    record = {"label": args.label, "engine_args": kw, "start_s": start_s,
              "digest": digest(reqs), "wall_s": wall, "steps": steps,
              "output_tok_s": out_tokens / wall, "gpu_busy": sum(gpu.values()) / wall,
              "kinds": {}}
    print(f"\n[{args.label}] {kw or 'defaults'}: engine start {start_s:.1f} s")
    record["preemptions"] = core.scheduler.num_preemptions
    print(f"{model} dummy bf16, {len(reqs)} requests (digest {record['digest']}), "
          f"after {args.warmup_steps} warm-up steps, {record['preemptions']} preemptions")
    print(f"wall {wall:.1f} s, {out_tokens / wall:,.0f} output tok/s, GPU busy "
          f"{record['gpu_busy']:.0%} (event time / wall)")
    head = f"{'step kind':22} {'steps':>6} {'tok/step':>8} {'reqs':>6} {'step ms':>8} " + " ".join(
        f"{p[:8]:>8}" for p in phases) + f" {'GPU ms':>8}"
    print(head)
    for kind, s in stats.items():
        n = s["steps"]
        if not n:
            continue
        row = {p: s[p] / n * 1e3 for p in phases}
        g = gpu.get(kind, 0.0) / n * 1e3
        record["kinds"][kind] = {"steps": n, "tokens_per_step": s["tokens"] / n,
                                 "requests_per_step": s["requests"] / n,
                                 "step_ms": s["step_s"] / n * 1e3, "gpu_ms": g, **row}
        print(f"{kind:22} {int(n):6d} {s['tokens'] / n:8.0f} {s['requests'] / n:6.0f} "
              f"{s['step_s'] / n * 1e3:8.2f} " + " ".join(f"{row[p]:8.2f}" for p in phases)
              + f" {g:8.2f}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"step_profile_{args.label}.json"), "w") as f:
            json.dump(record, f, indent=1)


def _kernel_profile(core, n: int) -> None:
    """n engine steps under torch.profiler: GPU time by kernel, the steps' wall time, and how
    many of the wall's milliseconds the GPU spent in kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        reqs = 0
        for _ in range(n):
            core.step()
            reqs += len(core.scheduler.running)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    events = prof.key_averages()
    kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
    total = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"\n{n} steps (~{reqs / n:.0f} running requests) in {wall * 1e3:.1f} ms wall "
          f"(under the profiler), GPU kernels {total:.1f} ms ({total / (wall * 1e3):.0%})")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30,
                                    max_name_column_width=60))
    out = os.environ.get("OUT")
    if out:
        prof.export_chrome_trace(os.path.join(out, "step_trace.json"))


def _host_profile(core, n: int) -> None:
    """n engine steps under cProfile: where the host's time goes (the profiler slows Python
    calls, so the shares matter, not the absolute times)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    reqs = 0
    prof.enable()
    for _ in range(n):
        core.step()
        reqs += len(core.scheduler.running)
    prof.disable()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    print(f"\n{n} steps (~{reqs / n:.0f} running requests) in {wall * 1e3:.1f} ms wall "
          f"under cProfile ({wall / n * 1e3:.2f} ms a step)")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    out = os.environ.get("OUT")
    if out:
        stats.dump_stats(os.path.join(out, "host.prof"))


if __name__ == "__main__":
    main()
