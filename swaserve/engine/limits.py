"""The context rule, shared by the engine and the server frontend (which must not import the
model stack): how long the context is, and what a prompt and its max_tokens may be."""

from __future__ import annotations

from dataclasses import dataclass

from swaserve.sampling.params import SamplingParams


class PromptError(ValueError):
    """A prompt the context cannot take; `param` names the offending request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ContextLimit:
    """The most tokens (prompt + output) one request may reach, and why: the model's context
    (`max_model_len`), or all that the KV pool holds for one request when that is less."""

    tokens: int
    by_kv_pool: bool = False

    def describe(self) -> str:
        if self.by_kv_pool:
            return f"the {self.tokens} tokens that fit in the KV pool for one request"
        return f"the context of {self.tokens} tokens (max_model_len)"


def check_model_len(requested: int | None, model_max: int) -> int:
    """--max-model-len against the model's maximum (max_position_embeddings): returns the
    context to use (the model's maximum when not set), or raises ValueError naming both."""
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(
            f"--max-model-len {requested} is above the model's maximum context of {model_max} "
            "tokens (max_position_embeddings in its config.json)"
        )
    return requested


def fit_context(
    max_model_len: int,
    explicit: bool,
    pool_tokens: int,
    pool: str = "",
    flags: str = "--kv-cache-gb",
) -> ContextLimit:
    """The context once the KV pool is sized: `max_model_len` when one request of that length
    fits (`pool_tokens`: MemoryManager.max_request_tokens), else the pool's limit when the
    user did not set --max-model-len (`explicit` false; the caller warns). Raises ValueError
    when fewer than 2 tokens fit, or when an explicit --max-model-len does not fit. `pool`
    describes the pool, `flags` names the flags that size it (both for the messages)."""
    where = f"the KV pool ({pool})" if pool else "the KV pool"
    if pool_tokens < 2:
        raise ValueError(f"{where} cannot hold one request; raise {flags}")
    if pool_tokens >= max_model_len:
        return ContextLimit(max_model_len)
    if explicit:
        raise ValueError(
            f"--max-model-len {max_model_len} does not fit in {where}, which holds "
            f"{pool_tokens} tokens for one request; raise {flags} or lower --max-model-len"
        )
    return ContextLimit(pool_tokens, by_kv_pool=True)


def truncate_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt as the request's `truncate_prompt_tokens` keeps it (vLLM's left truncation):
    its last k tokens, or its last max_model_len for -1; the whole prompt when not set."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in ids):
        raise PromptError(f"prompt token ids must be in [0, {vocab_size})", "prompt")


def check_vocab_ids(params: SamplingParams, vocab_size: int) -> None:
    """The token ids a request's params name (stop_token_ids, logit_bias, allowed_token_ids,
    reasoning_markers) must be in the vocabulary; PromptError naming the field otherwise."""
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ()),
                      ("reasoning_markers", params.reasoning_markers or ()),
                      ("bad_words", [t for w in params.bad_words_token_ids or () for t in w]),
                      ):  # fmt: skip
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise PromptError(
                f"{name} must name token ids below the vocabulary size {vocab_size}, got {bad[0]}",
                name,
            )


def check_satisfiable(params: SamplingParams, eos_token_ids: list[int]) -> None:
    """PromptError when the sampling rules leave no token to sample at some step: every
    allowed_token_ids id ends the request while min_tokens forbids ending, or bad words of one
    token ban every allowed id (the masks would leave a row of -inf)."""
    allowed = params.allowed_token_ids
    if allowed is None:
        return
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
    if set(allowed) <= banned:
        raise PromptError("bad_words ban every one of allowed_token_ids", "bad_words")
    if params.min_tokens > 0 and set(allowed) <= ends | banned:
        raise PromptError(
            f"min_tokens {params.min_tokens} cannot be met: every allowed token ends the "
            "request (a stop or end-of-sequence token) or is banned by bad_words", "min_tokens",
        )


def check_priority(params: SamplingParams, policy: str) -> None:
    """A request's priority means something only under --scheduling-policy priority (vLLM's
    rule): PromptError naming `priority` otherwise."""
    if params.priority != 0 and policy != "priority":
        raise PromptError(
            f"priority {params.priority} needs --scheduling-policy priority (this engine "
            f"schedules {policy})", "priority",
        )


def check_prompt(
    limit: int | ContextLimit, num_prompt_tokens: int, params: SamplingParams
) -> int:
    """The context rule, shared by the engine and the server: returns the max_tokens to use
    (the rest of the context when omitted) or raises PromptError naming the limit (the KV
    pool when `limit` came from it; a plain int is the model's max_model_len)."""
    if not isinstance(limit, ContextLimit):
        limit = ContextLimit(limit)
    n = num_prompt_tokens
    if n == 0:
        raise PromptError("the prompt is empty", "prompt")
    if n >= limit.tokens:
        raise PromptError(
            f"the prompt has {n} tokens, leaving no room to generate within {limit.describe()}",
            "prompt",
        )
    if params.max_tokens is None:
        return limit.tokens - n
    if n + params.max_tokens > limit.tokens:
        raise PromptError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"{limit.describe()}",
            "max_tokens",
        )
    return params.max_tokens
