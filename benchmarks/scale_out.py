"""Scale-out layouts side by side (issues 12 and 16): tensor parallelism against data-parallel
attention + expert-parallel MoE on one model shape, the same requests for every layout.

Layouts: `tpT` (`-tp T`), `dpD-ep` (`-dp D --enable-expert-parallel`, the decode-only
workspace cap at its default), `dpD-ep-nocap` (`--moe-decode-max-tokens-per-rank 0`),
`dpD-tpT` (`-dp D -tp T --enable-expert-parallel`: attention TP inside each data-parallel
rank, the experts over all D x T). The spec step drafts (n-gram) under every layout; with
`-tp` rank 0 of each tensor-parallel group drafts and accepts. A layout or step the engine
refuses is a row with its error. Steps (each layout x
step in a fresh process under --step-timeout, so a hang or a crash costs one row, never the
run):

  throughput-C  C requests at once (max_num_seqs C), prompt and output lengths U[100, 1024]
                (random.Random(0)): output tok/s
  long          --long-requests x (16,000 + 256): total tok/s (where per-rank window-aware
                pools matter: gpt-oss alternates window-128 and full layers)
  latency       16 requests of 128 tokens: ms per decode step, (t(129 new) - t(1 new)) / 128
  spec          n-gram drafting on repetitive prompts (a 64-token passage 8 times, 64
                requests, 256 new tokens, every step drafting): output tok/s, committed
                tokens per verify step, per DP rank

Every row also carries the engine's start time and memory (`memory_stats()`: KV pages per
rank, the MoE workspace). Correctness first: before timing, each layout's greedy tokens on
four prompts are compared with the first layout's (`tokens_equal`; bf16 near-ties may flip a
token late in a dummy-weight run, so it is a report, not a gate). Prints a table last; JSON
lines to $OUT/scale_out.jsonl.

Usage (repo root):
  python3 benchmarks/scale_out.py --model gpt-oss-120b --layouts tp8 dp8-ep dp8-ep-nocap \\
      dp4-tp2 --steps throughput-512 throughput-2048 long latency spec     # 8 GPUs
  python3 benchmarks/scale_out.py --model qwen3-30b-a3b --layouts tp2 dp2-ep     # 2 GPUs
  python3 benchmarks/scale_out.py --tiny     # CPU, gloo: a tiny random gpt-oss, 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from child_run import record, run_child  # noqa: E402

CHECK_PROMPTS = 4


def layout_kwargs(layout: str) -> dict:
    """Engine keywords of a layout name; ValueError for a name that is none."""
    if m := re.fullmatch(r"tp(\d+)", layout):
        return {"tensor_parallel_size": int(m[1])}
    if m := re.fullmatch(r"dp(\d+)-ep(-nocap)?", layout):
        kw: dict = {"data_parallel_size": int(m[1]), "enable_expert_parallel": True}
        if m[2]:
            kw["moe_decode_max_tokens_per_rank"] = 0
        return kw
    if m := re.fullmatch(r"dp(\d+)-tp(\d+)", layout):
        return {"data_parallel_size": int(m[1]), "tensor_parallel_size": int(m[2]),
                "enable_expert_parallel": True}  # fmt: skip
    raise ValueError(f"unknown layout {layout!r} (tpT, dpD-ep, dpD-ep-nocap, dpD-tpT)")


def requests_for(
    step: str, vocab: int, tiny: bool, long_requests: int
) -> tuple[list[list[int]], list[int], int]:
    """(prompts, max_tokens, max_num_seqs) of a step; the same for every layout."""
    rng = random.Random(0)
    lo, hi = (8, 40) if tiny else (100, 1024)

    def ids(n: int) -> list[int]:
        return [rng.randint(3, vocab - 3) for _ in range(n)]

    if m := re.fullmatch(r"throughput-(\d+)", step):
        c = int(m[1])
        lens = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(c)]
        return [ids(p) for p, _ in lens], [o for _, o in lens], c
    if step == "long":
        n = long_requests
        plen, olen = (120, 8) if tiny else (16000, 256)
        return [ids(plen) for _ in range(n)], [olen] * n, n
    if step == "latency":
        return [ids(16 if tiny else 128) for _ in range(16)], [0] * 16, 16  # 0: set by run
    if step == "spec":
        n, plen = (8, 16) if tiny else (64, 64)
        prompts = [ids(plen) * 8 for _ in range(n)]
        return prompts, [32 if tiny else 256] * n, n
    raise ValueError(f"unknown step {step!r}")


def build(model: str, layout: str, step: str, tiny: bool, max_num_seqs: int, max_len: int):
    from swaserve import Engine

    kw = dict(model=model, load_format="auto" if tiny else "dummy", seed=0,
              max_num_seqs=max(16, max_num_seqs), max_model_len=max_len,
              disable_prefix_cache=True, **layout_kwargs(layout))  # fmt: skip
    if tiny:
        kw.update(device="cpu", dtype="float32", kv_cache_gb=0.05, max_num_batched_tokens=64)
    if step == "spec":
        kw.update(speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                  disable_adaptive_speculation=True)  # fmt: skip
    return Engine(**kw)


def run_step(model: str, layout: str, step: str, tiny: bool, long_requests: int) -> dict:
    """One layout on one step, in this process: the result row."""
    from swaserve import SamplingParams
    from swaserve.engine.engine import resolve_folder
    from swaserve.weights.loader import load_hf_config

    vocab = load_hf_config(resolve_folder(model)).vocab_size
    prompts, max_tokens, seqs = requests_for(step, vocab, tiny, long_requests)
    max_len = max(len(p) for p in prompts) + max(max(max_tokens), 129) + 16
    t0 = time.perf_counter()
    engine = build(model, layout, step, tiny, seqs, max_len)
    row: dict = {"layout": layout, "step": step, "start_s": round(time.perf_counter() - t0, 1)}
    ranks: dict[str, int] = {}  # core request id (Engine: "<request id>-<sample>") -> rank
    core = engine.core
    if hasattr(core, "add_request") and "data_parallel_size" in layout_kwargs(layout):
        add = core.add_request

        def add_and_note(request_id, *a, **k):  # the DP rank each request went to
            rank = add(request_id, *a, **k)
            ranks[request_id] = rank
            return rank

        core.add_request = add_and_note

    def generate(ps, mts):
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in mts]
        return engine.generate(prompt_token_ids=ps, sampling_params=params, use_tqdm=False)

    check = generate(prompts[:CHECK_PROMPTS], [16] * min(CHECK_PROMPTS, len(prompts)))
    row["check_tokens"] = [o.token_ids for o in check]
    if step == "latency":
        def timed(n_new: int) -> float:
            t = time.perf_counter()
            generate(prompts, [n_new] * len(prompts))
            return time.perf_counter() - t

        timed(1), timed(129)
        t1, tn = min(timed(1) for _ in range(3)), min(timed(129) for _ in range(3))
        row["ms_per_step"] = round((tn - t1) / 128 * 1e3, 3)
    else:
        t = time.perf_counter()
        outs = generate(prompts, max_tokens)
        dt = time.perf_counter() - t
        got = sum(len(o.token_ids) for o in outs)
        row.update(elapsed_s=round(dt, 2), output_tok_per_s=round(got / dt, 1),
                   total_tok_per_s=round((got + sum(map(len, prompts))) / dt, 1))
        if step == "spec":
            per_rank: dict[int, list[int]] = {}
            for o in outs:
                s = o.spec_decoding or {}
                rank = ranks.get(f"{o.request_id}-0", 0)  # n = 1; without -dp: one engine, rank 0
                acc = per_rank.setdefault(rank, [0, 0])
                acc[0] += s.get("spec_verify_ct", 0)
                acc[1] += s.get("spec_accepted_drafts", 0)
            row["spec_per_rank"] = {
                str(r): {"verify_steps": v, "accepted_drafts": a,
                         "tokens_per_verify": round((a + v) / v, 3) if v else None}
                for r, (v, a) in sorted(per_rank.items())
            }  # fmt: skip
    stats = engine.memory_stats()
    row["memory"] = {
        k: stats.get(k) for k in ("pages_total", "page_size", "moe_workspace_bytes") if k in stats
    }
    if "ranks" in stats:
        row["memory"]["ranks_pages_total"] = [r.get("pages_total") for r in stats["ranks"]]
    try:
        import torch

        if torch.cuda.is_available():
            row["memory"]["rank0_max_allocated_gib"] = round(
                torch.cuda.max_memory_allocated() / 2**30, 2)
    except Exception:  # noqa: BLE001 - a report, best effort
        pass
    engine.core.shutdown()
    return row


def tiny_model(out: Path) -> str:
    """A tiny random gpt-oss checkpoint (alternating sliding/full layers, sinks, 4 experts)."""
    import torch
    import transformers

    folder = out / "tiny-gpt-oss"
    if not (folder / "config.json").exists():
        cfg = transformers.GptOssConfig(
            vocab_size=128, hidden_size=64, num_attention_heads=4, head_dim=16,
            num_key_value_heads=2, intermediate_size=32, num_hidden_layers=4,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            max_position_embeddings=512, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.GptOssForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


def _table(rows: list[dict]) -> str:
    lines = ["| step | layout | value | start s | tokens equal | note |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            value, note = "-", r["error"]
        elif "ms_per_step" in r:
            value, note = f"{r['ms_per_step']} ms/step", ""
        else:
            metric = "total_tok_per_s" if r["step"] == "long" else "output_tok_per_s"
            value, note = f"{r[metric]:,} {metric.replace('_per_s', '/s')}", ""
            if r.get("spec_per_rank"):
                note = "tokens/verify by rank: " + ", ".join(
                    f"{k}: {v['tokens_per_verify']}" for k, v in r["spec_per_rank"].items())
        lines.append(f"| {r['step']} | {r['layout']} | {value} | {r.get('start_s', '-')} | "
                     f"{r.get('tokens_equal', '-')} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-oss-120b", help="a shipped shape or a folder")
    p.add_argument("--layouts", nargs="+", default=["tp8", "dp8-ep", "dp8-ep-nocap", "dp4-tp2"])
    p.add_argument("--steps", nargs="+",
                   default=["throughput-512", "throughput-2048", "long", "latency", "spec"])
    p.add_argument("--long-requests", type=int, default=64)
    p.add_argument("--step-timeout", type=int, default=540, help="seconds per layout x step")
    p.add_argument("--tiny", action="store_true", help="CPU: a tiny random gpt-oss, 2 ranks")
    p.add_argument("--side", nargs=3, metavar=("MODEL", "LAYOUT", "STEP"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    if args.side:  # the child: one row, one JSON line
        row = run_step(*args.side, tiny=args.tiny, long_requests=args.long_requests)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    if args.tiny:
        args.model = tiny_model(out)
        given = sys.argv[1:] if argv is None else argv
        if "--layouts" not in given:
            args.layouts = ["tp2", "dp2-ep", "dp2-ep-nocap", "dp2-tp2"]
        if "--steps" not in given:
            args.steps = ["throughput-8", "long", "spec"]
        args.long_requests = 2
    rows: list[dict] = []
    first_tokens: dict[str, list] = {}
    for step in args.steps:
        for layout in args.layouts:
            try:
                layout_kwargs(layout)
            except ValueError as e:
                rows.append({"layout": layout, "step": step, "error": str(e)})
                continue
            cmd = [sys.executable, __file__, "--side", args.model, layout, step,
                   "--long-requests", str(args.long_requests)] + (["--tiny"] if args.tiny else [])
            t = time.perf_counter()
            log = out / f"scale_out_{step}_{layout}.log"
            row, text, rc = run_child(cmd, args.step_timeout, log)
            if row is None:  # the last error line says why (a refused layout: the engine's own)
                errs = [ln for ln in text.splitlines() if "Error" in ln or "timed out" in ln]
                row = {"layout": layout, "step": step,
                       "error": (errs[-1] if errs else f"rc={rc}")[:200] + f" ({log.name})"}
            if "check_tokens" in row:
                ref = first_tokens.setdefault(step, row["check_tokens"])
                row["tokens_equal"] = row.pop("check_tokens") == ref
            rows.append(record(row, f"{step} / {layout}", t, out / "scale_out.jsonl"))
    print(_table(rows))
    return 0



if __name__ == "__main__":
    sys.exit(main())
