"""swaserve against vLLM on the same requests, in the same run (issue 14, item 5).

Each (workload, engine) pair runs in a fresh subprocess, so every engine starts on an empty
GPU; vLLM runs only where it is installed (`../shared/peers/vllm_gpu/` puts it on the GPU
machine). The requests of every workload come from fixed seeds and are the same for every
engine; `offline` uses the vLLM peer's own generator and prints its dataset digest.

Workloads (dummy bf16 weights; greedy, ignore_eos):
  offline         Llama-3.1-8B shape, 1,000 requests, prompt/output lengths U[100, 1024]
                  (the peer's bench_vllm.py order, random.Random(0)): output tok/s
  latency         Llama-3.1-8B shape, batch 1, 128-token prompt:
                  (time for 129 new tokens - time for 1) / 128, median of 5: ms/token
  hybrid-decode   Gemma-3-27B shape, 20 GiB of KV, 48 x (7,936 + 1,024): total tok/s
  hybrid-prefill  Gemma-3-27B shape, 20 GiB of KV, 48 x (7,936 + 256): total tok/s
  fp8-16k         Llama-3.1-8B shape, 16 GiB of KV, 64 x (16,000 + 1,024), bf16 against FP8
                  KV (engines swaserve and swaserve-fp8 by default): output tok/s

An engine name may carry swaserve Engine arguments after `@`, comma-separated, parsed as
step_profile.py's --engine-arg: `swaserve@max_num_batched_tokens=4096`.

Prints one table last; per-run logs and JSON lines under $OUT (default ./bench_out).
Usage (repo root):
  python3 benchmarks/vs_vllm.py [--workloads offline latency ...] [--engines swaserve vllm]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from child_run import record, run_child  # noqa: E402
from step_profile import _engine_arg, digest, make_requests  # noqa: E402


@dataclass(frozen=True)
class Workload:
    model: str  # a config folder under swaserve/configs
    metric: str  # output_tok_per_s | total_tok_per_s | ms_per_token
    kv_gib: float | None = None  # a fixed KV budget (both engines); None: each engine's default
    n: int = 0
    prompt_len: int = 0
    new_tokens: int = 0
    max_model_len: int = 4096
    budget: int | None = None  # tokens per step, both engines; None: each engine's default
    engines: tuple[str, ...] = ("swaserve", "vllm")
    vocab: int = 128256  # random prompt ids are drawn from [100, vocab - 100]


WORKLOADS = {
    "offline": Workload("llama-3.1-8b", "output_tok_per_s"),
    "latency": Workload("llama-3.1-8b", "ms_per_token"),
    "hybrid-decode": Workload(
        "gemma-3-27b", "total_tok_per_s", 20, 48, 7936, 1024, 9216, 8192, vocab=262208),
    "hybrid-prefill": Workload(
        "gemma-3-27b", "total_tok_per_s", 20, 48, 7936, 256, 8192, 8192, vocab=262208),
    "fp8-16k": Workload(
        "llama-3.1-8b", "output_tok_per_s", 16, 64, 16000, 1024, 17408, 8192,
        engines=("swaserve", "swaserve-fp8"),
    ),
}


def _requests(name: str, w: Workload) -> list[tuple[list[int], int]]:
    if name == "offline":
        return make_requests(1000, 0)
    rng = random.Random(0)
    return [([rng.randint(100, w.vocab - 100) for _ in range(w.prompt_len)], w.new_tokens)
            for _ in range(w.n)]


# ---- the two engines behind one small interface: build, then generate(ids lists, max_tokens)


class _Swaserve:
    def __init__(self, w: Workload, fp8: bool, extra: dict | None = None) -> None:
        from swaserve import Engine

        kwargs: dict = dict(model=w.model, load_format="dummy", max_model_len=w.max_model_len)
        if w.kv_gib is not None:
            kwargs.update(kv_cache_gb=w.kv_gib, disable_prefix_cache=True)
        if w.budget is not None:
            kwargs["max_num_batched_tokens"] = w.budget
        if fp8:
            kwargs.update(kv_cache_dtype="fp8_e4m3", kv_cache_scale=1.0)
        self.engine = Engine(**{**kwargs, **(extra or {})})  # ENGINE@KEY=VALUE wins

    def kv_tokens(self) -> int | None:
        """Tokens the KV pool holds, for a model whose layers form one group (a hybrid
        model's windows make it depend on the requests: None)."""
        stats = self.engine.memory_stats()
        one = len(stats["groups"]) == 1
        return stats["pages_total"] * stats["page_size"] if one else None

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        from swaserve import SamplingParams

        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                  for m in max_tokens]
        outs = self.engine.generate(prompt_token_ids=prompts, sampling_params=params,
                                    use_tqdm=False)
        return sum(len(o.token_ids) for o in outs)


class _Vllm:
    def __init__(self, w: Workload, fp8: bool) -> None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from vllm import LLM

        folder = Path(os.environ.get("OUT", "bench_out")).resolve() / f"vllm_{w.model}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(
            (REPO / "swaserve/configs" / w.model / "config.json").read_text())
        kwargs: dict = dict(model=str(folder), load_format="dummy", skip_tokenizer_init=True,
                            dtype="bfloat16", max_model_len=w.max_model_len, seed=0)
        if w.kv_gib is not None:
            kwargs.update(kv_cache_memory_bytes=int(w.kv_gib * 2**30),
                          enable_prefix_caching=False)
        else:
            kwargs["gpu_memory_utilization"] = 0.85  # the peer's bench_vllm.py
        if w.budget is not None:
            kwargs["max_num_batched_tokens"] = w.budget
        if fp8:
            kwargs["kv_cache_dtype"] = "fp8"
        self.llm = LLM(**kwargs)

    def kv_tokens(self) -> int | None:
        """vLLM's KV blocks x block size, where its front end knows them (its log says "GPU KV
        cache size: N tokens" either way)."""
        cache = getattr(getattr(self.llm.llm_engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None)
        return blocks * cache.block_size if blocks else None

    def generate(self, prompts: list[list[int]], max_tokens: list[int]) -> int:
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                 detokenize=False) for m in max_tokens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)


