"""GPU run (runs on CPU too): greedy outputs of the real Gemma 3 270M (the built-in
GGUF, dequantised) with an FP8 KV cache (calibrated per-layer scales) against a KV cache in
the model dtype (bf16 on GPU, float32 on CPU), first 32 tokens, on 16 prompts; plus the KV
capacity of each under the same budget. Not an assertion: the issue asks for the rate. For
scale, the same greedy runs through transformers on the same (converted) weights and token
ids, in the model dtype and in float32: how often the model-dtype KV itself matches. JSON to
$OUT/fp8_gemma270m.json.

Usage: python benchmarks/fp8_gemma270m.py [path/to/gemma-3-270m-q4_k_m.gguf] [--prompts 64]
(default: the built-in alias, which needs the pip package; 16 prompts, at most 64)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from swaserve import Engine, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn leaves:\n",
    "The quick brown fox",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "SELECT name, age FROM users WHERE",
    "Photosynthesis is the process by which",
    "My favourite book is",
    "The theory of relativity states that",
    "1, 1, 2, 3, 5, 8, 13,",
    "Dear hiring manager, I am writing to apply for",
]
# 48 more, for a rate with a tighter spread (`--prompts 64`); the first 16 stay the reference set
MORE_PROMPTS = [
    "The main causes of the French Revolution were",
    "import numpy as np\n\ndef normalize(x):\n    ",
    "Translate to French: 'Good morning, how are you?'\n",
    "The mitochondria is known as",
    "Here is a recipe for banana bread:\n1.",
    "The speed of light in a vacuum is approximately",
    "Q: What is 17 times 23?\nA:",
    "In machine learning, overfitting happens when",
    "The Great Wall of China was built to",
    "A short poem about the ocean:\n",
    "The difference between a list and a tuple in Python is",
    "Shakespeare wrote many plays, including",
    "To change a flat tire, you should",
    "The human heart has four chambers:",
    "Climate change affects agriculture by",
    "<html>\n<head>\n<title>",
    "The best way to learn a new language is",
    "Mount Everest is located in",
    "An API is a set of rules that",
    "The water cycle consists of evaporation,",
    "Once there was a robot who wanted to",
    "The periodic table organizes elements by",
    "Breakfast is often called the most important meal because",
    "The Pythagorean theorem states that",
    "In the year 2050, cities will",
    "The rules of chess: each player starts with",
    "A good cover letter should",
    "The stock market is a place where",
    "Tokyo is the capital of",
    "for (int i = 0; i < n; i++) {\n    ",
    "The ancient Egyptians built the pyramids",
    "Vaccines work by training the immune system to",
    "The first step in writing a novel is",
    "Bees are important to the environment because",
    "The sum of the angles in a triangle is",
    "Meeting notes, Monday:\n- ",
    "The Internet was originally developed by",
    "A balanced diet includes",
    "The moon causes ocean tides because",
    "git commit -m \"",
    "The most popular sport in the world is",
    "Dear Sir or Madam,\n\nI am writing to complain about",
    "Electric cars differ from gasoline cars in that",
    "The Renaissance began in Italy in the",
    "2, 4, 8, 16, 32,",
    "Sleep is important for health because",
    "The Amazon rainforest is home to",
    "Step-by-step instructions for making coffee:\n",
]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def hf_greedy(folder: str, dtype: torch.dtype, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers greedy 32 tokens per prompt, one prompt at a time, EOS not special (a
    plain argmax loop over its KV cache: `generate` would stop at or suppress EOS)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x, past, toks = torch.tensor([ids], device=device), None, []
            for _ in range(32):
                out = hf(x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                x = out.logits[:, -1:].argmax(-1)
                toks.append(int(x))
            outs.append(toks)
    del hf
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="gemma-3-270m")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS),
                    help=f"how many prompts, at most {len(PROMPTS) + len(MORE_PROMPTS)}")
    args = ap.parse_args()
    model = args.model
    prompts = (PROMPTS + MORE_PROMPTS)[: args.prompts]
    out_dir = os.environ.get("OUT", "bench_out")
    os.makedirs(out_dir, exist_ok=True)
    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    cuda = torch.cuda.is_available()
    res: dict = {"model": model, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    outs = {}
    for kv in ("auto", "fp8_e4m3"):
        eng = Engine(model=model, kv_cache_dtype=kv, kv_cache_gb=2, max_model_len=4096)
        stats = eng.memory_stats()
        res[f"{kv}_capacity_tokens"] = stats["pages_total"] * eng.config.page_size
        got = eng.generate(prompts, p, use_tqdm=False)
        outs[kv] = [o.token_ids for o in got]
        prompt_ids, folder, dtype = [o.prompt_token_ids for o in got], eng.folder, eng.core.dtype
        if kv == "fp8_e4m3":
            res["fp8_scales_k"] = [round(s, 4) for s in eng.core.kv.k_scales]
        del eng
        if cuda:
            torch.cuda.empty_cache()
    outs["hf_model_dtype"] = hf_greedy(folder, dtype, prompt_ids)
    outs["hf_float32"] = hf_greedy(folder, torch.float32, prompt_ids)
    same = [a == b for a, b in zip(outs["auto"], outs["fp8_e4m3"])]
    first_diff = [first_divergence(a, b) for a, b in zip(outs["auto"], outs["fp8_e4m3"])]
    res.update(identical=sum(same), prompts=len(prompts), first_divergence=first_diff)
    pairs = [("auto", "hf_model_dtype"), ("auto", "hf_float32"), ("fp8_e4m3", "hf_float32"),
             ("hf_model_dtype", "hf_float32")]
    res["identical_pairs"] = {f"{a} vs {b}": sum(x == y for x, y in zip(outs[a], outs[b]))
                              for a, b in pairs}
    with open(os.path.join(out_dir, "fp8_gemma270m.json"), "w") as f:
        json.dump(res | {"outputs": outs}, f, indent=1)
    ratio = res["fp8_e4m3_capacity_tokens"] / res["auto_capacity_tokens"]
    print("\n| Gemma 3 270M, 2 GiB KV | model-dtype KV | fp8 KV |")
    print("|---|---|---|")
    print(f"| capacity (tokens) | {res['auto_capacity_tokens']} | "
          f"{res['fp8_e4m3_capacity_tokens']} ({ratio:.2f}x) |")
    print(f"| greedy 32 tokens identical to model-dtype KV | | {sum(same)}/{len(prompts)} "
          f"(first divergence at {first_diff}) |")
    for pair, n in res["identical_pairs"].items():
        print(f"| greedy 32 tokens identical, {pair} | {n}/{len(prompts)} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
