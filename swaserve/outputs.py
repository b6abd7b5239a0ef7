"""What the engine returns to users (vLLM's names) and what the core emits per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One position's logprobs: the chosen token and the top alternatives (raw log-softmax)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the chosen token in the distribution
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that hit
    logprobs: list[Logprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    prompt_logprobs: list[Logprob | None] | None = None  # first position has none
    finished: bool = False
    # Speculative decoding counters (swaserve/speculative/metrics.py) of all samples, once
    # finished; None with speculation off.
    spec_decoding: dict | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One streaming delta of a request from two consecutive ones (`b` after `a`): each
    sample's text, token ids and logprobs joined, the later finish, prompt logprobs from the
    one that has them. What a stream that fell behind sends as one chunk (server/app.py)."""
    samples = {co.index: co for co in a.outputs}
    for co in b.outputs:
        first = samples.get(co.index)
        if first is None:
            samples[co.index] = co
            continue
        logprobs = first.logprobs
        if co.logprobs is not None:
            logprobs = co.logprobs if logprobs is None else logprobs + co.logprobs
        samples[co.index] = CompletionOutput(
            index=co.index,
            text=first.text + co.text,
            token_ids=first.token_ids + co.token_ids,
            finish_reason=co.finish_reason or first.finish_reason,
            stop_reason=co.stop_reason if co.finish_reason else first.stop_reason,
            logprobs=logprobs,
        )
    return RequestOutput(
        request_id=b.request_id,
        prompt=b.prompt,
        prompt_token_ids=b.prompt_token_ids,
        outputs=sorted(samples.values(), key=lambda co: co.index),
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        finished=b.finished,
        spec_decoding=b.spec_decoding if b.spec_decoding is not None else a.spec_decoding,
    )


@dataclass
class EngineCoreOutput:
    """One request's news from one core step. Plain data: it crosses the IPC boundary as msgpack.

    `request_id` is the core's id (one per sampled sequence: a request with n=2 is two core
    requests). `finish_reason` is set by the core for stop token ids, max_tokens, the context
    limit and aborts; stop strings are found later by the output processor.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    new_logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None  # sent once, with the first token
    num_cached_tokens: int = 0
    spec: dict | None = None  # speculative decoding counters, with the finishing output
