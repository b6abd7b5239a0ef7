"""`swaserve bench serve` against the offline engine on the same requests (issue 14: the server
within 10% of the offline engine at 256 concurrent requests).

The requests: N prompts of random token ids (fixed seed), each with exactly M new tokens
(greedy, EOS ignored), written once as a `bench serve` jsonl dataset (token-id prompts go to
`/v1/completions` as they are, so the server sees the very ids the offline engine sees). Rows,
each engine in a fresh process on an empty GPU:

  offline       `Engine.generate` on all N at once (the engine's own max_num_seqs)
  offline-C     the same with max_num_seqs = C: the server's concurrency, so the gap to
                `serve` is the HTTP path's cost alone
  serve         `swaserve serve` (same model, same engine defaults) loaded by `swaserve bench
                serve --max-concurrency C`; its output tok/s, median TTFT, inter-token latency
                percentiles and the frontend process's CPU time per output token (from
                /proc: what decides whether streams keep up at C); one row per
                `--stream-intervals` value (`serve-siN` for N > 1)

Dummy bf16 weights of a config under swaserve/configs (no tokenizer: outputs stream as token
counts). The server needs fastapi, uvicorn, pydantic and pyzmq, which the GPU machine lacks:
`scripts/server_wheels_for_device.sh` packs them. Prints a table last; JSON lines and logs
under $OUT (default ./bench_out).

Usage (repo root):
  python3 benchmarks/serve_vs_offline.py [--model llama-3.1-8b] [--num-prompts 1000]
      [--input-len 400] [--output-len 400] [--concurrency 256] [--rows offline offline-C serve]
      [--stream-intervals 1 4] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from child_run import record, run_child  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench_out")).resolve()


def make_requests(n: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(100, vocab - 100) for _ in range(input_len)] for _ in range(n)]


def offline_side(args: argparse.Namespace, max_num_seqs: int | None) -> dict:
    """One offline run in this process (the child of a row): warm-up, then the timed run."""
    from swaserve import Engine, SamplingParams

    prompts = [json.loads(line)["prompt"] for line in open(args.dataset)]
    kw = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    t = time.perf_counter()
    engine = Engine(model=str(args.folder), load_format="dummy", dtype=args.dtype,
                    device=args.device, seed=0, **kw)  # fmt: skip
    init_s = time.perf_counter() - t
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engine.generate(prompt_token_ids=[p[:64] for p in prompts[:8]], sampling_params=params,
                    use_tqdm=False)  # fmt: skip
    t = time.perf_counter()
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    dt = time.perf_counter() - t
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    if got != len(prompts) * args.output_len:
        raise RuntimeError(f"{got} output tokens, expected {len(prompts) * args.output_len}")
    return {"init_s": round(init_s, 1), "elapsed_s": round(dt, 2),
            "output_tok_per_s": round(got / dt, 1)}  # fmt: skip


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_row(args: argparse.Namespace, stream_interval: int = 1) -> dict:
    """The server in a subprocess, `bench serve` against it, the server stopped."""
    url = f"http://127.0.0.1:{args.port}"
    log = open(OUT / f"serve_vs_offline_server_si{stream_interval}.log", "w")
    cmd = [sys.executable, "-m", "swaserve.cli", "serve", "--model", str(args.folder),
           "--load-format", "dummy", "--dtype", args.dtype, "--device", args.device,
           "--port", str(args.port), "--seed", "0",
           "--stream-interval", str(stream_interval)]  # fmt: skip
    t = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait_healthy(url, server, args.timeout)
        init_s = time.perf_counter() - t
        result = OUT / "serve_vs_offline_bench.json"
        bench = [sys.executable, "-m", "swaserve.cli", "bench", "serve", "--base-url", url,
                 "--dataset", "jsonl", "--dataset-path", str(args.dataset),
                 "--num-prompts", str(args.num_prompts), "--max-concurrency",
                 str(args.concurrency), "--output-len", str(args.output_len),
                 "--result-file", str(result), "--disable-tqdm"]  # fmt: skip
        warm = bench[:]
        warm[warm.index("--num-prompts") + 1] = "8"
        warm[warm.index("--result-file") + 1] = str(OUT / "serve_vs_offline_warm.json")
        subprocess.run(warm, check=True, capture_output=True, timeout=args.timeout, cwd=REPO)
        cpu0 = _cpu_seconds(server.pid)  # the frontend (the engine cores are its children)
        run = subprocess.run(bench, capture_output=True, text=True, timeout=args.timeout,
                             cwd=REPO)  # fmt: skip
        frontend_cpu_s = _cpu_seconds(server.pid) - cpu0
        (OUT / "serve_vs_offline_bench.log").write_text(run.stdout + run.stderr)
        if run.returncode != 0:
            raise RuntimeError(f"bench serve failed ({run.returncode}): {run.stderr[-2000:]}")
        s = json.loads(result.read_text())
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['errors']}")
    return {"init_s": round(init_s, 1), "elapsed_s": round(s["duration_s"], 2),
            "output_tok_per_s": round(s["output_throughput"], 1),
            "median_ttft_ms": s.get("median_ttft_ms"), "median_itl_ms": s.get("median_itl_ms"),
            "p90_itl_ms": s.get("p90_itl_ms"), "p99_itl_ms": s.get("p99_itl_ms"),
            "stream_interval": stream_interval, "frontend_cpu_s": round(frontend_cpu_s, 2),
            "frontend_us_per_token": round(frontend_cpu_s / s["total_output_tokens"] * 1e6, 1),
            "max_concurrent_requests": s["max_concurrent_requests"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b",
                    help="a config folder under swaserve/configs, or a path to one")  # fmt: skip
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--rows", nargs="+", default=["offline", "offline-C", "serve"],
                    choices=["offline", "offline-C", "serve"])  # fmt: skip
    ap.add_argument("--stream-intervals", type=int, nargs="+", default=[1],
                    help="a serve row for each `--stream-interval` value")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--timeout", type=float, default=600.0, help="per row, seconds")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one offline row here
    ap.add_argument("--dataset", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.folder = Path(args.model).resolve() if Path(args.model).is_dir() else (
        REPO / "swaserve" / "configs" / args.model)  # fmt: skip
    if args.side:
        seqs = None if args.side == "offline" else args.concurrency
        print("RESULT " + json.dumps(offline_side(args, seqs)), flush=True)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.folder / "config.json").read_text())["vocab_size"]
    args.dataset = OUT / "serve_vs_offline.jsonl"
    with open(args.dataset, "w") as f:
        for ids in make_requests(args.num_prompts, args.input_len, vocab):
            f.write(json.dumps({"prompt": ids, "max_tokens": args.output_len}) + "\n")
    jsonl = OUT / "serve_vs_offline_rows.jsonl"
    rows: dict[str, dict] = {}
    names = [n for row in args.rows for n in (
        [f"serve-si{i}" if i > 1 else "serve" for i in args.stream_intervals]
        if row == "serve" else [row])]  # fmt: skip
    for name in names:
        started = time.perf_counter()
        base = {"row": name, "model": args.model, "requests": args.num_prompts,
                "input_len": args.input_len, "output_len": args.output_len,
                "concurrency": args.concurrency}  # fmt: skip
        try:
            if name.startswith("serve"):
                base.update(serve_row(args, int(name.removeprefix("serve-si") or 1)
                                      if name != "serve" else 1))  # fmt: skip
            else:
                cmd = [sys.executable, __file__, "--side", name, "--dataset", str(args.dataset),
                       "--model", args.model, "--concurrency", str(args.concurrency),
                       "--output-len", str(args.output_len), "--device", args.device,
                       "--dtype", args.dtype]  # fmt: skip
                got, text, rc = run_child(cmd, args.timeout, OUT / f"serve_vs_offline_{name}.log")
                if got is None:
                    raise RuntimeError(f"exit {rc}: {text[-1500:]}")
                base.update(got)
        except Exception as e:  # noqa: BLE001 - one failed row, the others still run
            base["error"] = f"{type(e).__name__}: {e}"[:2000]
        rows[name] = record(base, name, started, jsonl)
    ref = rows.get("offline", {}).get("output_tok_per_s")
    print(f"\n{args.num_prompts} requests x ({args.input_len} + {args.output_len}) tokens, "
          f"{args.model} (dummy {args.dtype}), concurrency {args.concurrency} for the server")
    print("| row | output tok/s | vs offline | elapsed s | init s | median TTFT ms "
          "| ITL ms p50 / p90 / p99 | frontend us/token | note |")
    print("|---|---|---|---|---|---|---|---|---|")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for name, r in rows.items():
        v = r.get("output_tok_per_s")
        ratio = f"{v / ref:.2f}x" if v and ref else "-"
        itl = " / ".join(ms(r.get(k)) for k in ("median_itl_ms", "p90_itl_ms", "p99_itl_ms"))
        print(f"| {name} | {v or '-'} | {ratio} | {r.get('elapsed_s', '-')} "
              f"| {r.get('init_s', '-')} | {ms(r.get('median_ttft_ms'))} | {itl} "
              f"| {r.get('frontend_us_per_token', '-')} | {r.get('error', '')[:80]} |")


if __name__ == "__main__":
    main()
