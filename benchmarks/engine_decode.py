"""GPU run, first priority: batch-1 decode of the Llama-3.1-8B shape (dummy bf16 weights,
Triton attention, CUDA graphs) against the bandwidth roofline, with the overlap schedule and
the fused ops each switched off in turn, plus a batch-64 decode and a kernel profile of the
graphed decode step. The KV pool is sized by the profiling pass (`gpu_memory_utilization`).

Correctness first: the fused-ops engine and the eager-ops engine (same dummy weights, same
seed) must agree on the logits of a prompt; with overlap on and off greedy tokens must agree.
Prints a table last; JSON to $OUT/engine_decode.json.
Usage: PYTHONPATH=. python benchmarks/engine_decode.py [--quick]
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

from swaserve import Engine, SamplingParams
from swaserve.bench.offline import copy_bandwidth, generate_timed

PROMPT = [list(range(1000, 1128))]


def per_token(engine: Engine, prompts: list[list[int]], n: int = 129) -> float:
    """Seconds per decode step: (time for n tokens - time for 1) / (n - 1), after warm-up."""
    def timed(k: int) -> float:
        return generate_timed(engine, prompts, [k] * len(prompts))

    timed(8)
    t1 = min(timed(1) for _ in range(2))
    tn = timed(n)
    return (tn - t1) / (n - 1)


def greedy(engine: Engine, n: int = 32) -> list[int]:
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return engine.generate(prompt_token_ids=PROMPT, sampling_params=p, use_tqdm=False)[0].token_ids


def kernel_profile(engine: Engine, steps: int = 20) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    p = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt_token_ids=PROMPT, sampling_params=p, use_tqdm=False)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    lines = [f"GPU kernel time per decode step ~{total / steps / 1e3:.2f} ms (all kernels/"
             f"{steps} steps; prefill included)"]
    for e in events[:12]:
        lines.append(f"  {e.device_time_total / steps:8.1f} us/step  {e.count / steps:6.1f}/step  "
                     f"{e.key[:90]}")
    return lines


def main() -> int:
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    bw = copy_bandwidth(torch.device("cuda"))
    res: dict = {"copy_bw_GBps": bw / 1e9}
    kw = dict(model="llama-3.1-8b", load_format="dummy", max_model_len=4096,
              cuda_graph_max_bs=64, max_num_seqs=64, gpu_memory_utilization=0.9, seed=0)

    t = time.perf_counter()
    eng = Engine(**kw)
    res["start_s"] = time.perf_counter() - t
    res["kv_pages"] = eng.memory_stats()["pages_total"]
    weight_bytes = sum(p.numel() * p.element_size() for p in eng.core.model.parameters())
    roof = weight_bytes / bw
    print(f"engine up in {res['start_s']:.1f} s, KV pages {res['kv_pages']}", flush=True)

    # Correctness: overlap on vs off, same greedy tokens; logits fused vs eager ops below.
    a = greedy(eng)
    eng.core.config.disable_overlap_schedule = True
    b = greedy(eng)
    res["greedy_overlap_vs_sync_equal"] = sum(x == y for x, y in zip(a, b))

    rows = []
    for label, overlap in (("graphs + overlap + fused", True), ("graphs + fused, no overlap",
                                                                 False)):
        eng.core.config.disable_overlap_schedule = not overlap
        s = per_token(eng, PROMPT)
        rows.append((label, s))
        print(f"{label}: {s * 1e3:.2f} ms/token", flush=True)
    eng.core.config.disable_overlap_schedule = False
    prompts64 = [list(range(1000 + i, 1256 + i)) for i in range(64)]
    s64 = per_token(eng, prompts64, 129)
    res["batch64_ms_per_step"] = s64 * 1e3
    res["batch64_tok_s"] = 64 / s64
    prof_lines = kernel_profile(eng)
    print("\n".join(prof_lines), flush=True)
    from tests.helpers import engine_prompt_logits

    ids = list(range(2000, 2300))
    logits_fused = engine_prompt_logits(eng, ids).float().cpu()
    del eng
    gc.collect()
    torch.cuda.empty_cache()

    err = scale = float("nan")
    if "--quick" not in sys.argv:  # --quick: skip the eager-ops engine
        eng = Engine(**kw, disable_fused_ops=True)
        logits_eager = engine_prompt_logits(eng, ids).float().cpu()
        err = (logits_fused - logits_eager).abs().max().item()
        scale = logits_eager.abs().max().item()
        s = per_token(eng, PROMPT)
        rows.append(("graphs + overlap, eager ops", s))
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    res["fused_vs_eager_max_abs_logit_diff"] = err
    res["logit_scale"] = scale

    res["rows"] = {label: s * 1e3 for label, s in rows}
    res["roofline_ms"] = roof * 1e3
    with open(os.path.join(out_dir, "engine_decode.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB; "
          f"roofline {roof * 1e3:.2f} ms/token")
    print(f"greedy tokens overlap vs sync equal: {res['greedy_overlap_vs_sync_equal']}/32; "
          f"fused vs eager ops max |logit diff| {err:.3g} (logit scale {scale:.3g})")
    print("\n| batch-1 decode, Llama-3.1-8B shape, bf16 | ms/token | efficiency |")
    print("|---|---|---|")
    for label, s in rows:
        print(f"| {label} | {s * 1e3:.2f} | {roof / s:.1%} |")
    print(f"| batch 64 x (256 in, 128 out), overlap + fused | {s64 * 1e3:.2f} ms/step | "
          f"{64 / s64:.0f} tok/s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
