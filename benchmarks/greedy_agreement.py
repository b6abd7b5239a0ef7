"""The built-in models' greedy tokens against a float32 reference computed on the CPU (issue 14:
"on the GPU the built-in models' greedy tokens agree with the float32 CPU reference on at least
as many prompts as before the change; give both counts").

The reference: transformers in float32 on the CPU, on the engine's own converted weights and
token ids, 32 greedy tokens per prompt (fp8_gemma270m.py's prompts and argmax loop), kept in
`benchmarks/data/greedy_reference_<model>.json` (`--save-reference`, run here once). On the
GPU each variant runs the engine in its default dtype (bf16) twice, one prompt at a time (batch
1: the decode GEMV path on Llama-family models) and all prompts in one batch, and counts the
prompts whose 32 tokens equal the reference's:

  default    the engine as it ships
  gemv-off   SWASERVE_GEMV_ROWS=0: batch-1 steps through cuBLAS and the separate norm,
             activation and residual launches, as before the decode GEMV (stop 18)
  rows-2     SWASERVE_GEMV_ROWS=2: the GEMV at one and two rows only, as before small models
             took up to 8 (2026-12-05)
A third mode runs the prompts in groups of six (steps of 3 to 6 rows).

Prints a table last; JSON to $OUT/greedy_agreement_<model>.json.

Usage:
  python benchmarks/greedy_agreement.py MODEL --save-reference          # CPU, once per model
  python3 benchmarks/greedy_agreement.py MODEL [--variants default gemv-off]    # GPU
MODEL is a built-in alias (smollm2-135m-instruct, gemma-3-270m) or a GGUF path; with a path
give `--name` (the alias the reference file is named after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gemma270m import MORE_PROMPTS, PROMPTS, first_divergence, hf_greedy  # noqa: E402

from swaserve import Engine, SamplingParams  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
VARIANTS = {
    "default": {},
    "gemv-off": {"SWASERVE_GEMV_ROWS": "0"},
    "rows-2": {"SWASERVE_GEMV_ROWS": "2"},  # the GEMV at one and two rows only (before 2026-12-05)
}
BY = 6  # the third mode: prompts in groups of this many (steps of <= 6 rows)


def _engine(model: str, **kw) -> Engine:
    return Engine(model=model, kv_cache_gb=2, max_model_len=4096, **kw)


def save_reference(model: str, name: str, n: int) -> Path:
    prompts = (PROMPTS + MORE_PROMPTS)[:n]
    eng = _engine(model, device="cpu", dtype="float32")
    p = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ids = [o.prompt_token_ids for o in eng.generate(prompts, p, use_tqdm=False)]
    folder = eng.folder
    del eng
    ref = hf_greedy(folder, torch.float32, ids)
    DATA.mkdir(exist_ok=True)
    path = DATA / f"greedy_reference_{name}.json"
    path.write_text(json.dumps({
        "model": name, "reference": "transformers float32, CPU, on the engine's converted "
        "weights", "tokens_per_prompt": 32, "prompts": prompts, "prompt_token_ids": ids,
        "tokens": ref, "torch": torch.__version__,
    }, indent=None) + "\n")  # fmt: skip
    return path


def run_variant(model: str, env: dict[str, str], ref: dict) -> dict:
    """Counts of prompts equal to the reference, one at a time and in one batch."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read when the engine starts (swaserve.ops.gemv_rows)
    try:
        eng = _engine(model)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    ids = ref["prompt_token_ids"]
    one = [eng.generate(prompt_token_ids=[x], sampling_params=p, use_tqdm=False)[0]
           for x in ids]  # fmt: skip
    batch = eng.generate(prompt_token_ids=ids, sampling_params=p, use_tqdm=False)
    groups = [o for i in range(0, len(ids), BY)
              for o in eng.generate(prompt_token_ids=ids[i:i + BY], sampling_params=p,
                                    use_tqdm=False)]  # fmt: skip
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out = {}
    for mode, got in (("batch1", one), ("batched", batch), (f"by{BY}", groups)):
        toks = [list(o.outputs[0].token_ids) for o in got]
        out[mode] = {
            "equal": sum(a == b for a, b in zip(toks, ref["tokens"])),
            "first_divergence": [first_divergence(a, b) for a, b in zip(toks, ref["tokens"])],
            "tokens": toks,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--name", help="the reference's name (default: the model argument)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--save-reference", action="store_true")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    name = args.name or args.model
    if args.save_reference:
        print(save_reference(args.model, name, args.prompts))
        return 0
    ref = json.loads((DATA / f"greedy_reference_{name}.json").read_text())
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    res = {"model": name, "device": dev, "prompts": len(ref["tokens"]), "variants": {}}
    for v in args.variants:
        res["variants"][v] = run_variant(args.model, VARIANTS[v], ref)
        print(v, {m: r["equal"] for m, r in res["variants"][v].items()}, flush=True)
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"greedy_agreement_{name}.json").write_text(json.dumps(res))
    n = res["prompts"]
    print(f"\n{name} on {dev}: prompts whose 32 greedy tokens equal the float32 CPU reference")
    print(f"| variant | one prompt at a time | all prompts in one batch | groups of {BY} |")
    print("|---|---|---|---|")
    for v, r in res["variants"].items():
        print(f"| {v} | {r['batch1']['equal']}/{n} | {r['batched']['equal']}/{n} "
              f"| {r[f'by{BY}']['equal']}/{n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
