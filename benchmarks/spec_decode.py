"""GPU run: what a verify step costs against a decode step, and the batch-1 speedup that
speculative decoding can reach on the Llama-3.1-8B shape (dummy bf16 weights, Triton
attention, CUDA graphs for plain decode).

Dummy weights make a real drafter meaningless (nothing repeats), so the drafts come from an
oracle: the target's own greedy continuation (made by the same engine's verify path), with a
planted error every `period`-th draft (period 0: none). Acceptance is then set by the run, and the
time per committed token shows the verify path's overhead (host work, eager forward of K + 1
tokens, acceptance on the device, one copy back). The n-gram drafter's row is its cost at
acceptance ~0 on this text.

Correctness: in float32 speculative greedy tokens equal speculation off (tests/gpu); in bf16
the verify forward (K + 1 tokens, eager) and the graphed decode step round differently, so a
near-tie can flip and the continuation change from there on (then the oracle's drafts miss).
The table gives, per run, how many leading tokens equal speculation off.
Prints a table last; JSON to $OUT/spec_decode.json.
Usage: PYTHONPATH=. python benchmarks/spec_decode.py [--model llama-3.1-8b] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from swaserve import Engine, SamplingParams
from swaserve.speculative.ngram import NgramDrafter

PROMPT = list(range(1000, 1128))


class PlantedOracle:
    def __init__(self, prompt: list[int], ref: list[int], period: int) -> None:
        self.prompt, self.ref, self.period = prompt, ref, period
        self.drafted = 0

    def propose(self, tokens, k: int) -> list[int]:
        pos = len(tokens) - len(self.prompt)
        drafts = list(self.ref[pos : pos + k])
        for i in range(len(drafts)):
            self.drafted += 1
            if self.period and self.drafted % self.period == 0:
                drafts[i] = (drafts[i] + 1) % 32000
        return drafts


def timed(engine: Engine, n: int) -> tuple[float, list[int], dict | None]:
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = engine.generate(prompt_token_ids=[PROMPT], sampling_params=p, use_tqdm=False)[0]
    torch.cuda.synchronize()
    return time.perf_counter() - t, out.token_ids, out.spec_decoding


def per_token(engine: Engine, n: int) -> tuple[float, list[int], dict | None]:
    """Seconds per output token after the first: (t(n) - t(1)) / (n - 1), warm."""
    timed(engine, 8)
    t1 = min(timed(engine, 1)[0] for _ in range(2))
    tn, toks, spec = timed(engine, n)
    return (tn - t1) / (n - 1), toks, spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    common = dict(model=args.model, load_format="dummy", kv_cache_gb=8, seed=0)
    rows, record = [], {}
    off = Engine(**common)
    base, ref, _ = per_token(off, args.tokens)
    rows.append(("off (graphs, overlap)", None, None, base, len(ref)))
    record["off"] = {"ms_per_token": base * 1e3}
    del off
    torch.cuda.empty_cache()
    for k in (2, 4, 7):
        spec = Engine(**common, speculative_algorithm="ngram", speculative_num_draft_tokens=k)
        # The oracle's reference: this engine's own greedy continuation through its verify
        # path (constant drafts, nearly all rejected), which bf16 rounding may set apart from
        # the decode path's after a near-tie.
        spec.core.spec.drafter = PlantedOracle(PROMPT, [7] * (args.tokens + 16), 0)
        own = timed(spec, args.tokens)[1]
        for period in (0, 3):
            spec.core.spec.drafter = PlantedOracle(PROMPT, own + [0] * 16, period)
            t, toks, stats = per_token(spec, args.tokens)
            same = _same_prefix(toks, ref)
            rows.append((f"oracle k={k} error every {period or '-'}", k,
                         stats["spec_accept_length"], t, same))
            record[f"oracle_k{k}_p{period}"] = {"ms_per_token": t * 1e3, "same": same, **stats}
        if k == 4:
            spec.core.spec.drafter = NgramDrafter(1, 4)
            t, toks, stats = per_token(spec, args.tokens)
            same = _same_prefix(toks, ref)
            rows.append(("ngram k=4 (dummy model's text)", k, stats["spec_accept_length"], t, same))
            record["ngram_k4"] = {"ms_per_token": t * 1e3, "same": same, **stats}
        del spec
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "spec_decode.json"), "w") as f:
            json.dump(record, f, indent=1)
    print(f"\n{args.model} dummy bf16, batch 1, {args.tokens} greedy tokens, 128-token prompt")
    print(f"{'run':34} {'K':>3} {'accept len':>10} {'ms/token':>9} {'speedup':>8} {'same':>5}")
    for name, k, acc, t, same in rows:
        a = "-" if acc is None else f"{acc:.2f}"
        print(f"{name:34} {k or '-':>3} {a:>10} {t * 1e3:9.2f} {base / t:8.2f}x {same:>5}")


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


if __name__ == "__main__":
    main()
