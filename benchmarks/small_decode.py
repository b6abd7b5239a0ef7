"""Plain decode (no speculation) at small batches on a small model, one GEMV setting against
another: what `ops.gemv_rows` sends past two rows on models of hidden size <= 1024 (stop 43's
default) timed against two rows (`SWASERVE_GEMV_ROWS=2`), each variant in a fresh process,
alternated.

Greedy, EOS ignored, B prompts of 64 fixed token ids; ms per decode step is (t(n) - t(1)) /
(n - 1), best of two. Before timing, each child counts the prompts whose greedy tokens equal
those of an engine without the GEMV path (cuBLAS only, `SWASERVE_GEMV_ROWS=0`) at batch 4 on
the same weights (reported, not asserted: bf16 near-ties can flip).

  PYTHONPATH=. python benchmarks/small_decode.py --model .dev/smol_hf --load-format dummy \\
      --batches 1 2 4 6 8 16 --variants default 2 default 2
Prints a table last; JSON rows to $OUT/small_decode.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _child(args: argparse.Namespace) -> None:
    import torch

    from swaserve import Engine, SamplingParams
    from swaserve.bench.offline import generate_timed

    kw = dict(model=args.model, load_format=args.load_format, device=args.device, seed=0)
    prompts = [[1000 + 7 * b + i for i in range(64)] for b in range(max(args.batches))]
    check = [prompts[i] for i in range(4)]
    p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    mine = os.environ.get("SWASERVE_GEMV_ROWS")
    os.environ["SWASERVE_GEMV_ROWS"] = "0"  # read when an engine loads its model
    plain = Engine(**kw)
    ref = [o.token_ids for o in plain.generate(prompt_token_ids=check, sampling_params=p,
                                               use_tqdm=False)]
    del plain
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if mine is None:
        del os.environ["SWASERVE_GEMV_ROWS"]
    else:
        os.environ["SWASERVE_GEMV_ROWS"] = mine
    engine = Engine(**kw)
    got = [o.token_ids for o in engine.generate(prompt_token_ids=check, sampling_params=p,
                                                use_tqdm=False)]
    agree = sum(a == b for a, b in zip(got, ref))
    row = {"variant": args.variant, "rows": engine.core.model.model.gemv_rows,
           "agree_with_cublas": f"{agree}/4", "ms": {}}
    n = args.tokens
    for b in args.batches:
        batch = prompts[:b]
        generate_timed(engine, batch, [8] * b)
        t1 = min(generate_timed(engine, batch, [1] * b) for _ in range(2))
        tn = min(generate_timed(engine, batch, [n] * b) for _ in range(2))
        row["ms"][str(b)] = round((tn - t1) / (n - 1) * 1e3, 4)
    print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 6, 8, 16])
    ap.add_argument("--tokens", type=int, default=129)
    ap.add_argument("--variants", nargs="+", default=["default", "2", "default", "2"],
                    help="default, or a SWASERVE_GEMV_ROWS value")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant is not None:
        _child(args)
        return
    from child_run import record, run_child

    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "small_decode.jsonl"
    started = time.perf_counter()
    rows = []
    for i, v in enumerate(args.variants):
        env = dict(os.environ)
        env.pop("SWASERVE_GEMV_ROWS", None)
        if v != "default":
            env["SWASERVE_GEMV_ROWS"] = v
        cmd = [sys.executable, __file__, "--model", args.model, "--device", args.device,
               "--load-format",
               args.load_format, "--tokens", str(args.tokens), "--variant", v, "--batches",
               *map(str, args.batches)]
        res, text, rc = run_child(cmd, 300, out / f"small_decode_{i}_{v}.log", env)
        if res is None:
            print(f"variant {v}: no result (exit {rc}); tail:\n{text[-2000:]}")
            continue
        rows.append(record(res, f"variant {v}", started, jsonl))
    print("\n| variant | GEMV rows | greedy = cuBLAS path | " + " | ".join(
        f"B{b} ms/step" for b in args.batches) + " |")
    print("|---" * (3 + len(args.batches)) + "|")
    for r in rows:
        print(f"| {r['variant']} | {r['rows']} | {r['agree_with_cublas']} | "
              + " | ".join(f"{r['ms'][str(b)]:.3f}" for b in args.batches) + " |")


if __name__ == "__main__":
    main()
