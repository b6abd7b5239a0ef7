"""The context rule, shared by the engine and the server frontend (which must not import the
model stack): what a prompt and its max_tokens may be."""

from __future__ import annotations

from swaserve.sampling.params import SamplingParams


class PromptError(ValueError):
    """A prompt the context cannot take; `param` names the offending request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in ids):
        raise PromptError(f"prompt token ids must be in [0, {vocab_size})", "prompt")


def check_prompt(max_model_len: int, num_prompt_tokens: int, params: SamplingParams) -> int:
    """The context rule, shared by the engine and the server: returns the max_tokens to use
    (the rest of the context when omitted) or raises PromptError naming the limit."""
    limit, n = max_model_len, num_prompt_tokens
    if n == 0:
        raise PromptError("the prompt is empty", "prompt")
    if n >= limit:
        raise PromptError(
            f"the prompt has {n} tokens; the context is {limit} tokens (max_model_len), "
            "leaving no room to generate",
            "prompt",
        )
    if params.max_tokens is None:
        return limit - n
    if n + params.max_tokens > limit:
        raise PromptError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
            f"{limit} tokens (max_model_len)",
            "max_tokens",
        )
    return params.max_tokens
