"""`swaserve bench serve`: load an OpenAI-compatible server and report its latencies.

Like vLLM's `vllm bench serve` (and SGLang's `bench_serving`): N prompts from a dataset
(`swaserve.bench.datasets`: random, shared-prefix, a JSONL file, a ShareGPT file) are sent as
streaming `/v1/completions` or `/v1/chat/completions` requests (`--endpoint-type`), at most C
at once, arriving as a Poisson process of rate R (all at once by default; `--burstiness`
makes the gaps gamma-distributed as vLLM does). Per request, from the SSE chunks:

- TTFT: from sending until the first chunk that carries a token;
- ITL: each later gap between chunks, divided among the tokens the chunk brought (one entry
  per token after the first; the server's `token_ids` count them, else one per chunk);
- E2EL: from sending until the stream ends;
- TPOT: (E2EL - TTFT) / (output tokens - 1), requests with one output token left out.

Token counts are the server's `usage` (`stream_options.include_usage`), else what streamed.
Reported: request, input, output and total token throughput, peak output tokens in one
second, peak requests in flight, and mean, median, std and percentiles (`--metric-percentiles`,
default 50,90,95,99) of TTFT, TPOT, ITL and E2EL, with vLLM's JSON keys (`mean_ttft_ms`,
`p99_tpot_ms`, ...). `--goodput ttft:MS tpot:MS e2el:MS` adds the request goodput: requests
meeting every given target per second (a one-token request's TPOT counts as 0, as in vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swaserve.bench.datasets import (
    DATASETS,
    BenchRequest,
    build_dataset,
    dataset_file,
    text_counter,
)

__all__ = ["BenchRequest", "Result", "add_args", "compute_metrics", "run_from_args"]

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# (JSON key, table label, section title) of each latency reported.
LATENCIES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)

_EPILOG = """\
datasets (--dataset):
  random         --input-len random words, --output-len tokens each
  shared-prefix  --num-prefixes prefixes of --prefix-len words + --input-len new words
  jsonl          --dataset-path FILE: one JSON object per line, e.g.
                   {"prompt": "Tell me about Paris.", "max_tokens": 64}
                   {"prompt": [1, 4093, 314]}            (token ids: completions only)
                   {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}
                 "messages" go to --endpoint-type chat as is; a text "prompt" goes there as
                 one user message; "max_tokens" defaults to --output-len
  sharegpt       --dataset-path FILE: [{"conversations": [{"from": "human", "value": ...},
                 {"from": "gpt", "value": ...}]}, ...]; the first human turn is the prompt,
                 the reply's length (tokens of --tokenizer or the served model, else words)
                 its max_tokens unless --sharegpt-output-len
examples:
  swaserve bench serve --endpoint-type chat --dataset sharegpt --dataset-path sg.json \\
      --num-prompts 200 --request-rate 8 --goodput ttft:500 tpot:50
