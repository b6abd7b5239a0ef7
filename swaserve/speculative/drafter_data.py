"""Training text for `swaserve train-drafter`: prompts, the target's greedy answers, and a
held-out split.

    built-in prompts  the target writes users' messages (drafter_prompts.py: numbered
                      lists it continues, sampled with a seed per request), deduplicated,
                      topped up with written templates when too few survive
    answers           the target continues every prompt (greedy by default, as the served
                      model is in the benchmark); prompts stream through the engine so that
                      its batch stays full to the end, and `max_seconds` stops it with what
                      is done (answers cut short kept as far as they got)
    split             whole sequences (so whole prompts) go to the held-out set: no prompt
                      of it is trained on
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from swaserve.sampling.params import SamplingParams
from swaserve.speculative.drafter_prompts import (
    dedupe,
    dress,
    normalise,
    parse_questions,
    question_requests,
    template_prompts,
)


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A user's message in the target's chat template (when it has one), as token ids."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def generate_questions(
    engine: Any,
    n: int,
    seed: int,
    temperature: float = 0.8,
    top_p: float = 0.95,
    max_tokens: int = 96,
    rounds: int = 3,
) -> list[str]:
    """Up to n distinct users' messages written by the target (seeded): rounds of list
    requests, each sized by the previous round's yield of new messages (at most 3 requests
    per message still wanted: a target that writes no usable lists stops soon)."""
    tok = engine.tokenizer
    found: list[str] = []
    seen: set[str] = set()
    per_request = 2.0  # the first round's guess at new messages per request
    for r in range(rounds):
        want = n - len(found)
        if want <= 0:
            break
        count = min(math.ceil(want / per_request * 1.1), 3 * want)
        reqs = question_requests(count, seed + 7919 * r)
        ids = [prompt_ids(tok, q.text) if q.chat else tok(q.text).input_ids for q in reqs]
        base = (seed + 1) * 1_000_003 + r * len(reqs)
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           seed=base + i)
            for i in range(len(reqs))
        ]
        outs = engine.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=True)
        before = len(found)
        for q, o in zip(reqs, outs):
            for msg in parse_questions(o.text, q.opener):
                key = normalise(msg)
                if key not in seen:
                    seen.add(key)
                    found.append(msg)
        per_request = max(0.05, (len(found) - before) / len(reqs))
        print(f"train-drafter: questions round {r + 1}: {len(reqs)} requests -> "
              f"{len(found) - before} new messages ({len(found)} of {n})", flush=True)
    return found[:n]


def builtin_prompts(
    engine: Any, n: int, seed: int, question_share: float, **question_args: Any
) -> list[str]:
    """n distinct prompts, seeded: a `question_share` written by the target (a quarter of
    them dressed with a greeting or an instruction), the rest templates, shuffled."""
    want = round(n * question_share)
    questions = generate_questions(engine, want, seed, **question_args) if want else []
    questions = dress(questions, 0.25, seed)
    # templates: more than needed, since some may repeat a question after normalising
    prompts = dedupe(questions + template_prompts(n - len(questions) + 64, seed))[:n]
    random.Random(seed).shuffle(prompts)
    return prompts


MIN_PARTIAL_TOKENS = 32  # an answer cut short by the time limit is kept from this length


def answer(
    engine: Any,
    prompts: Sequence[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    max_seconds: float = 0,
    burst: int = 0,
) -> list[tuple[list[int], int]]:
    """(prompt + continuation, prompt length) per prompt answered, in prompt order; `params`
    for all prompts or one per prompt.

    The prompts stream through the engine core, in bursts: once `burst` (default an eighth of
    --max-num-seqs) answers have finished, as many new prompts are added, so the batch stays
    nearly full until the last prompts (answering in chunks left the GPU with a chunk's few
    longest answers at the end of each). Bursts, not one prompt per finished answer: a step
    that prefills runs the mixed-batch path, whose host cost on a small target is several times
    a graphed decode step's (benchmarks/answer_rate.py: one new prompt every step made the
    smollm2 run 12% slower than chunks). When `max_seconds` (0: no limit) runs out, nothing more is
    added, the answers still running are aborted and kept as far as they got when at least
    MIN_PARTIAL_TOKENS long (a greedy answer's prefix is the target's text all the same), and
    the engine is left with no request and no step in flight."""
    per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    if len(per) != len(prompts) or any(p.n != 1 or p.stop for p in per):
        raise ValueError("answer() streams one sample per prompt (params for all prompts or one "
                         "per prompt) with no stop strings")
    core = engine.core
    for ids, p in zip(prompts, per):  # every prompt checked before the first is added
        core.resolve_max_tokens(len(ids), p)
    limit = engine.config.max_num_seqs
    burst = min(limit, burst or max(1, limit // 8))
    t0 = time.monotonic()
    got: dict[int, list[int]] = {}  # prompt index -> tokens so far, while queued or running
    done: dict[int, list[int]] = {}
    added = 0
    timed_out = False
    bar = tqdm(total=len(prompts), desc="answer", unit="prompt", leave=False)
    try:
        while added < len(prompts) or got:
            if max_seconds and time.monotonic() - t0 > max_seconds:
                timed_out = True
                break
            if len(got) <= limit - burst:  # a burst: refill to the batch's size at once
                for _ in range(min(limit - len(got), len(prompts) - added)):
                    core.add_request(f"answer-{added}", list(prompts[added]), per[added])
                    got[added] = []
                    added += 1
            for out in core.step():
                i = int(out.request_id.rpartition("-")[2])
                if i not in got:
                    continue
                got[i] += out.new_token_ids
                if out.finish_reason is not None:
                    done[i] = got.pop(i)
                    bar.update(1)
    finally:
        bar.close()
        core.abort_requests([f"answer-{i}" for i in got])
        while core.has_in_flight():  # the overlap's last step: its tokens are dropped
            core.step()
    partial = {i: t for i, t in got.items() if len(t) >= MIN_PARTIAL_TOKENS}
    if timed_out:
        print(f"train-drafter: answered {len(done)} of {len(prompts)} prompts, {len(partial)} "
              f"more cut short (>= {MIN_PARTIAL_TOKENS} tokens kept): --max-generate-seconds "
              f"{max_seconds:g} reached", flush=True)
    done.update(partial)
    return [(list(prompts[i]) + done[i], len(prompts[i])) for i in sorted(done)]


def split_held_out(n: int, held_out: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices of n sequences: `held_out` of them (at most a tenth, but one
    when n >= 2) chosen at random, seeded; disjoint, together all n, each sorted."""
    k = min(held_out, max(1, n // 10)) if n >= 2 else 0
    order = list(range(n))
    random.Random(seed + 104729).shuffle(order)
    return sorted(order[k:]), sorted(order[:k])
