"""CPU, no model: a vs_vllm.py workload driven through the real Scheduler and MemoryManager at
the real page geometry, with each step timed by a roofline cost model of the GPU. Where the
time of a run goes by step kind, how many requests decode at once, how many are preempted, for
scheduler settings a GPU lease cannot afford to try one by one (`--kv-bound-step-tokens`).

The loop: schedule; every scheduled request computes its chunk; one that reaches its known
tokens samples one more (no overlap schedule: a request finishes in the step that samples its
last token); retire. Step cost (ms), from the model's shape and the GPU's measured ceilings:

    GEMMs      (w^p + c^p)^(1/p), p = RIDGE_P: w = weight bytes / bandwidth, c = 2 x params x
               tokens / flops (neither bound is reached near the ridge: 1.64x there)
    decodes    the K/V bytes they read (each layer's keys, a window bounds them) / bandwidth
    chunks     4 x tokens x keys x heads x head_dim per layer / attention flops, the rate
               falling for chunks of few query blocks (sqrt(tokens / 512), at most 1)
    per step   STEP_MS (norms, rotary, sampling, the launch)

Calibrated only loosely (H200: a Gemma-3-27B decode step of 17 requests 21.4 ms, a 5.5k-token
prefill step 482 ms, benchmarks/RESULTS.md stops 24/27): a guide to where a run's time goes
and how settings compare, **not** a measurement; the GPU decides. Against the GPU so far
(RESULTS.md, 2026-12-06), predicted / measured at p = 1.4: fp8-16k on an H100, cap off 145.0 /
145.1 s, 7 / 7 preemptions; R = 192 154.2 / 155.5 s, 9 / 9 preemptions (the scheduler's
dynamics come out exactly). Gemma-3-27B hybrid-decode, cap off: H200 92.2 / 96.9 s (stop
27), H100 114.6 / 122.4; prefill ahead 128 on the H100 (24 GiB host tier) 119.5 / ~123.
The offline run: 43.9 / 46.4-46.9 s (stop 31): the model knows no host time. p was 3 until
the H100 profile of prefill ahead (stop 50's session): a step of 16 Gemma decodes and a
112-token chunk took 33.4 ms against 27.2 for the decodes alone, where p = 3 put the chunk's
GEMM rows at +1.7 ms; p = 3 gave 108.8 s for that run, 97.6 with the 40 GiB host tier
that vs_vllm.py measured at 136.8 (fp8-16k R = 192: 142.9).

`--host-gib G` runs the real radix cache with a host tier of G GiB over a stand-in pool (distinct
prompts; stores to the host stall a step, loads ride beside it at PCIE), which
`--prefill-ahead-tokens R` (the scheduler's prefill ahead) needs.

`--floor` prints instead the least time any schedule of the workload could take at the GPU's
ceilings (`floor`): how far a measured run, and the peer's, are from what kernels run one after
another can reach.

Usage: PYTHONPATH=.:benchmarks python benchmarks/schedule_sim.py --workload hybrid-decode \
           --gpu h200 [--kv-bound-step-tokens 0 192 ...] [--host-gib 40 --prefill-ahead-tokens 128]
           [--floor]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from swaserve.bench.memory import layer_windows_from_config
from swaserve.engine.request import Request
from swaserve.engine.scheduler import Scheduler, _decoding
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import MemoryManager, num_pages_for_bytes, page_bytes
from swaserve.sampling.params import SamplingParams

CONFIGS = Path(__file__).resolve().parent.parent / "swaserve" / "configs"
STEP_MS = 0.8
# How a step's weight reads and GEMM FLOPs combine (docstring): fitted to the measured cost of
# small mixed steps (rows 100-200: past the weight-read time, short of the FLOP rate)
RIDGE_P = 1.4
PCIE = 40e9  # bytes/s between host and device, each way (PCIe 5.0 x16, pinned memory)


@dataclass(frozen=True)
class Gpu:
    bandwidth: float  # bytes/s reached by weight and K/V reads
    gemm_flops: float  # bf16 GEMMs at large M
    attn_flops: float  # prefill attention at large chunks
    copy_ceiling: float  # bytes/s of a device copy (`floor`)
    matmul_ceiling: float  # the best bf16 matmul's FLOP/s (`floor`)


# H200 ceilings: measured on the lent machines (the project brief: copy ~4,200 GB/s, bf16
# matmul ~760 TFLOP/s); the H100's are not measured here: its model rates are reused
GPUS = {"h200": Gpu(3.9e12, 700e12, 350e12, 4.2e12, 760e12),
        "h100": Gpu(3.0e12, 600e12, 300e12, 3.0e12, 600e12)}
# workload: (config, KV GiB, requests, prompt, output, step token budget); offline: the
# peer's 1,000 requests (lengths U[100, 1024], step_profile.make_requests) in the pool the
# engine's default profile gave on an H200 (752,064 tokens), queued longest output first
WORKLOADS = {
    "offline": ("llama-3.1-8b", 752064 * 128 * 1024 / 2**30, 1000, 0, 0, 16384),
    "hybrid-decode": ("gemma-3-27b", 20, 48, 7936, 1024, 8192),
    "hybrid-prefill": ("gemma-3-27b", 20, 48, 7936, 256, 8192),
    "fp8-16k": ("llama-3.1-8b", 16, 64, 16000, 1024, 8192),
}


def params_of(cfg: dict) -> float:
    """Weights read each step (embeddings once, as the head)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return layers * per_layer + cfg["vocab_size"] * h