"""


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: the prefix-cache hit
    streamed_tokens: int = 0  # tokens counted in the chunks (usage aside)
    spec: dict | None = None  # the server's speculative decoding counters (spec_decoding)
    start: float = 0.0  # perf_counter when sent
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # one entry per token after the first
    text: list[str] = field(default_factory=list)  # the streamed text (--response-format)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults after each flag's help, and the epilog's layout kept."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = _HelpFormatter
    p.epilog = _EPILOG
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--model", default=None, help="model name sent; None: the server's first")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument(
        "--endpoint-type",
        choices=list(ENDPOINTS),
        default="completions",
        help="stream /v1/completions or /v1/chat/completions",
    )
    p.add_argument(
        "--dataset",
        default="random",
        metavar="{" + ",".join(DATASETS) + "}",
        help="where prompts come from (see below)",
    )
    p.add_argument("--dataset-path", default=None, help="the jsonl or sharegpt file")
    p.add_argument("--num-prompts", type=int, default=100, help="requests sent")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at most")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 more even",
    )
    p.add_argument("--input-len", type=int, default=128, help="words per random prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
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
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: max_tokens of every request (None: each reply's length)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="sharegpt: count lengths with this model's tokenizer, a name swaserve resolves "
        "or a folder (None: the served model's, else words)",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="latency targets, KEY one of ttft, tpot, e2el: reports requests meeting all of "
        "them per second",
    )
    p.add_argument(
        "--metric-percentiles",
        default="50,90,95,99",
        help="comma-separated percentiles reported for every latency",
    )
    p.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (otherwise exactly max_tokens each)",
    )
    p.add_argument(
        "--response-format", choices=["text", "json_object"], default="text",
        help="json_object: every answer held to a JSON object (structured outputs); the "
        "summary adds the share of answers that parse",
    )
    p.add_argument("--seed", type=int, default=0, help="for prompts and arrival times")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="also write per-request lists: input_lens, output_lens, ttfts, itls, latencies",
    )
    p.add_argument(
        "--result-file",
        default=None,
        help="the JSON result (None: swaserve-bench-serve-<time>.json here)",
    )


# ---- flags ----------------------------------------------------------------------------------


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] (or "ttft:500,tpot:50") -> {"ttft": 500.0, "tpot": 50.0} in ms;
    ValueError naming --goodput otherwise."""
    out: dict[str, float] = {}
    for spec in (s for arg in specs or [] for s in arg.split(",") if s):
        key, sep, value = spec.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput {spec!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not milliseconds") from None
        if not 0 <= ms < math.inf:
            raise ValueError(f"--goodput {spec!r}: the target must be >= 0 ms")
        out[key] = ms
    return out


def parse_percentiles(spec: str) -> list[float]:
    """Parses "50,90,99" into [50.0, 90.0, 99.0]; ValueError naming --metric-percentiles."""
    try:
        ps = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        ps = []
    if not ps or not all(0 < p <= 100 for p in ps):
        raise ValueError(
            f"--metric-percentiles {spec!r}: expected numbers in (0, 100], e.g. 50,90,99"
        )
    return sorted(set(ps))


def check_args(args: argparse.Namespace) -> tuple[dict[str, float], list[float]]:
    """Every flag checked before connecting: (goodput targets, percentiles); ValueError naming
    the flag."""
    if args.num_prompts < 1 or args.max_concurrency < 1:
        raise ValueError("--num-prompts and --max-concurrency must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0")
    if not 0 < args.burstiness < math.inf:
        raise ValueError("--burstiness must be > 0")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        raise ValueError("--sharegpt-output-len must be >= 1")
    dataset_file(args)
    return parse_goodput(args.goodput), parse_percentiles(args.metric_percentiles)


# ---- one request ----------------------------------------------------------------------------


def request_body(req: BenchRequest, model: str, endpoint_type: str, ignore_eos: bool,
                 response_format: str = "text") -> dict:
    body: dict[str, Any] = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
        "return_token_ids": True,  # lets ITL count tokens, not chunks
    }
    if endpoint_type == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.max_tokens
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.max_tokens
    if response_format != "text":  # structured outputs: every answer held to JSON
        body["response_format"] = {"type": response_format}
    return body


def _chunk_text(choice: dict, chat: bool) -> str:
    return ((choice.get("delta") or {}).get("content") if chat else choice.get("text")) or ""


def _chunk_tokens(choice: dict, chat: bool) -> int:
    """Tokens one streamed choice brought: its token_ids, else 1 when it carries text."""
    ids = choice.get("token_ids")
    if ids is not None:
        return len(ids)
    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
    return 1 if text else 0


async def _one(client: Any, url: str, body: dict, timeout: float) -> Result:
    res = Result(start=time.perf_counter())
    chat = "messages" in body
    last = None
    usage = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                usage = chunk.get("usage") or usage
                res.spec = chunk.get("spec_decoding") or res.spec
                if "response_format" in body:
                    res.text.extend(_chunk_text(c, chat) for c in chunk.get("choices") or [])
                k = sum(_chunk_tokens(c, chat) for c in chunk.get("choices") or [])
                if k == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - res.start
                else:
                    res.itl.extend([(now - last) / k] * k)
                last = now
                res.streamed_tokens += k
        res.e2e = time.perf_counter() - res.start
        res.ok = last is not None
        if not res.ok:
            res.error = "no tokens received"
    except Exception as e:  # a failed request is counted, not fatal to the run
        res.error = f"{type(e).__name__}: {e}"
        return res
    if usage:
        res.prompt_tokens = usage.get("prompt_tokens") or 0
        res.output_tokens = usage.get("completion_tokens") or 0
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    else:  # a server without include_usage: what streamed (and a token-id prompt's length)
        res.output_tokens = res.streamed_tokens
        prompt = body.get("prompt")
        res.prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
    return res


# ---- metrics --------------------------------------------------------------------------------


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between closest ranks, as
    numpy.percentile; 0.0 for no values."""
    if not xs:
        return 0.0
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _pword(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def distribution(name: str, xs: list[float], percentiles: list[float]) -> dict[str, float]:
    """Seconds -> {mean,median,std,p<P>}_<name>_ms (population std; zeros for no values)."""
    n = len(xs)
    mean = sum(xs) / n if n else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / n) if n else 0.0
    out = {
        f"mean_{name}_ms": 1000 * mean,
        f"median_{name}_ms": 1000 * percentile(xs, 50),
        f"std_{name}_ms": 1000 * std,
    }
    for p in percentiles:
        out[f"p{_pword(p)}_{name}_ms"] = 1000 * percentile(xs, p)
    return out


def is_good(r: Result, goodput_ms: dict[str, float]) -> bool:
    """Whether a finished request meets every target (ms); a TPOT-less request's TPOT is 0."""
    value = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return all(value[k] * 1000 <= ms for k, ms in goodput_ms.items())


