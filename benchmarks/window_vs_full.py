"""GPU run: the window-aware KV pool against every layer full (`disable_hybrid_kv_cache`) under
the same KV budget, on the Gemma-3-27B shape (dummy bf16 weights, Triton attention, CUDA
graphs), context 8192.

1. Correctness: a tiny random Gemma 3 (float32, window 24, Triton attention on the GPU; torch
   attention on CPU) gives the same greedy tokens with the hybrid KV cache on and off, for
   prompts longer than the window (chunked prefill, CUDA graph decode on the GPU).
2. Per layout, one engine at a time (the first is freed before the second is built): KV pages
   and token slots, pages one 8k request holds, how many 8k requests the pool holds at once
   (swaserve.bench.memory: the real MemoryManager driven as the scheduler does), then N random
   prompts of context - 256 tokens + 256 new tokens (ignore_eos), all submitted at once: wall
   time, output and total tok/s, the most requests running / decoding at once, preemptions.

Prints progress to stderr and a markdown table last; writes $OUT/window_vs_full.json (OUT
defaults to ./bench_out). Exit code 1 if the correctness check fails.

Usage:  python benchmarks/window_vs_full.py [--num-requests 8] [--kv-cache-gb 10]
        python benchmarks/window_vs_full.py --tiny     (CPU smoke run: tiny model, few requests)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from swaserve import Engine, SamplingParams
from swaserve.bench.compare import (
    comparison_args,
    log,
    release_memory,
    run_variant,
    speed_ratios,
    write_record,
)
from swaserve.bench.memory import run_memory_bench
from swaserve.memory.manager import page_bytes
from swaserve.models.blocks import head_dim_of, layer_windows

TINY_WINDOW = 24
TINY_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def tiny_gemma3_folder(root: Path) -> Path:
    """A tiny Gemma 3 text model (window 24, 2 sliding : 1 full) with seeded random weights
    (std 0.2: peaked logits, so greedy tokens are a sharp check), saved as a HF folder."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=len(TINY_LAYER_TYPES),
        layer_types=TINY_LAYER_TYPES, sliding_window=TINY_WINDOW, query_pre_attn_scalar=16,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder = root / "tiny-gemma3"
    model.save_pretrained(folder)
    return folder


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def correctness(folder: Path, cuda: bool) -> dict[str, Any]:
    """Greedy tokens with the hybrid KV cache on vs off on the tiny model (must be equal)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (40, 77, 130, 33)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    backend = "triton" if cuda else "torch"
    toks = {}
    for off in (False, True):
        eng = Engine(
            model=str(folder), dtype="float32", attention_backend=backend, kv_cache_gb=0.05,
            max_num_batched_tokens=64, cuda_graph_max_bs=8, disable_hybrid_kv_cache=off,
        )
        groups = [(g.kind, len(g.layers)) for g in eng.core.layout.groups]
        toks[off] = [o.token_ids for o in eng.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
        eng.core.memory.check_integrity()
        log(f"correctness: hybrid {'off' if off else 'on'}: groups {groups}")
        del eng
        release_memory()
    same = sum(a == b for x, y in zip(toks[False], toks[True]) for a, b in zip(x, y))
    total = sum(len(x) for x in toks[False])
    return {"backend": backend, "prompt_lens": [len(p) for p in prompts],
            "window": TINY_WINDOW, "tokens_equal": same, "tokens_total": total,
            "passed": toks[False] == toks[True]}


def kv_info(engine: Engine, context: int, chunk: int, kv_gb: float) -> dict[str, Any]:
    """The pool as built, and how many `context`-token requests it holds (memory benchmark on
    the same layout, budget, page size and dtype)."""
    core, hf = engine.core, engine.core.hf_config
    stats = engine.memory_stats()
    layout, ps = core.layout, stats["page_size"]
    kv_heads, hd = hf.num_key_value_heads, head_dim_of(hf)
    dtype_bytes = core.kv.kv.element_size()
    mb = run_memory_bench(layer_windows(hf), ps, kv_heads, hd, context, kv_gb, chunk=chunk,
                          dtype_bytes=dtype_bytes)
    lay = mb["layout_all_full"] if engine.config.disable_hybrid_kv_cache else mb["layout"]
    if lay["num_pages"] != stats["pages_total"] + 1:  # + the NULL page
        log(f"note: memory benchmark sized {lay['num_pages']} pages, the engine "
            f"{stats['pages_total'] + 1}")
    steady = mb["bytes_per_request_all_full" if engine.config.disable_hybrid_kv_cache
                else "bytes_per_request"]
    return {
        "groups": [(g.kind, g.window, len(g.layers)) for g in layout.groups],
        "slots_per_page": layout.slots_per_page,
        "page_size": ps,
        "page_bytes": page_bytes(layout, ps, kv_heads, hd, dtype_bytes),
        "pages_total": stats["pages_total"],
        # token positions the pool can hold per layer slot; a request's token costs one slot
        # in each of its groups (all layers of a full-only layout share one page)
        "token_slots": stats["pages_total"] * ps,
        "pages_per_request": lay["pages_per_request"],
        "bytes_per_request": steady,
        "max_concurrent": (mb["max_concurrent_all_full"] if engine.config.disable_hybrid_kv_cache
                           else mb["max_concurrent"]),
        "fit_steady": stats["pages_total"] // lay["pages_per_request"],
    }


def main(argv: list[str] | None = None) -> int:
    args = comparison_args(argv, __doc__)
    cuda = torch.cuda.is_available()
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'cpu'}")
    tmp = tempfile.TemporaryDirectory()
    tiny = tiny_gemma3_folder(Path(tmp.name))

    check = correctness(tiny, cuda)
    log(f"correctness: {check['tokens_equal']}/{check['tokens_total']} tokens equal "
        f"({'PASS' if check['passed'] else 'FAIL'})")

    if args.tiny:
        model, context, n, new = str(tiny), 128, 4, 16
        layers, kv_heads, hd = len(TINY_LAYER_TYPES), 2, 16
        dbytes = 4 if not cuda else 2
        kv_gb = 2.5 * context * layers * 2 * kv_heads * hd * dbytes / 2**30  # ~2 full requests
        extra: dict[str, Any] = dict(max_num_batched_tokens=64, cuda_graph_max_bs=8)
    else:
        model, context, n, new, kv_gb = "gemma-3-27b", 8192, 8, 256, 10.0
        extra = dict(load_format="dummy", max_num_batched_tokens=8192, max_num_seqs=16,
                     cuda_graph_max_bs=16)
    context = args.context or context
    n = args.num_requests or n
    new = args.new_tokens or new
    kv_gb = args.kv_cache_gb or kv_gb
    chunk = extra["max_num_batched_tokens"]

    results: dict[str, Any] = {}
    for name, off in (("window-aware", False), ("all-full", True)):

        def make(off=off) -> Engine:
            return Engine(model=model, kv_cache_gb=kv_gb, max_model_len=context,
                          disable_prefix_cache=True, disable_hybrid_kv_cache=off, **extra)

        def describe(eng: Engine) -> tuple[dict[str, Any], str]:
            info = kv_info(eng, context, chunk, kv_gb)
            return info, (f"{info['pages_total']} pages, {info['pages_per_request']} per "
                          f"{context}-token request, holds {info['max_concurrent']} at once")

        def warm_tokens(eng: Engine) -> int:  # past the window: Triton compiles prefill shapes
            return 2 * (eng.core.hf_config.sliding_window or 64)

        results[name] = run_variant(name, make, describe, n, context, new, warm_tokens)

    a, b = results["window-aware"], results["all-full"]
    ratios = {
        **speed_ratios(a, b),
        "fit_steady": a["fit_steady"] / max(b["fit_steady"], 1),
        "bytes_per_request": b["bytes_per_request"] / a["bytes_per_request"],
    }
    record = {
        "model": model if not args.tiny else "tiny-gemma3", "context": context,
        "num_requests": n, "prompt_tokens": context - new, "new_tokens": new,
        "kv_cache_gb": kv_gb, "max_num_batched_tokens": chunk, "prefix_cache": False,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "correctness": check, "results": results, "ratios_window_over_full": ratios,
    }
    write_record(args.out, "window_vs_full.json", record)
    tmp.cleanup()

    mname = "tiny Gemma 3" if args.tiny else "Gemma-3-27B shape, dummy bf16"
    rows = [
        f"{mname}; {n} requests x ({context - new} prompt + {new} new), KV {kv_gb:g} GiB; "
        f"correctness (tiny Gemma 3, hybrid on vs off): {check['tokens_equal']}/"
        f"{check['tokens_total']} tokens equal, {'PASS' if check['passed'] else 'FAIL'}. "
        f"Requests held: {context}-token requests the pool takes one after another with "
        f"prefill chunks of {chunk} tokens (swaserve.bench.memory; a chunk needs pages in every "
        "group, SWA groups included, until it is computed); settled: pool pages / pages one "
        "finished request keeps.",
        "",
        "| KV layout | pages x bytes | pages / request | requests held (settled) | peak "
        "running (decoding) | preemptions | wall | output tok/s | total tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['pages_total']} x {fmt_bytes(r['page_bytes'])} | "
            f"{r['pages_per_request']} ({fmt_bytes(r['bytes_per_request'])}) | "
            f"{r['max_concurrent']} ({r['fit_steady']}) | {r['peak_running']} "
            f"({r['peak_decoding']}) | "
            f"{r['preemptions']} | {r['wall_s']:.1f} s | {r['output_tok_s']:,.0f} | "
            f"{r['total_tok_s']:,.0f} |"
        )
    rows.append(
        f"| ratio | | {ratios['bytes_per_request']:.2f}x smaller | "
        f"{ratios['max_concurrent']:.2f}x ({ratios['fit_steady']:.2f}x) | | | "
        f"{ratios['wall_s']:.2f}x faster | "
        f"{ratios['output_tok_s']:.2f}x | {ratios['total_tok_s']:.2f}x |"
    )
    print("\n".join(rows))
    return 0 if check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
