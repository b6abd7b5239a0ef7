"""GPU run: FP8 (e4m3) KV cache against bf16 KV under the same KV budget, on the Llama-3.1-8B
shape (dummy bf16 weights, Triton attention, CUDA graphs), context 16k.

1. Correctness: a tiny random Llama (float32 model, Triton attention on the GPU; torch on CPU),
   greedy tokens with fp8 KV (calibrated scales) vs float32 KV: the match rate is reported, not
   asserted (fp8 rounding may flip a near-tie and the sequences then diverge).
2. Per KV dtype, one engine at a time (the first is freed before the second is built): KV
   capacity in tokens (pages x page size of the engine's pool), how many 16k requests it holds
   at once (swaserve.bench.memory), then N random prompts of context - 256 tokens + 256 new
   tokens (ignore_eos), all submitted at once: wall time, output and total tok/s, the most
   requests running / decoding at once, preemptions.
   The fp8 engine gets kv_cache_scale=1.0 (one given scale for every layer): calibration on
   dummy weights measures nothing, and the timing does not depend on the scale's value.

Prints progress to stderr and a markdown table last; writes $OUT/fp8_vs_bf16.json (OUT
defaults to ./bench_out).

Usage:  python benchmarks/fp8_vs_bf16.py [--num-requests 16] [--kv-cache-gb 16]
        python benchmarks/fp8_vs_bf16.py --tiny     (CPU smoke run: tiny model, few requests)
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
from swaserve.models.blocks import head_dim_of, layer_windows


def tiny_llama_folder(root: Path) -> Path:
    """A tiny Llama with seeded random weights (std 0.2), saved as a HF folder."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=4, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    folder = root / "tiny-llama"
    model.save_pretrained(folder)
    return folder