def peaks(ok: list[Result]) -> tuple[float, int]:
    """(most output tokens streamed within one second of the run, most requests in flight at
    once), from each request's start, TTFT and ITL."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start for r in ok)
    per_second: Counter[int] = Counter()
    events = []
    for r in ok:
        t = r.start + r.ttft
        per_second[int(t - t0)] += 1
        for gap in r.itl:
            t += gap
            per_second[int(t - t0)] += 1
        events += [(r.start, 1), (r.start + r.e2e, -1)]
    in_flight = most = 0
    for _, d in sorted(events):  # an end before a start at the same instant
        in_flight += d
        most = max(most, in_flight)
    return float(max(per_second.values())), most


def compute_metrics(
    results: list[Result],
    duration: float,
    percentiles: list[float],
    goodput_ms: dict[str, float] | None = None,
    structured: bool = False,
) -> dict[str, Any]:
    """Counts, throughputs and latency distributions of a run (vLLM's definitions and keys);
    failed requests count only as failed. `structured`: the answers were held to JSON
    objects; `json_valid_rate` is the share of completed ones that parse as one (an answer cut
    by max_tokens does not)."""
    ok = [r for r in results if r.ok]
    inp = sum(r.prompt_tokens for r in ok)
    out = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    peak_tokens, peak_requests = peaks(ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration": duration,
        "duration_s": duration,
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "total_cached_tokens": cached,
        "prefix_cache_hit_rate": cached / inp if inp else 0.0,
        "request_throughput": per_s(len(ok)),
        "request_goodput": None,
        "input_throughput": per_s(inp),
        "output_throughput": per_s(out),
        "total_token_throughput": per_s(inp + out),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "metric_percentiles": percentiles,
    }
    specs = [r.spec for r in ok if r.spec is not None]
    if specs:
        # Speculative decoding: tokens committed per verify step over the whole run.
        steps = sum(d["spec_verify_ct"] for d in specs)
        accepted = sum(d["spec_accepted_drafts"] for d in specs)
        proposed = sum(d["spec_proposed_drafts"] for d in specs)
        m.update(
            spec_verify_steps=steps, spec_accepted_drafts=accepted, spec_proposed_drafts=proposed,
            spec_accept_length=(accepted + steps) / steps if steps else None,
            spec_acceptance_rate=accepted / proposed if proposed else None,
        )
    if structured:
        m["json_valid_rate"] = sum(map(_is_json_object, ok)) / len(ok) if ok else 0.0
    if goodput_ms:
        good = sum(is_good(r, goodput_ms) for r in ok)
        m.update(request_goodput=per_s(good), good_requests=good, goodput_targets_ms=goodput_ms)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.e2e for r in ok],
    }
    for name, _, _ in LATENCIES:
        m.update(distribution(name, values[name], percentiles))
    return m


def _is_json_object(r: Result) -> bool:
    try:
        return isinstance(json.loads("".join(r.text)), dict)
    except ValueError:
        return False


def detailed(results: list[Result]) -> dict[str, list]:
    """Per-request lists (vLLM's names), in the order requests were built."""
    return {
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens if r.ok else 0 for r in results],
        "streamed_lens": [r.streamed_tokens for r in results],  # counted in the chunks
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.e2e for r in results],
        "start_times": [r.start for r in results],
        "request_errors": [r.error for r in results],
    }


# ---- the run --------------------------------------------------------------------------------


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


def _load(args: argparse.Namespace, model: str) -> tuple[list[list[BenchRequest]], str | None]:
    """The dataset, and for ShareGPT the unit its lengths were counted in."""
    if dataset_file(args)[0] != "sharegpt":
        return build_dataset(args), None
    count, unit = text_counter(args.tokenizer or model)
    if unit == "words":
        print(
            f"sharegpt: no tokenizer for {args.tokenizer or model}; lengths in words "
            "(give --tokenizer)",
            file=sys.stderr,
        )
    return build_dataset(args, count), unit


