"""`swaserve bench serve`: load an OpenAI-compatible server and report its latencies.

Like the peers' serving benchmarks (vLLM's `bench serve`, SGLang's `bench_serving`): N
prompts from a dataset are sent as streaming `/v1/completions` requests, at most C at once,
arriving as a Poisson process of rate R (all at once by default). Per request it measures
TTFT (until the first token), ITL per token (each gap between chunks divided by the tokens
the chunk brought) and end-to-end latency; it prints throughput plus mean, p50 and p99 of
each, and writes them to a JSON file.

Datasets: `random` (input_len random words, output_len tokens), `shared-prefix` (one
prefix of prefix_len words per group, then random words: exercises the prefix cache), or a
JSONL file whose lines hold `prompt` (text or token ids) and optionally `max_tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an "
    "they which one you were all her she there would their we him been has when who will no "
    "more if out so said what up its about than into them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: the prefix-cache hit
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # one entry per token after the first


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default="random", help="random | shared-prefix | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    p.add_argument("--input-len", type=int, default=128, help="words per random prompt")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix words")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: prefix groups")
    p.add_argument(
        "--num-turns",
        type=int,
        default=1,
        help="shared-prefix: turns per conversation; turn t+1 resends turn t's prompt plus "
        "--input-len new words, after turn t finished",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: exactly max_tokens each)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument(
        "--result-file",
        default=None,
        help="default: swaserve-bench-serve-<time>.json in the current folder",
    )


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def build_dataset(args: argparse.Namespace) -> list[list[BenchRequest]]:
    """Conversations: each a list of requests sent one after another (one turn unless
    shared-prefix with --num-turns > 1); `num_prompts` counts requests."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    if args.dataset == "random":
        return [[BenchRequest(_words(rng, args.input_len), args.output_len)] for _ in range(n)]
    if args.dataset == "shared-prefix":
        prefixes = [_words(rng, args.prefix_len) for _ in range(max(1, args.num_prefixes))]
        turns = max(1, args.num_turns)
        convs = []
        for i in range(max(1, n // turns)):
            prompt, conv = prefixes[i % len(prefixes)], []
            for _ in range(turns):
                prompt = prompt + " " + _words(rng, args.input_len)
                conv.append(BenchRequest(prompt, args.output_len))
            convs.append(conv)
        return convs
    path = Path(args.dataset)
    if not path.is_file():
        raise ValueError(f"--dataset {args.dataset!r}: not random, shared-prefix or a file")
    items = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            items.append(BenchRequest(d["prompt"], int(d.get("max_tokens", args.output_len))))
    if not items:
        raise ValueError(f"{path} holds no prompts")
    return [[items[i % len(items)]] for i in range(n)]


async def _one(client: Any, url: str, body: dict, timeout: float) -> Result:
    res = Result()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                k = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if k == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.extend([(now - last) / k] * k)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens received"
    except Exception as e:  # a failed request is counted, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(name: str, xs: list[float]) -> dict[str, float]:
    if not xs:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {
        f"mean_{name}_ms": 1000 * statistics.fmean(s),
        f"median_{name}_ms": 1000 * statistics.median(s),
        f"p99_{name}_ms": 1000 * p99,
    }


async def _probe(client: Any, base: str, model: str | None) -> str:
    """GET /v1/models before any load: returns `model`, or the server's first model when it is
    None. Raises ConnectionError when nothing answers at `base`, ValueError on an HTTP error."""
    import httpx

    url = f"{base}/v1/models"
    try:
        r = await client.get(url, timeout=30)
    except httpx.TransportError as e:
        raise ConnectionError(f"cannot connect to {base}: {e or type(e).__name__}") from None
    if model is not None:
        return model
    if r.status_code != 200:
        detail = f"HTTP {r.status_code} {r.text[:200]!r}"
        raise ValueError(f"GET {url}: {detail} (check --base-url and --api-key)")
    return r.json()["data"][0]["id"]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(1, args.max_concurrency) + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        model = await _probe(client, base, args.model)
        dataset = build_dataset(args)
        sem = asyncio.Semaphore(max(1, args.max_concurrency))
        rng = random.Random(args.seed + 1)

        async def limited(conv: list[BenchRequest]) -> list[Result]:
            out = []
            async with sem:  # a conversation keeps its slot: turn t+1 follows turn t
                for req in conv:
                    body = {
                        "model": model,
                        "prompt": req.prompt,
                        "max_tokens": req.max_tokens,
                        "temperature": 0.0,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                        "ignore_eos": not args.no_ignore_eos,
                        "return_token_ids": True,
                    }
                    out.append(await _one(client, f"{base}/v1/completions", body, args.timeout))
            return out

        tasks = []
        start = time.perf_counter()
        for conv in dataset:
            tasks.append(asyncio.create_task(limited(conv)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = [r for conv in await asyncio.gather(*tasks) for r in conv]
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def summarize(
    args: argparse.Namespace, model: str, results: list[Result], duration: float
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    summary: dict[str, Any] = {
        "backend": "swaserve",
        "base_url": args.base_url,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": cached / inp if inp else 0.0,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out / duration if duration else 0.0,
        "total_token_throughput": (inp + out) / duration if duration else 0.0,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok]))
    summary.update(_stats("itl", [x for r in ok for x in r.itl]))
    summary.update(_stats("e2el", [r.e2e for r in ok]))
    return summary


def print_summary(s: dict[str, Any]) -> None:
    print(f"{'=' * 20} swaserve serving benchmark {'=' * 20}")
    rows = [
        ("Successful requests", s["completed"]),
        ("Failed requests", s["failed"]),
        ("Duration (s)", s["duration_s"]),
        ("Total input tokens", s["total_input_tokens"]),
        ("Total output tokens", s["total_output_tokens"]),
        ("Cached prompt tokens", s["total_cached_tokens"]),
        ("Prefix cache hit rate", s["prefix_cache_hit_rate"]),
        ("Request throughput (req/s)", s["request_throughput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Total token throughput (tok/s)", s["total_token_throughput"]),
    ]
    for name, label in (("ttft", "TTFT"), ("itl", "ITL per token"), ("e2el", "E2E latency")):
        for kind in ("mean", "median", "p99"):
            rows.append((f"{kind.capitalize()} {label} (ms)", s[f"{kind}_{name}_ms"]))
    for k, v in rows:
        print(f"{k:<40}{v:>14.2f}" if isinstance(v, float) else f"{k:<40}{v:>14}")
    for e in s["errors"]:
        print(f"error: {e}")


def run_from_args(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_concurrency < 1:
        raise ValueError("--num-prompts and --max-concurrency must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    summary = asyncio.run(run(args))
    print_summary(summary)
    path = args.result_file or time.strftime("swaserve-bench-serve-%Y%m%d-%H%M%S.json")
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"result written to {path}", file=sys.stderr)
    return 0 if summary["completed"] else 1