def correctness(folder: Path, cuda: bool) -> dict[str, Any]:
    """Greedy tokens, fp8 KV (calibrated) vs the model dtype's KV (float32): match rate."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (20, 75, 140, 300)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    backend = "triton" if cuda else "torch"
    toks = {}
    for kv_dtype in ("auto", "fp8_e4m3"):
        eng = Engine(
            model=str(folder), dtype="float32", attention_backend=backend, kv_cache_gb=0.05,
            max_num_batched_tokens=128, cuda_graph_max_bs=8, kv_cache_dtype=kv_dtype,
        )
        toks[kv_dtype] = [o.token_ids for o in eng.generate(
            prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]
        eng.core.memory.check_integrity()
        del eng
        release_memory()
    a, b = toks["auto"], toks["fp8_e4m3"]
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    total = sum(len(s) for s in a)
    prefix = []
    for s, t in zip(a, b):
        k = 0
        while k < len(s) and k < len(t) and s[k] == t[k]:
            k += 1
        prefix.append(k)
    return {"backend": backend, "prompt_lens": [len(p) for p in prompts],
            "tokens_equal": same, "tokens_total": total, "match_rate": same / total,
            "common_prefix": prefix}


def kv_info(engine: Engine, context: int, chunk: int, kv_gb: float) -> dict[str, Any]:
    """The pool as built and how many `context`-token requests it holds."""
    core, hf = engine.core, engine.core.hf_config
    stats = engine.memory_stats()
    ps = stats["page_size"]
    kv_heads, hd = hf.num_key_value_heads, head_dim_of(hf)
    dtype_bytes = core.kv.kv.element_size()
    mb = run_memory_bench(layer_windows(hf), ps, kv_heads, hd, context, kv_gb, chunk=chunk,
                          dtype_bytes=dtype_bytes)
    if mb["layout"]["num_pages"] != stats["pages_total"] + 1:  # + the NULL page
        log(f"note: memory benchmark sized {mb['layout']['num_pages']} pages, the engine "
            f"{stats['pages_total'] + 1}")
    return {
        "kv_dtype": str(core.kv.kv.dtype).removeprefix("torch."),
        "kv_bytes_per_token": 2 * kv_heads * hd * dtype_bytes * hf.num_hidden_layers,
        "groups": [(g.kind, g.window, len(g.layers)) for g in core.layout.groups],
        "page_size": ps,
        "pages_total": stats["pages_total"],
        # tokens the pool holds when its groups share it evenly (one group for Llama)
        "capacity_tokens": stats["pages_total"] * ps // core.layout.num_groups,
        "pages_per_request": mb["layout"]["pages_per_request"],
        "max_concurrent": mb["max_concurrent"],
        "fit_steady": stats["pages_total"] // mb["layout"]["pages_per_request"],
        "k_scale_layer0": core.kv.layer_scales(0)[0],
    }


def main(argv: list[str] | None = None) -> int:
    args = comparison_args(argv, __doc__)
    cuda = torch.cuda.is_available()
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'cpu'}")
    tmp = tempfile.TemporaryDirectory()
    tiny = tiny_llama_folder(Path(tmp.name))

    check = correctness(tiny, cuda)
    log(f"correctness: fp8 vs float32 KV {check['tokens_equal']}/{check['tokens_total']} "
        f"greedy tokens equal, common prefixes {check['common_prefix']}")

    if args.tiny:
        # bf16 model so that the baseline KV is bf16 as on the GPU (fp8 halves it)
        model, context, n, new = str(tiny), 256, 4, 16
        kv_gb = 2.5 * context * 4 * 2 * 2 * 16 * 2 / 2**30  # ~2 bf16 requests
        extra: dict[str, Any] = dict(dtype="bfloat16", max_num_batched_tokens=128,
                                     cuda_graph_max_bs=8)
    else:
        model, context, n, new, kv_gb = "llama-3.1-8b", 16384, 16, 256, 16.0
        extra = dict(load_format="dummy", max_num_batched_tokens=8192)
    context = args.context or context
    n = args.num_requests or n
    new = args.new_tokens or new
    kv_gb = args.kv_cache_gb or kv_gb
    if not args.tiny:
        extra.update(max_num_seqs=max(16, n), cuda_graph_max_bs=max(16, n))
    chunk = extra["max_num_batched_tokens"]

    results: dict[str, Any] = {}
    for name, kv_dtype in (("bf16", "auto"), ("fp8_e4m3", "fp8_e4m3")):
        scale = {"kv_cache_scale": 1.0} if kv_dtype != "auto" else {}

        def make(kv_dtype=kv_dtype, scale=scale) -> Engine:
            return Engine(model=model, kv_cache_gb=kv_gb, max_model_len=context,
                          disable_prefix_cache=True, kv_cache_dtype=kv_dtype, **scale, **extra)

        def describe(eng: Engine) -> tuple[dict[str, Any], str]:
            info = kv_info(eng, context, chunk, kv_gb)
            return info, (f"{info['pages_total']} pages = {info['capacity_tokens']} tokens, "
                          f"holds {info['max_concurrent']} {context}-token requests at once")

        results[name] = run_variant(name, make, describe, n, context, new, lambda eng: 2048)

    a, b = results["fp8_e4m3"], results["bf16"]
    ratios = {"capacity_tokens": a["capacity_tokens"] / b["capacity_tokens"],
              **speed_ratios(a, b)}
    record = {
        "model": model if not args.tiny else "tiny-llama", "context": context,
        "num_requests": n, "prompt_tokens": context - new, "new_tokens": new,
        "kv_cache_gb": kv_gb, "max_num_batched_tokens": chunk, "prefix_cache": False,
        "fp8_scale": "kv_cache_scale=1.0 for every layer (no calibration on dummy weights)",
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "correctness": check, "results": results, "ratios_fp8_over_bf16": ratios,
        "capacity_target_met": ratios["capacity_tokens"] >= 1.9,
    }
    write_record(args.out, "fp8_vs_bf16.json", record)
    tmp.cleanup()

    mname = "tiny Llama (bf16)" if args.tiny else "Llama-3.1-8B shape, dummy bf16 weights"
    rows = [
        f"{mname}; {n} requests x ({context - new} prompt + {new} new), KV {kv_gb:g} GiB, "
        "fp8 with kv_cache_scale=1.0 (not calibrated); correctness (tiny Llama, float32 model, "
        f"fp8 vs float32 KV, calibrated): {check['tokens_equal']}/{check['tokens_total']} "
        f"greedy tokens equal ({check['match_rate']:.0%})",
        "",
        f"| KV dtype | bytes/token | capacity (tokens) | {context}-token requests held | peak "
        "running (decoding) | preemptions | wall | output tok/s | total tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['kv_bytes_per_token']:,} B | {r['capacity_tokens']:,} | "
            f"{r['max_concurrent']} | {r['peak_running']} ({r['peak_decoding']}) | "
            f"{r['preemptions']} | {r['wall_s']:.1f} s | {r['output_tok_s']:,.0f} | "
            f"{r['total_tok_s']:,.0f} |"
        )
    rows.append(
        f"| fp8 / bf16 | | **{ratios['capacity_tokens']:.2f}x** (target >= 1.9x) | "
        f"{ratios['max_concurrent']:.2f}x | | | {ratios['wall_s']:.2f}x faster | "
        f"{ratios['output_tok_s']:.2f}x | {ratios['total_tok_s']:.2f}x |"
    )
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