def _lengths(workload: str) -> list[tuple[int, int]]:
    """(prompt, output) tokens per request, in queue order."""
    _, _, n, plen, olen, _ = WORKLOADS[workload]
    if workload != "offline":
        return [(plen, olen)] * n
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # imported from elsewhere (tests): step_profile sits beside it
        sys.path.append(here)
    from step_profile import make_requests

    return sorted(((len(ids), o) for ids, o in make_requests(n)), key=lambda x: -x[1])


def floor(workload: str, gpu: Gpu) -> dict:
    """The least time any schedule of the workload takes on an engine whose kernels run one
    after another (GEMMs, then attention: vLLM, SGLang and swaserve alike), every kernel at
    the GPU's ceiling and no time between them; no preemption, no speculation.

        GEMMs      max(S x weights / copy, linear FLOPs / matmul): a step reads the weights
                   once, the layers' FLOPs for every prompt and fed-back token, the head's for
                   sampled ones. S, the decode steps, is at least the longest output (a token
                   a request a step) and the K/V that decoding requests hold, summed over
                   their decode steps, over the pool (a full pool every step)
        attention  each decode token's K/V reads (a window bounds its layers') / copy, plus
                   the prompts' causal attention FLOPs / matmul
    With attention run beside the GEMMs (NanoFlow's nano-batches) only the larger of the
    two bounds would stay: `overlapped_s`."""
    name, kv_gib = WORKLOADS[workload][:2]
    pool_bytes = kv_gib * 2**30
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    windows = layer_windows_from_config(cfg)
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    qd, kv_bytes = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d * 2 * 2
    head = cfg["vocab_size"] * cfg["hidden_size"]
    body = params_of(cfg) - head
    lengths = _lengths(workload)
    prompt, output = sum(p for p, _ in lengths), sum(o for _, o in lengths)
    gemm_flops = 2 * body * (prompt + output - len(lengths)) + 2 * head * output

    def keys(win: int | None, first: int, count: int) -> float:
        """Keys attended by queries at positions first .. first + count - 1, summed."""
        last = first + count - 1
        if count <= 0:
            return 0.0
        if win is None or last < win:
            return count * (first + last + 2) / 2
        if first >= win - 1:
            return count * win
        return keys(win, first, win - first) + keys(win, win, count - (win - first))

    kv_read = attn_flops = held = 0.0
    for p, o in lengths:
        for win in windows:
            attn_flops += 4 * qd * keys(win, 0, p)  # QK^T and PV of every prompt query
            kv_read += kv_bytes * keys(win, p, o - 1)  # decode queries at p .. p + o - 2
            held += kv_bytes * keys(win, p - 1, o)  # what decode step j holds: p + j tokens
    steps = max(max(o for _, o in lengths), held / pool_bytes)
    gemm_s = max(steps * 2 * params_of(cfg) / gpu.copy_ceiling, gemm_flops / gpu.matmul_ceiling)
    attn_s = kv_read / gpu.copy_ceiling + attn_flops / gpu.matmul_ceiling
    return {
        "workload": workload, "floor_s": round(gemm_s + attn_s, 1),
        "gemm_s": round(gemm_s, 1), "attention_s": round(attn_s, 1), "decode_steps": round(steps),
        "overlapped_s": round(max(gemm_s, attn_s), 1),
        "floor_total_tok_per_s": round((prompt + output) / (gemm_s + attn_s), 1),
        "floor_output_tok_per_s": round(output / (gemm_s + attn_s), 1),
    }  # fmt: skip


