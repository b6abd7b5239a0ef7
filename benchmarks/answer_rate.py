"""GPU run (issue 11): how fast `train-drafter` gets its data, the target answering prompts.

The built-in chat model's shape (`smollm2-135m`, dummy bf16 weights), prompts of random ids
with lengths uniform in [20, 200] and answers of uniform length in [32, 384] (EOS ignored, so
the lengths are the same for every method), greedy. Methods, each on a fresh engine:

  chunked   `Engine.generate` over chunks of `--chunk` prompts (train-drafter before the
            streaming change: each chunk drains to its longest answers before the next starts)
  stream    `drafter_data.answer` (prompts added as others finish)

For the stream run the engine step is timed by phase on the host (schedule, launch, resolve =
waiting for the tokens and committing them, retire). Prints one table last.

Usage: python3 benchmarks/answer_rate.py [--prompts 3072] [--max-num-seqs 256] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

from swaserve import Engine, SamplingParams
from swaserve.speculative.drafter_data import answer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_profile import host_timer  # noqa: E402


def workload(
    n: int, longest: int = 384, seed: int = 0
) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randint(10, 49000) for _ in range(rng.randint(20, 200))])
        params.append(SamplingParams(max_tokens=rng.randint(32, longest), temperature=0,
                                     ignore_eos=True, detokenize=False))  # fmt: skip
    return prompts, params


def _phases(core) -> dict[str, float]:
    """Wrap the step's phases with host timers; returns the dict they add seconds to."""
    host: dict[str, float] = defaultdict(float)
    for obj, name in ((core.scheduler, "schedule"), (core, "_launch"), (core, "_resolve"),
                      (core.scheduler, "retire"), (core, "step")):  # fmt: skip
        host_timer(host, obj, name, name)
    host["steps"] = 0.0
    step = core.step

    def counted():
        host["steps"] += 1
        return step()

    core.step = counted
    return host


def run(method: str, args, prompts, params) -> dict:
    eng = Engine(model="smollm2-135m", load_format="dummy", seed=0,
                 max_num_seqs=args.max_num_seqs, kv_cache_gb=args.kv_cache_gb)  # fmt: skip
    host = _phases(eng.core) if method == "stream" else None
    t0 = time.perf_counter()
    if method == "chunked":
        n_tokens = 0
        for s in range(0, len(prompts), args.chunk):
            outs = eng.generate(
                prompt_token_ids=prompts[s : s + args.chunk],
                sampling_params=params[s : s + args.chunk],
                use_tqdm=False,
            )
            n_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    else:
        seqs = answer(eng, prompts, params)
        n_tokens = sum(len(s) - p for s, p in seqs)
    wall = time.perf_counter() - t0
    row = {"method": method, "wall_s": wall, "tokens": n_tokens, "tok_s": n_tokens / wall}
    if host:
        n = max(1.0, host.pop("steps"))
        row["per_step_ms"] = {k: v / n * 1e3 for k, v in host.items()}
        row["steps"] = int(n)
    del eng
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3072)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--kv-cache-gb", type=float, default=8.0)
    ap.add_argument("--longest", type=int, default=384, help="longest answer")
    ap.add_argument("--methods", nargs="+", default=["chunked", "stream"])
    args = ap.parse_args()
    prompts, params = workload(args.prompts, args.longest)
    rows = [run(m, args, prompts, params) for m in args.methods]
    print(
        f"\n{args.prompts} prompts, answers U[32, {args.longest}], "
        f"max_num_seqs {args.max_num_seqs}, chunk {args.chunk}"
    )
    print(f"{'method':8} {'wall s':>8} {'tokens':>9} {'tok/s':>9}  host per step (ms)")
    for r in rows:
        phases = " ".join(f"{k.strip('_')} {v:.2f}" for k, v in r.get("per_step_ms", {}).items())
        steps = f" over {r['steps']} steps" if "steps" in r else ""
        print(
            f"{r['method']:8} {r['wall_s']:8.1f} {r['tokens']:9d} {r['tok_s']:9.0f}  "
            f"{phases}{steps}"
        )


if __name__ == "__main__":
    main()
