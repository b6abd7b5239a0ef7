"""vLLM's `bad_words`: words the output must never contain.

The frontend (server or offline Engine), which has the tokenizer, turns each word into the
token sequences that spell it (`resolve_bad_words`): the word as given, stripped of leading
spaces, and with one leading space (most tokenizers spell a word inside a sentence that way).
The sampler then bans, at each step, the last token of every sequence whose other tokens
end the output so far (`banned_tokens`): a one-token word is banned always, a longer one
only where its prefix has just been written, so the word itself never completes.

A word's prefix counts in the output only (not in the prompt), as in vLLM; multi-token words
read the values of earlier output tokens, so such requests run without the overlap schedule
(engine/core.py `_needs_history`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from swaserve.sampling.params import SamplingParams


def word_token_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """The token sequences that spell `words` (with and without a leading space), unique, in
    order."""
    out: list[list[int]] = []
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return out


def resolve_bad_words(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with bad_words_token_ids filled from its bad_words (ValueError without a
    tokenizer); the same object when it has no bad_words."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    if tokenizer is None:
        raise ValueError("bad_words need the model's tokenizer, and this model has none")
    return replace(params, bad_words_token_ids=word_token_ids(params.bad_words, tokenizer))


def banned_tokens(words: list[list[int]], output: list[int]) -> set[int]:
    """The tokens that would complete one of `words` after `output`."""
    banned = set()
    for ids in words:
        k = len(ids) - 1
        if k == 0 or (len(output) >= k and output[-k:] == ids[:-1]):
            banned.add(ids[-1])
    return banned
