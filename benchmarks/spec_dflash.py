"""DFlash on a real model: acceptance length and speed against speculation off, greedy, on
chat prompts the drafter was not trained on (train-drafter's built-in prompts are "task about
topic" and questions the target wrote; these are other questions), at concurrency 1
(ms/token) and at higher concurrency (output tok/s). The n-gram drafter on the same prompts is
the baseline drafter. Each drafter runs twice: as served by default (the gate drafts only at
batch sizes where it measured that drafting pays) and with every decode step drafting ("-all").

Each engine runs in a fresh process by default (`--in-process`: all in this one). With five
engines in one process, two runs of the same engines at batch 128 differed by 20-25%; whether
sharing the process was the cause is not established, but a fresh one rules it out.

Correctness first: speculative greedy tokens are compared with speculation off (equal in
float32; in bf16 a near-tie may flip, then the count of equal leading tokens is printed).
Runs on CPU (acceptance only is meaningful there) and GPU. Prints a table last; JSON to
$OUT/spec_dflash.json.
Usage: PYTHONPATH=. python benchmarks/spec_dflash.py [--drafter DIR] [--model smollm2-135m-instruct]
       [--tokens 128] [--concurrency 1 8 32 128] [--workload chat|summarise] [--device cuda]
       [--passes N] [--steady R: C requests kept running, R x C prompts]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from swaserve import Engine, SamplingParams

HELD_OUT = [
    "How do I make a good cup of tea?",
    "What is the difference between weather and climate?",
    "Can you explain how a refrigerator keeps food cold?",
    "Write an email asking my landlord to fix the heating.",
    "Why is the sky blue during the day and red at sunset?",
    "Give me three tips for learning a new language.",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion with a simple example in Python.",
    "How does a bill become a law in a democracy?",
    "What are good habits for staying healthy while working from home?",
    "Describe the plot of a detective story set on a train.",
    "How do vaccines train the immune system?",
    "What is the best way to organise a small kitchen?",
    "Explain what an API is to a non-programmer.",
    "Why do cats purr?",
    "How can I save money on groceries each month?",
]


# The repetitive workload: answers that quote a given text, where the n-gram drafter finds
# its drafts (the "summarising a given text"). Texts written for this benchmark.
PASSAGES = [
    "The town library opens at nine on weekdays and at ten on Saturdays. It is closed on "
    "Sundays and public holidays. Members may borrow up to six books for three weeks, and a "
    "loan can be renewed twice unless another member has reserved the book. Late returns cost "
    "twenty cents a day. The reading room on the first floor is kept quiet; group work belongs "
    "in the meeting rooms, which can be booked at the front desk for two hours at a time.",
    "To repot a houseplant, water it the day before so that the roots hold together. Choose a "
    "pot one size larger with a drainage hole. Put a layer of fresh potting mix in the bottom, "
    "turn the old pot on its side and ease the plant out, loosen the outer roots with your "
    "fingers, set the plant at the same depth as before, fill the gaps with mix, press it down "
    "gently and water until it runs out of the hole. Keep the plant out of direct sun for a week.",
    "Our team meets every Monday at ten to plan the week. Each person names the one task that "
    "matters most to them, and anything blocking it. On Wednesday afternoon we review open pull "
    "requests together, and on Friday we write a short summary of what shipped, what slipped, "
    "and why. Meetings end on time, notes go in the shared folder the same day, and decisions "
    "are written down with the name of the person who owns them.",
    "The bus leaves the central station every fifteen minutes from six in the morning until "
    "midnight. It stops at the museum, the university, the hospital and the harbour. A single "
    "ticket costs two euros and is valid for ninety minutes, including changes. Day tickets "
    "cost six euros. Tickets can be bought from the machines at each stop or in the app, but "
    "not from the driver. Bicycles travel free outside the morning and evening rush hours.",
]


def chat_ids(engine: Engine, n: int, workload: str = "chat") -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(n):
        if workload == "chat":
            ask = HELD_OUT[i % len(HELD_OUT)]
        else:  # summarise: quote the given text back
            ask = ("Summarise this text, quoting its key sentences word for word:\n\n"
                   + PASSAGES[i % len(PASSAGES)])
        text = tok.apply_chat_template([{"role": "user", "content": ask}],
                                       add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False).input_ids)
    return out


def run(engine: Engine, prompts: list[list[int]], tokens: int, one_by_one: bool = False
        ) -> tuple[float, list, dict]:
    """Greedy answers that stop at EOS (text past it is nothing a drafter learns), all
    prompts in one batch, or one after another (concurrency 1 over several prompts)."""
    p = SamplingParams(max_tokens=tokens, temperature=0)
    sync = torch.cuda.synchronize if engine.core.device.type == "cuda" else (lambda: None)
    batches = [[q] for q in prompts] if one_by_one else [prompts]
    sync()
    t = time.perf_counter()
    outs = [o for b in batches
            for o in engine.generate(prompt_token_ids=b, sampling_params=p, use_tqdm=False)]
    sync()
    dt = time.perf_counter() - t
    spec = {"verify": 0, "accepted": 0}
    for o in outs:
        s = o.spec_decoding or {}
        spec["verify"] += s.get("spec_verify_ct") or 0
        spec["accepted"] += s.get("spec_accepted_drafts") or 0
    return dt, [o.token_ids for o in outs], spec


def engine_kwargs(args: argparse.Namespace) -> dict[str, dict]:
    """The engines compared: speculation off, then each drafter gated and "-all"
    (--disable-adaptive-speculation: every decode step drafts)."""
    common = dict(device=args.device, dtype=args.dtype, seed=0)
    if args.steady:  # one concurrency per process (child_runs): at most C requests run
        common["max_num_seqs"] = args.concurrency[0]
    on_gpu = torch.cuda.is_available() and args.device in ("auto", "cuda")
    common["kv_cache_gb"] = 8 if on_gpu else 1
    out = {"off": common}
    for name, kw in (("dflash", dict(speculative_algorithm="dflash",
                                     speculative_draft_model=args.drafter)),
                     ("ngram", dict(speculative_algorithm="ngram"))):
        out[name] = {**common, **kw}
        out[f"{name}-all"] = {**common, **kw, "disable_adaptive_speculation": True}
    return {k: v for k, v in out.items() if k in args.engines}


def measure(args: argparse.Namespace, name: str, eng: Engine) -> list[dict]:
    """One engine at every concurrency: a warm run (graphs, and the gate's measurements at
    these batch sizes: a server learns them once, this run is short), then the timed one."""
    out = []
    for c in args.concurrency:
        solo = c == 1
        n = args.solo_prompts if solo else c * max(1, args.steady)
        prompts = chat_ids(eng, n, args.workload)
        run(eng, prompts, args.tokens, one_by_one=solo)
        dt, spec_ct = 0.0, {"verify": 0, "accepted": 0}
        for _ in range(args.passes):  # one pass at 128 lasts ~0.3 s: too short to compare
            t, toks, ct = run(eng, prompts, args.tokens, one_by_one=solo)
            dt += t / args.passes
            spec_ct = {k: spec_ct[k] + ct[k] for k in spec_ct}
        out.append({"concurrency": c, "drafter": name, "seconds": dt, "toks": toks, **spec_ct})
    return out


def child_runs(args: argparse.Namespace, name: str) -> list[dict]:
    """`measure` in a fresh process (nothing of another engine in its memory or its GC); with
    --steady one process per concurrency (its max_num_seqs is that concurrency)."""
    if args.steady and len(args.concurrency) > 1:
        return [r for c in args.concurrency
                for r in child_runs(argparse.Namespace(**{**vars(args), "concurrency": [c]}),
                                    name)]
    argv = [sys.executable, __file__, "--child", name, "--model", args.model,
            "--tokens", str(args.tokens), "--device", args.device, "--dtype", args.dtype,
            "--workload", args.workload, "--solo-prompts", str(args.solo_prompts),
            "--passes", str(args.passes), "--steady", str(args.steady),
            "--concurrency", *map(str, args.concurrency)]
    if args.drafter:
        argv += ["--drafter", args.drafter]
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


RESULT = "SPEC_DFLASH_RESULT "


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default=None, help="default: the drafter shipped for --model")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", choices=("chat", "summarise"), default="chat",
                    help="chat questions, or answers that quote a given text (n-gram's case)")
    ap.add_argument("--solo-prompts", type=int, default=8,
                    help="concurrency 1 runs this many prompts one after another")
    ap.add_argument("--passes", type=int, default=1,
                    help="timed passes per concurrency after the warm one (seconds: their "
                         "mean; verify steps: their sum)")
    names = ["off", "dflash", "dflash-all", "ngram", "ngram-all"]
    ap.add_argument("--engines", nargs="+", choices=names, default=names,
                    help="which to run (off always runs: the others are compared with it)")
    ap.add_argument("--in-process", action="store_true",
                    help="every engine in this process (default: each in a fresh one)")
    ap.add_argument("--steady", type=int, default=0, metavar="R",
                    help="concurrency C > 1 keeps C requests running: max_num_seqs C and R x C "
                         "prompts, each C in its own process (default 0: C prompts at once, "
                         "the batch shrinking as they end)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one engine, results on stdout for the parent
        args.engines = [args.child]
        eng = Engine(model=args.model, **engine_kwargs(args)[args.child])
        print(RESULT + json.dumps(measure(args, args.child, eng)), flush=True)
        return
    args.engines = ["off"] + [n for n in args.engines if n != "off"]
    if args.steady and args.in_process:
        ap.error("--steady runs each concurrency in its own process: not with --in-process")
    runs = {}
    for name, kw in engine_kwargs(args).items():
        runs[name] = (measure(args, name, Engine(model=args.model, **kw)) if args.in_process
                      else child_runs(args, name))
    rows = []
    record = {"model": args.model, "drafter": args.drafter, "workload": args.workload,
              "steady": args.steady,
              "in_process": args.in_process, "runs": []}
    for i, c in enumerate(args.concurrency):
        solo = c == 1
        base = runs["off"][i]
        base_rate = sum(map(len, base["toks"])) / base["seconds"]
        for name in runs:
            m = runs[name][i]
            toks, dt = m["toks"], m["seconds"]
            n_tok = sum(len(t) for t in toks)
            equal = sum(
                next((j for j, (a, b) in enumerate(zip(t, w)) if a != b), len(t))
                for t, w in zip(toks, base["toks"])
            ) / n_tok
            v = m["verify"]
            accept = (m["accepted"] + v) / v if v else None
            r = {"concurrency": c, "drafter": name, "seconds": dt,
                 # a step's time: over every token one by one; else per token of a request
                 # (steady: C of them run at once; else the longest answer's steps)
                 "ms_per_token": dt / (n_tok if solo else n_tok / c if args.steady
                                       else max(map(len, toks))) * 1e3,
                 "tokens": n_tok, "tok_s": n_tok / dt, "verify_steps": v,
                 "speedup": n_tok / dt / base_rate, "accept_length": accept,
                 "equal_leading": equal}
            rows.append(r)
            record["runs"].append(r)
            print(r, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "spec_dflash.json"), "w") as f:
            json.dump(record, f, indent=1)
    how = "one process" if args.in_process else "a process per engine"
    if args.steady:
        how += f", steady: C running of {args.steady} x C prompts"
    print(f"\n{args.model}, {args.workload}, drafter {args.drafter}, {how}, greedy, at most "
          f"{args.tokens} tokens per "
          f"request (to EOS); concurrency 1: {args.solo_prompts} prompts one by one")
    print(f"{'conc':>5} {'drafter':>10} {'ms/tok':>8} {'tok/s':>8} {'speedup':>8} {'accept':>7} "
          f"{'verify':>7} {'equal':>6}")
    for r in rows:
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(f"{r['concurrency']:5d} {r['drafter']:>10} {r['ms_per_token']:8.2f} "
              f"{r['tok_s']:8.0f} {r['speedup']:7.2f}x {acc:>7} {r['verify_steps']:7d} "
              f"{r['equal_leading']:6.0%}")


if __name__ == "__main__":
    main()
