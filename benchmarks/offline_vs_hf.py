"""GPU run (priority order): swaserve offline throughput and batch-1 decode on the
Llama-3.1-8B shape (dummy bf16 weights, Triton attention, CUDA graphs) against Hugging Face
transformers' continuous batching (`generate_batch`) on the same weights and a subset of the
same prompts, in the same run. Correctness first: each prompt position's logprob against a
float32 transformers reference, next to transformers' own bf16 error. Prints a table last;
writes JSON to $OUT/offline.json when OUT is set.

Usage: python benchmarks/offline_vs_hf.py [num_prompts] [hf_subset]
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

from swaserve import Engine, SamplingParams
from swaserve.bench.offline import generate_timed, random_workload, run_offline_bench


def hf_model_like(engine: Engine):
    """A transformers model with the engine's weights (same names), bf16 on the GPU."""
    from transformers import AutoModelForCausalLM

    cfg = engine.core.hf_config
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf = hf.to_empty(device="cuda")
    missing, unexpected = hf.load_state_dict(engine.core.model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return with_dtype(hf, torch.bfloat16).eval()


def with_dtype(hf, dtype: torch.dtype):
    """`hf` cast to `dtype` with a fresh rotary embedding: its non-persistent float32
    frequencies are not in the state dict, and a cast would round them."""
    hf = hf.to(dtype)
    device = next(hf.parameters()).device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config, device=device)
    return hf


def prompt_logprobs(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt position p >= 1: log P(ids[p] | ids[:p]) and the top-1 token there (CPU)."""
    logp = hf(ids).logits[0, :-1].float().log_softmax(-1)
    lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return lp.cpu(), logp.argmax(-1).cpu()


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    sub = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    t = time.perf_counter()
    eng = Engine(model="llama-3.1-8b", load_format="dummy", max_model_len=4096, kv_cache_gb=60)
    rows = [f"engine start (dummy load, CUDA graph capture): {time.perf_counter() - t:.1f} s"]

    res = run_offline_bench(eng, n)
    rows.append(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                            for k, v in res.items()}))
    vocab = eng.core.hf_config.vocab_size
    prompts, outs = random_workload(vocab, sub, (100, 1024), (100, 1024), seed=1)
    m = sum(outs) // len(outs)
    ours_sub = generate_timed(eng, prompts, [m] * sub)
    # Correctness, teacher-forced: dummy weights give near-flat logits, so greedy tokens flip
    # on bf16 rounding alone; compare each prompt position's logprob of the actual next token
    # against a float32 transformers reference, next to transformers' own bf16 error.
    probe = random_workload(vocab, 1, (256, 256), (1, 1), seed=2)[0][0]
    got = eng.generate(prompt_token_ids=[probe], sampling_params=SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0].prompt_logprobs
    ours_lp = torch.tensor([lp.logprob for lp in got[1:]])
    ours_top = torch.tensor([lp.top[0][0] for lp in got[1:]])

    hf = hf_model_like(eng)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    from transformers import GenerationConfig

    ids = torch.tensor([probe], device="cuda")
    with torch.no_grad():
        ref_lp, ref_top = prompt_logprobs(with_dtype(hf, torch.float32), ids)
        bf_lp, bf_top = prompt_logprobs(with_dtype(hf, torch.bfloat16), ids)
    ours_err = (ours_lp - ref_lp).abs().max().item()
    hf_err = (bf_lp - ref_lp).abs().max().item()
    ok = ours_err <= 2 * hf_err + 1e-3
    rows.append(
        f"correctness (256-token prompt, logprob of each next token vs transformers float32): "
        f"swaserve bf16 max |diff| {ours_err:.4f}, transformers bf16 {hf_err:.4f}; "
        f"top-1 agreement swaserve {(ours_top == ref_top).float().mean():.2f}, "
        f"transformers bf16 {(bf_top == ref_top).float().mean():.2f}: {'PASS' if ok else 'FAIL'}"
    )
    gc_ = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate_batch(inputs=prompts[:2], generation_config=gc_)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = hf.generate_batch(inputs=prompts, generation_config=gc_)
    torch.cuda.synchronize()
    hf_time = time.perf_counter() - t
    hf_tokens = sum(len(o.generated_tokens) for o in out.values())
    ours_tps, hf_tps = sub * m / ours_sub, hf_tokens / hf_time
    rows.append(
        f"subset {sub} prompts x {m} new tokens: swaserve {ours_tps:.0f} out tok/s, "
        f"transformers generate_batch {hf_tps:.0f} out tok/s ({hf_tokens} tokens): "
        f"{ours_tps / hf_tps:.1f}x"
    )
    print("\n".join(rows))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "offline.json"), "w") as f:
            json.dump({"swaserve": res, "subset": {"prompts": sub, "new_tokens": m,
                       "swaserve_tps": ours_tps, "hf_tps": hf_tps}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