def _host_cache(memory: MemoryManager, layout, ps: int, pages: int, host_pages: int):
    """The real radix cache with a host tier over a stand-in pool of the same page geometry
    (one head of one byte: the cache moves pages, their contents do not matter here)."""
    import torch

    from swaserve.memory.host_cache import OffloadPool, device_page_shape
    from swaserve.memory.kv_pool import KVPool
    from swaserve.memory.radix_cache import RadixCache

    kv = KVPool(layout, pages, ps, 1, 1, torch.uint8, torch.device("cpu"))
    return RadixCache(memory, kv, [OffloadPool("host", host_pages, device_page_shape(kv))])


def simulate(workload: str, gpu: Gpu, kv_bound: int, conservativeness: float = 1.0,
             host_gib: float = 0.0, max_num_seqs: int = 1024, ahead: int = 0) -> dict:
    """One run of the workload. `host_gib` > 0: the prefix cache with a host tier of that
    size (distinct prompts, so its hits are requests coming back after a preemption: their
    K/V, evicted to the host, loads back instead of being computed again); stores to the host
    stall the step (the forward waits for them), loads ride beside it at PCIE bytes/s.
    `ahead`: the scheduler's prefill_ahead_tokens (needs `host_gib`)."""
    name, kv_gib, n, plen, olen, budget = WORKLOADS[workload]
    cfg = json.loads((CONFIGS / name / "config.json").read_text())
    windows = layer_windows_from_config(cfg)
    hkv = cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = cfg["num_attention_heads"]
    layout = build_layout(windows)
    ps = 16
    pages = num_pages_for_bytes(layout, ps, hkv, d, 2, kv_gib * 2**30)
    memory = MemoryManager(layout, ps, pages, watermark_pages=len(layout.groups))
    real_page = page_bytes(layout, ps, hkv, d, 2)
    cache = None
    if host_gib > 0:
        cache = _host_cache(memory, layout, ps, pages, int(host_gib * 2**30 // real_page))
    sched = Scheduler(memory, max_num_seqs, budget, cache, conservativeness, "fcfs", kv_bound,
                      ahead)  # fmt: skip
    lengths = _lengths(workload)
    rng = random.Random(0)
    for i, (pl, ol) in enumerate(lengths):
        p = SamplingParams(max_tokens=ol, ignore_eos=True, temperature=0)
        ids = [rng.randrange(1000) for _ in range(pl)] if cache is not None else [7] * pl
        sched.add(Request(str(i), ids, p, ol))
    moved = [0, 0]  # pages stored to / loaded from the host so far
    weights = params_of(cfg) * 2
    flops_per_token = 2 * params_of(cfg)
    kv_bytes = hkv * d * 2 * 2  # K and V of one token in one layer, bf16
    totals = {"steps": 0, "ms": 0.0, "decode_tokens": 0, "prefill_tokens": 0, "mixed": 0,
              "decode_only": 0, "prefill_only": 0, "decode_batch_sum": 0, "host_stores": 0,
              "host_loads": 0}  # fmt: skip
    while sched.has_unfinished():
        decoding = {id(r) for r in sched.running if _decoding(r)}
        batch = sched.schedule()
        if not batch:
            raise RuntimeError("an empty step with requests unfinished")
        if cache is not None:
            cache.move_pages()
        tokens = sum(batch.num_new_tokens)
        ms = STEP_MS
        w, c = weights / gpu.bandwidth, flops_per_token * tokens / gpu.gemm_flops
        ms += 1e3 * (w**RIDGE_P + c**RIDGE_P) ** (1 / RIDGE_P)
        dec = pre = 0
        for req, k in zip(batch.requests, batch.num_new_tokens):
            ctx = req.num_computed_tokens
            if id(req) in decoding:
                dec += 1
                keys = sum(ctx + 1 if win is None else min(ctx + 1, win) for win in windows)
                ms += 1e3 * keys * kv_bytes / gpu.bandwidth
            else:
                pre += k
                rate = gpu.attn_flops * min(1.0, (k / 512) ** 0.5)
                for win in windows:
                    keys = ctx + k / 2 if win is None else min(ctx + k / 2, win)
                    ms += 1e3 * 4 * k * keys * heads * d / rate
            req.num_computed_tokens += k
        if cache is not None:
            stored, loaded = cache.stored_pages - moved[0], cache.loaded_pages - moved[1]
            moved = [cache.stored_pages, cache.loaded_pages]
            ms += 1e3 * stored * real_page / PCIE  # the forward waits for the stores
            ms = max(ms, 1e3 * loaded * real_page / PCIE)  # loads overlap it
            totals["host_stores"] += stored
            totals["host_loads"] += loaded
        totals["ms"] += ms
        totals["steps"] += 1
        totals["decode_tokens"] += dec
        totals["prefill_tokens"] += pre
        totals["decode_batch_sum"] += dec
        kind = "mixed" if dec and pre else "decode_only" if dec else "prefill_only"
        totals[kind] += 1
        for req in list(batch.requests):
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(7)
                if len(req.output_token_ids) >= req.max_tokens:
                    sched.finish(req)
        sched.retire()
    seconds = totals["ms"] / 1e3
    return {
        "workload": workload, "kv_bound_step_tokens": kv_bound, "seconds": round(seconds, 1),
        "total_tok_per_s": round(sum(a + b for a, b in lengths) / seconds, 1),
        "output_tok_per_s": round(sum(b for _, b in lengths) / seconds, 1),
        "steps": totals["steps"], "mixed": totals["mixed"],
        "decode_only": totals["decode_only"], "prefill_only": totals["prefill_only"],
        "mean_decode_batch": round(totals["decode_batch_sum"] / max(1, totals["steps"]), 1),
        "prefill_tokens": totals["prefill_tokens"], "preemptions": sched.num_preemptions,
        "parks": sched.num_parks,
        "host_gib_moved": round((totals["host_stores"] + totals["host_loads"]) * real_page
                                / 2**30, 1),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="hybrid-decode")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    ap.add_argument("--kv-bound-step-tokens", type=int, nargs="+", default=[0, 192])
    ap.add_argument("--schedule-conservativeness", type=float, default=1.0)
    ap.add_argument("--host-gib", type=float, default=0.0,
                    help="the prefix cache with a host tier of this many GiB (0: no cache)")
    ap.add_argument("--prefill-ahead-tokens", type=int, default=0,
                    help="the scheduler's prefill ahead (needs --host-gib)")
    ap.add_argument("--floor", action="store_true",
                    help="only the workload's floor at the GPU's ceilings (`floor`)")
    args = ap.parse_args()
    if args.floor:
        print(json.dumps(floor(args.workload, GPUS[args.gpu])))
        return
    rows = [simulate(args.workload, GPUS[args.gpu], r, args.schedule_conservativeness,
                     args.host_gib, ahead=args.prefill_ahead_tokens)
            for r in args.kv_bound_step_tokens]  # fmt: skip
    for row in rows:
        print(json.dumps(row))
    keys = ["kv_bound_step_tokens", "seconds", "total_tok_per_s", "output_tok_per_s", "steps",
            "mixed", "decode_only", "prefill_only", "mean_decode_batch", "preemptions", "parks",
            "host_gib_moved"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
