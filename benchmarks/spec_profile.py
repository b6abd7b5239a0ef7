"""Where a speculative step's time goes at batch 1 (issue 11: "say where the time goes"): one
request decoding greedily, each engine step timed by phase on the host, and the device time
of the drafter's graph and the target's verify (or decode) graph from CUDA events around
their replays. Speculation off runs the same request for the baseline.

Phases (host, ms a step): decide+propose (the drafter: its inputs and graph replay; the
drafts stay on the device, or before 2026-12-04's change were read back here, one device
sync), schedule, verify (the target's verify graph: inputs and replay), sample (acceptance
on the device, then the step's one read-back: waits for the drafter and verify graphs),
resolve/commit, retire, and the rest of `EngineCore.step`.

`--load-format dummy` times the same step shapes without the target's weights (acceptance is
then ~0: every step commits one token; the step's work is the same).
Prints a table last; JSON to $OUT/spec_profile.json.
Usage: PYTHONPATH=. python benchmarks/spec_profile.py [--drafter DIR ...] [--steps 300]
       [--load-format dummy] [--torch-profile-steps N] [--gated] [--ngram]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from swaserve import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import host_timer  # noqa: E402

PROMPT = "Explain how a refrigerator keeps food cold, step by step, for a curious child."


def profile(name: str, kw: dict, args: argparse.Namespace) -> dict:
    # a fixed KV budget: the engines run one after another in this process
    eng = Engine(model=args.model, device=args.device, seed=0, load_format=args.load_format,
                 kv_cache_gb=4, **kw)
    core = eng.core
    tok = eng.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    host: dict[str, float] = defaultdict(float)
    gpu: list | None = [] if args.device == "cuda" else None  # a CPU run: host times only
    spec = core.spec
    if spec is not None:
        host_timer(host, spec, "decide", "propose")
        host_timer(host, spec, "propose", "propose")
        if spec.dflash is not None and spec.dflash.graphs is not None:
            host_timer(host, spec.dflash.graphs, "run", "drafter", gpu)
        host_timer(host, spec, "sample", "sample")
        if core.runner.verify_graphs is not None:
            host_timer(host, core.runner.verify_graphs, "run_chunks", "verify", gpu)
    if core.runner.graphs is not None:
        host_timer(host, core.runner.graphs, "run", "decode", gpu)
    host_timer(host, core.scheduler, "schedule", "schedule")
    host_timer(host, core, "_resolve", "resolve")
    host_timer(host, core.scheduler, "retire", "retire")
    totals: dict[str, float] = defaultdict(float)
    steps = tokens = 0
    for rep in range(2):  # the first request warms up (graphs, allocator, the gate)
        core.add_request(f"r{rep}", ids, SamplingParams(max_tokens=args.steps, temperature=0,
                                                        ignore_eos=True))
        totals.clear()
        if gpu is not None:
            gpu.clear()
        steps = tokens = 0
        sync()
        wall0 = time.perf_counter()
        while core.has_unfinished():
            host.clear()
            t = time.perf_counter()
            outs = core.step()
            dt = time.perf_counter() - t
            steps += 1
            tokens += sum(len(o.new_token_ids) for o in outs)
            totals["step"] += dt
            for k, v in host.items():
                totals[k] += v
        sync()
        wall = time.perf_counter() - wall0
    dev: dict[str, float] = defaultdict(float)
    for phase, s, e in gpu or []:
        dev[phase] += s.elapsed_time(e)
    row = {"engine": name, "steps": steps, "tokens": tokens, "wall_s": wall,
           "ms_per_token": wall / tokens * 1e3, "ms_per_step": wall / steps * 1e3,
           "tokens_per_step": tokens / steps,
           "host_ms": {k: v / steps * 1e3 for k, v in totals.items()},
           "gpu_ms": {k: v / steps for k, v in dev.items()}}
    named = sum(v for k, v in totals.items() if k not in ("step", "drafter"))  # drafter: in propose
    row["host_ms"]["other"] = (totals["step"] - named) / steps * 1e3
    if args.torch_profile_steps:
        _torch_profile(core, ids, args, name)
    del eng, core, spec
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def _torch_profile(core, ids: list[int], args: argparse.Namespace, name: str) -> None:
    """N steps of a third request under torch.profiler: host functions and kernels."""
    from torch.profiler import ProfilerActivity, profile

    core.add_request("p", ids, SamplingParams(max_tokens=args.torch_profile_steps + 40,
                                              temperature=0, ignore_eos=True))
    for _ in range(20):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.torch_profile_steps):
            core.step()
        torch.cuda.synchronize()
    print(f"\n== {name}: {args.torch_profile_steps} steps under torch.profiler, by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                    max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15,
                                    max_name_column_width=50))
    out = os.environ.get("OUT")
    if out:
        prof.export_chrome_trace(os.path.join(out, f"spec_trace_{name}.json"))
    while core.has_unfinished():
        core.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", nargs="*", default=[None],
                    help="drafter folders (default: the one shipped for --model)")
    ap.add_argument("--steps", type=int, default=300, help="max_tokens of the timed request")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda", help="cuda (cpu: a dry run, host times only)")
    ap.add_argument("--ngram", action="store_true", help="also the n-gram drafter")
    ap.add_argument("--torch-profile-steps", type=int, default=0)
    ap.add_argument("--gated", action="store_true",
                    help="also each drafter with the gate on (DFlash's cost on decode steps)")
    args = ap.parse_args()
    engines: dict[str, dict] = {"off": {}}
    for i, d in enumerate(args.drafter):
        engines[f"dflash{i}"] = dict(speculative_algorithm="dflash",
                                     speculative_draft_model=d,
                                     disable_adaptive_speculation=True)
        if args.gated:  # the gate decides: where drafting loses, decode steps that only
            # store the drafter's context (what DFlash costs when it does not draft)
            engines[f"gated{i}"] = dict(speculative_algorithm="dflash",
                                        speculative_draft_model=d)
    if args.ngram:
        engines["ngram"] = dict(speculative_algorithm="ngram", disable_adaptive_speculation=True)
    rows = [profile(name, kw, args) for name, kw in engines.items()]
    phases = ["propose", "drafter", "schedule", "verify", "decode", "sample", "resolve",
              "retire", "other"]
    print(f"\n{args.model} ({args.load_format}), batch 1, greedy, {args.steps} tokens; "
          "host ms a step by phase, [device ms] of the graph replayed in it")
    print(f"{'engine':8} {'ms/tok':>7} {'tok/step':>8} {'ms/step':>8} "
          + " ".join(f"{p[:8]:>14}" for p in phases))
    for r in rows:
        cells = []
        for p in phases:
            h, g = r["host_ms"].get(p), r["gpu_ms"].get(p)
            cells.append("-" if h is None else f"{h:.3f}" + (f" [{g:.3f}]" if g else ""))
        print(f"{r['engine']:8} {r['ms_per_token']:7.3f} {r['tokens_per_step']:8.2f} "
              f"{r['ms_per_step']:8.3f} " + " ".join(f"{c:>14}" for c in cells))
    for i, d in enumerate(args.drafter):
        print(f"  dflash{i}{', gated' + str(i) if args.gated else ''}: {d or 'shipped'}")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "spec_profile.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