async def run(
    args: argparse.Namespace, goodput_ms: dict[str, float], percentiles: list[float]
) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    base = args.base_url.rstrip("/")
    url = base + ENDPOINTS[args.endpoint_type]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(1, args.max_concurrency) + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        model = await _probe(client, base, args.model)
        dataset, unit = _load(args, model)
        sem = asyncio.Semaphore(max(1, args.max_concurrency))
        rng = random.Random(args.seed + 1)
        bar = tqdm(
            total=sum(map(len, dataset)),
            desc="bench serve",
            unit="req",
            file=sys.stderr,
            disable=args.disable_tqdm,
        )

        async def limited(conv: list[BenchRequest]) -> list[Result]:
            out = []
            async with sem:  # a conversation keeps its slot: turn t+1 follows turn t
                for req in conv:
                    body = request_body(req, model, args.endpoint_type, not args.no_ignore_eos,
                                        args.response_format)
                    out.append(await _one(client, url, body, args.timeout))
                    bar.update(1)
            return out

        tasks = []
        start = time.perf_counter()
        for conv in dataset:
            tasks.append(asyncio.create_task(limited(conv)))
            if args.request_rate != float("inf"):
                shape = args.burstiness  # gamma gaps with mean 1 / rate; shape 1: Poisson
                await asyncio.sleep(rng.gammavariate(shape, 1 / (args.request_rate * shape)))
        results = [r for conv in await asyncio.gather(*tasks) for r in conv]
        duration = time.perf_counter() - start
        bar.close()
    summary: dict[str, Any] = {
        "backend": "swaserve",
        "base_url": args.base_url,
        "endpoint_type": args.endpoint_type,
        "model": model,
        "dataset": args.dataset,
        "dataset_path": args.dataset_path,
        "num_prompts": args.num_prompts,
        "num_requests": len(results),
        "max_concurrency": args.max_concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "burstiness": args.burstiness,
    }
    if unit is not None:
        summary["sharegpt_length_unit"] = unit
    summary.update(compute_metrics(results, duration, percentiles, goodput_ms,
                                   args.response_format != "text"))
    if args.save_detailed:
        summary.update(detailed(results))
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """The result table, laid out as vLLM's."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, v: Any) -> None:
        lines.append(
            f"{label + ':':<40} {v:<10.2f}"
            if isinstance(v, float)
            else f"{label + ':':<40} {v:<10}"
        )

    row("Successful requests", s["completed"])
    row("Failed requests", s["failed"])
    row("Endpoint", ENDPOINTS[s.get("endpoint_type", "completions")])
    row("Maximum request concurrency", s["max_concurrency"])
    if s.get("request_rate") is not None:
        row("Request rate configured (RPS)", float(s["request_rate"]))
    row("Benchmark duration (s)", s["duration"])
    row("Total input tokens", s["total_input_tokens"])
    row("Total generated tokens", s["total_output_tokens"])
    row("Cached prompt tokens", s["total_cached_tokens"])
    row("Prefix cache hit rate", s["prefix_cache_hit_rate"])
    row("Request throughput (req/s)", s["request_throughput"])
    if s.get("spec_verify_steps") is not None:
        row("Spec. decoding verify steps", s["spec_verify_steps"])
        if s["spec_accept_length"] is not None:
            row("Spec. decoding acceptance length", s["spec_accept_length"])
            row("Spec. decoding acceptance rate", s["spec_acceptance_rate"])
    if s.get("json_valid_rate") is not None:
        row("Valid JSON outputs (share)", s["json_valid_rate"])
    if s.get("request_goodput") is not None:
        row("Request goodput (req/s)", s["request_goodput"])
        targets = " ".join(f"{k}:{v:g}" for k, v in s["goodput_targets_ms"].items())
        row("Goodput targets (ms)", targets)
    row("Input token throughput (tok/s)", s["input_throughput"])
    row("Output token throughput (tok/s)", s["output_throughput"])
    row("Peak output token throughput (tok/s)", s["max_output_tokens_per_s"])
    row("Peak concurrent requests", s["max_concurrent_requests"])
    row("Total token throughput (tok/s)", s["total_token_throughput"])
    for name, label, title in LATENCIES:
        lines.append(f"{title:-^50}")
        row(f"Mean {label} (ms)", s[f"mean_{name}_ms"])
        if 50 not in s["metric_percentiles"]:  # else the P50 row says it
            row(f"Median {label} (ms)", s[f"median_{name}_ms"])
        for p in s["metric_percentiles"]:
            row(f"P{_pword(p)} {label} (ms)", s[f"p{_pword(p)}_{name}_ms"])
    lines.append("=" * 50)
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    goodput_ms, percentiles = check_args(args)
    summary = asyncio.run(run(args, goodput_ms, percentiles))
    print(format_summary(summary))
    path = args.result_file or time.strftime("swaserve-bench-serve-%Y%m%d-%H%M%S.json")
    Path(path).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"result written to {path}", file=sys.stderr)
    return 0 if summary["completed"] else 1
