"""Training text for `swaserve train-drafter`: prompts, the target's greedy answers, and a
held-out split.

    built-in prompts  the target writes users' messages (drafter_prompts.py: numbered
                      lists it continues, sampled with a seed per request), deduplicated,
                      topped up with written templates when too few survive
    answers           the target continues every prompt (greedy by default, as the served
                      model is in the benchmark), in chunks, so that `max_seconds` can stop
                      early with what is done
    split             whole sequences (so whole prompts) go to the held-out set: no prompt
                      of it is trained on
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

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


def answer(
    engine: Any,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    chunk: int = 4096,
    max_seconds: float = 0,
) -> list[tuple[list[int], int]]:
    """(prompt + continuation, prompt length) per prompt, in order; chunk by chunk, stopping
    after the chunk in which `max_seconds` (0: no limit) ran out."""
    t0 = time.monotonic()
    seqs: list[tuple[list[int], int]] = []
    for start in range(0, len(prompts), chunk):
        if max_seconds and time.monotonic() - t0 > max_seconds:
            print(f"train-drafter: answered {len(seqs)} of {len(prompts)} prompts: "
                  f"--max-generate-seconds {max_seconds:g} reached", flush=True)
            break
        part = list(prompts[start : start + chunk])
        outs = engine.generate(prompt_token_ids=part, sampling_params=params, use_tqdm=True)
        seqs += [(p + list(o.token_ids), len(p)) for p, o in zip(part, outs)]
    return seqs


def split_held_out(n: int, held_out: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices of n sequences: `held_out` of them (at most a tenth, but one
    when n >= 2) chosen at random, seeded; disjoint, together all n, each sorted."""
    k = min(held_out, max(1, n // 10)) if n >= 2 else 0
    order = list(range(n))
    random.Random(seed + 104729).shuffle(order)
    return sorted(order[k:]), sorted(order[:k])