def _build(engine: str, w: Workload):
    name, _, args = engine.partition("@")
    if name.startswith("vllm"):
        if args:
            raise SystemExit(f"{engine}: Engine arguments after @ are for swaserve only")
        return _Vllm(w, fp8=name.endswith("-fp8"))
    extra = dict(_engine_arg(item) for item in args.split(",") if item)
    return _Swaserve(w, fp8=name.endswith("-fp8"), extra=extra)


def run_side(name: str, engine: str, passes: int = 1) -> dict:
    """One engine on one workload, in this process. Returns the result row: the last of
    `passes` timed runs of the workload (each earlier one a warm-up; `first_pass_s` is the
    first's time)."""
    w = WORKLOADS[name]
    t = time.perf_counter()
    eng = _build(engine, w)
    row: dict = {"workload": name, "engine": engine, "init_s": round(time.perf_counter() - t, 1)}
    if name == "latency":
        rng = random.Random(7)

        def timed(n_new: int) -> float:
            ids = [rng.randint(100, 128156) for _ in range(128)]
            t0 = time.perf_counter()
            got = eng.generate([ids], [n_new])
            if got != n_new:
                raise RuntimeError(f"asked for {n_new} tokens, got {got}")
            return time.perf_counter() - t0

        for _ in range(2):
            timed(1), timed(129)
        t1, tn = zip(*[(timed(1), timed(129)) for _ in range(5)])
        row["ms_per_token"] = round((statistics.median(tn) - statistics.median(t1)) / 128 * 1e3, 3)
        return row
    reqs = _requests(name, w)
    prompts, max_tokens = [p for p, _ in reqs], [m for _, m in reqs]
    if name == "offline":  # the peer's warm-up: 32 requests of another seed, outputs <= 64
        row["dataset_digest"] = digest(reqs)
        warm = make_requests(32, 1000)
        eng.generate([p for p, _ in warm], [min(m, 64) for _, m in warm])
    else:
        eng.generate([p[:64] for p in prompts[:2]], [4, 4])
    for i in range(passes):
        t = time.perf_counter()
        got = eng.generate(prompts, max_tokens)
        dt = time.perf_counter() - t
        if i == 0 and passes > 1:
            row["first_pass_s"] = round(dt, 2)
    if got != sum(max_tokens):
        raise RuntimeError(f"{got} output tokens, expected {sum(max_tokens)}")
    n_prompt = sum(len(p) for p in prompts)
    if isinstance(eng, _Swaserve) and hasattr(eng.engine, "core"):
        sched = eng.engine.core.scheduler
        row.update(preemptions=sched.num_preemptions)
    row["kv_tokens"] = eng.kv_tokens()
    row.update(elapsed_s=round(dt, 2), output_tok_per_s=round(got / dt, 1),
               total_tok_per_s=round((got + n_prompt) / dt, 1), requests=len(reqs))
    return row


def _installed(engine: str) -> bool:
    return not engine.startswith("vllm") or importlib.util.find_spec("vllm") is not None


def _table(rows: list[dict]) -> str:
    lines = ["| workload | metric | engine | value | vs first engine | init s | note |",
             "|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["workload"] for r in rows):
        metric = WORKLOADS[name].metric
        group = [r for r in rows if r["workload"] == name]
        base = next((r.get(metric) for r in group if r.get(metric)), None)
        for r in group:
            v = r.get(metric)
            if v and base:  # for ms/token lower is better: the ratio is speed, base / v
                ratio = f"{(base / v if metric == 'ms_per_token' else v / base):.2f}x"
            else:
                ratio = "-"
            note = r.get("error", r.get("dataset_digest", ""))
            lines.append(f"| {name} | {metric} | {r['engine']} | {v if v else '-'} | {ratio} "
                         f"| {r.get('init_s', '-')} | {note} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--engines", nargs="+", default=None,
                   help="default: each workload's (vllm first where installed, as the base)")
    p.add_argument("--timeout", type=int, default=420, help="seconds per run")
    p.add_argument("--passes", type=int, default=1,
                   help="timed runs of each workload, the last reported: 2 leaves first-use "
                        "costs out (a cold Triton cache compiled swaserve's kernels for ~25 s of "
                        "a 77 s hybrid-prefill run on the H200, 2026-12-02)")
    p.add_argument("--side", nargs=2, metavar=("WORKLOAD", "ENGINE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:  # the child: one run, one JSON line
        print("RESULT " + json.dumps(run_side(*args.side, passes=args.passes)), flush=True)
        return
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.workloads:
        engines = args.engines or sorted(WORKLOADS[name].engines, key=lambda e: "vllm" not in e)
        for engine in engines:
            if not _installed(engine):
                print(f"{name} / {engine}: not installed, skipped", flush=True)
                continue
            log = out / re.sub(r"[^A-Za-z0-9._-]", "_", f"vs_vllm_{name}_{engine}.log")
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--side", name, engine, "--passes", str(args.passes)]
            row, _, rc = run_child(cmd, args.timeout, log)
            row = row or {"workload": name, "engine": engine, "error": f"rc={rc}, see {log.name}"}
            rows.append(record(row, f"{name} / {engine}", t, out / "vs_vllm.jsonl"))
    print(_table(rows))


if __name__ == "__main__":
    main()
