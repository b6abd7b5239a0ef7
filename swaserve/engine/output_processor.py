"""Output processor: core outputs in, user-facing RequestOutputs out (docs/architecture.md §1).

Used in-process by the offline `Engine` and by the server frontend process. Per step it
takes the core's `EngineCoreOutput`s (one per core request), detokenizes incrementally,
finds stop strings (the core only knows stop token ids, max_tokens and the context limit),
and says which core requests to abort because their text hit a stop string.

A user request with n samples is n core requests, one per `CompletionOutput.index`; the
caller names them (`make_core_request_ids`) and the processor maps each back to its parent.

Text invariants, per child (core request):
- `text` is the detokenizer's stable text (never a partial UTF-8 character), truncated at
  a stop string once one hits (at its start, or its end with include_stop_str_in_output).
- Visible text = `text` minus its last `holdback` characters while unfinished, where
  holdback = max(len(stop)) - 1 (0 with include_stop_str_in_output): a stop string can
  only start inside that tail, so text once shown (streamed) is never cut later.
- `token_ids` are the generated ids, up to and including the one that completed the stop
  string; `logprobs` stay aligned with `token_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestOutput
from swaserve.speculative.metrics import merge_spec

if TYPE_CHECKING:
    from swaserve.sampling.params import SamplingParams


def make_core_request_ids(request_id: str, n: int) -> list[str]:
    """The core's ids for a request's n samples: the id itself for n=1, else `{id}-{i}`."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def find_stop_string(
    text: str, new_start: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The stop string completed by `text[new_start:]`, and where to truncate `text`.

    Each string is searched from `len(stop) - 1` characters before `new_start`, so a string
    split across tokens is found, and old text is never searched twice. Among several hits
    the one that completes first wins (ties: the one that starts first), which is what
    checking after every character would give. `new_start` must not be below the caller's
    floor (min_tokens); pass the floor in by clamping.
    """
    best: tuple[int, int, str] | None = None  # (end, start, string)
    for s in stop:
        start = text.find(s, max(0, new_start - len(s) + 1))
        if start != -1:
            cand = (start + len(s), start, s)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return None
    end, start, s = best
    return s, (end if include_in_output else start)


@dataclass
class _Child:
    """One core request (one sample) of a user request."""

    index: int
    core_id: str
    detok: IncrementalDetokenizer | None
    logprobs: list[Logprob] | None  # None when the request did not ask for logprobs
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_floor: int = 0  # stop strings may not start before this char (min_tokens)
    spec: dict | None = None  # the latest speculative decoding counters from the core
    # Stream mode: how much of text / token_ids / logprobs has been sent, and the finish.
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def visible_text(self, holdback: int) -> str:
        if self.finished or holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - holdback)]


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    stream: bool
    final_only: bool
    stop: list[str]
    include_stop: bool
    holdback: int
    min_tokens: int
    prompt_logprobs: list[Logprob | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)


class OutputProcessor:
    """Detokenizes, checks stop strings and builds RequestOutputs for all live requests."""

    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        # A HF fast tokenizer, a raw `tokenizers.Tokenizer`, or None (token ids only).
        self.tokenizer = tokenizer
        # Stream mode: a sample's delta waits until it has this many new tokens (its first
        # token, and its finish, go at once): vLLM's and SGLang's --stream-interval.
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.stream_interval = stream_interval
        self._requests: dict[str, _RequestState] = {}
        # Only unfinished children are here; outputs for other ids are stale and ignored.
        self._core_to_child: dict[str, tuple[_RequestState, _Child]] = {}

    # ---- lifecycle -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        core_request_ids: list[str],
        stream: bool = False,
        final_only: bool = False,
    ) -> None:
        """Registers a request whose samples run in the core as `core_request_ids` (index order).

        stream: each RequestOutput carries only what is new since the previous one (and, for
        n > 1, only the samples that changed). Otherwise outputs are cumulative; with
        final_only (non-stream), only the finished RequestOutput is returned.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not core_request_ids or len(set(core_request_ids)) != len(core_request_ids):
            raise ValueError(f"core request ids must be distinct and non-empty: {core_request_ids}")
        for cid in core_request_ids:
            if cid in self._core_to_child:
                raise ValueError(f"core request id {cid!r} is already running")
        stop = list(params.stop or [])
        if stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        include_stop = bool(params.include_stop_str_in_output)
        skip_special = bool(params.skip_special_tokens)
        spaces_special = bool(getattr(params, "spaces_between_special_tokens", True))

        def detok() -> IncrementalDetokenizer | None:
            if self.tokenizer is None or not params.detokenize:
                return None  # token ids only: `text` stays empty
            return IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special, spaces_special
            )

        children = [
            _Child(i, cid, detok(), logprobs=None if params.logprobs is None else [])
            for i, cid in enumerate(core_request_ids)
        ]
        state = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            children=children,
            stream=stream,
            final_only=final_only and not stream,
            stop=stop,
            include_stop=include_stop,
            holdback=max(map(len, stop)) - 1 if stop and not include_stop else 0,
            min_tokens=int(getattr(params, "min_tokens", 0) or 0),
        )
        self._requests[request_id] = state
        for child in children:
            self._core_to_child[child.core_id] = (state, child)

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a request; returns the core ids of its samples still running in the core."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return []
        live = [c.core_id for c in state.children if not c.finished]
        for cid in live:
            del self._core_to_child[cid]
        return live

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- per step --------------------------------------------------------------------------

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Applies one step's core outputs.

        Returns the RequestOutputs of requests that changed (in order of first appearance;
        `finished=True` once every sample finished, after which the request is forgotten)
        and the core ids to abort because their text hit a stop string.
        """
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self._core_to_child.get(out.request_id)
            if entry is None:
                continue  # finished by a stop string or aborted; the core had not heard yet
            state, child = entry
            if self._update_child(state, child, out):
                to_abort.append(child.core_id)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = out.prompt_logprobs
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if child.finished:
                state.num_finished += 1
                del self._core_to_child[child.core_id]
            changed[state.request_id] = state

        results: list[RequestOutput] = []
        for state in changed.values():
            if state.finished:
                del self._requests[state.request_id]
            ro = self._make_output(state)
            if ro is not None:
                results.append(ro)
        return results, to_abort

    def _update_child(self, state: _RequestState, child: _Child, out: EngineCoreOutput) -> bool:
        """Folds one core output into a child; True when a stop string means abort it in core."""
        new_ids = list(out.new_token_ids)
        # As in vLLM, a stop token's own text is left out unless include_stop_str_in_output.
        stop_token = out.finish_reason == "stop" and isinstance(out.stop_reason, int)
        text_ids = new_ids[:-1] if stop_token and not state.include_stop else new_ids

        kept = len(new_ids)  # ids after the one completing a stop string are dropped
        hit: tuple[str, int] | None = None
        if child.detok is not None:
            # Token by token, so we know which token completed a stop string.
            for i, tid in enumerate(text_ids):
                old_len = len(child.text)
                child.text += child.detok.add([tid])
                if len(child.token_ids) + i + 1 <= state.min_tokens:
                    child.stop_floor = len(child.text)
                elif state.stop and len(child.text) > old_len:
                    hit = self._check_stop(state, child, old_len)
                    if hit is not None:
                        kept = i + 1
                        break
            if hit is None and out.finish_reason is not None:
                old_len = len(child.text)
                child.text += child.detok.flush()
                past_min = len(child.token_ids) + len(new_ids) > state.min_tokens
                if state.stop and past_min and len(child.text) > old_len:
                    hit = self._check_stop(state, child, old_len)

        if out.spec is not None:
            child.spec = out.spec
        child.token_ids.extend(new_ids[:kept])
        if child.logprobs is not None and out.new_logprobs:
            child.logprobs.extend(out.new_logprobs[:kept])
        if hit is not None:
            child.finish_reason, child.stop_reason = "stop", hit[0]
            return out.finish_reason is None  # the core already stopped it otherwise
        if out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        return False

    @staticmethod
    def _check_stop(state: _RequestState, child: _Child, old_len: int) -> tuple[str, int] | None:
        hit = find_stop_string(
            child.text, max(old_len, child.stop_floor), state.stop, state.include_stop
        )
        if hit is not None:
            child.text = child.text[: hit[1]]
        return hit

    # ---- building outputs ------------------------------------------------------------------

    def _make_output(self, state: _RequestState) -> RequestOutput | None:
        finished = state.finished
        if state.final_only and not finished:
            return None
        prompt_logprobs = state.prompt_logprobs
        if state.stream:
            deltas = [self._delta(c, state.holdback, self.stream_interval) for c in state.children]
            outs = [co for co in deltas if co is not None]
            if state.prompt_logprobs_sent:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                state.prompt_logprobs_sent = True
            if not outs and prompt_logprobs is None and not finished:
                return None
        else:
            # The final output hands over the state's lists (the state is dropped); earlier
            # cumulative outputs get copies, since the lists keep growing.
            outs = [self._snapshot(c, state.holdback, copy=not finished) for c in state.children]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outs,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            spec_decoding=merge_spec(c.spec for c in state.children) if finished else None,
        )

    @staticmethod
    def _snapshot(child: _Child, holdback: int, copy: bool) -> CompletionOutput:
        logprobs = child.logprobs
        return CompletionOutput(
            index=child.index,
            text=child.visible_text(holdback),
            token_ids=list(child.token_ids) if copy else child.token_ids,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
            logprobs=list(logprobs) if copy and logprobs is not None else logprobs,
        )

    @staticmethod
    def _delta(child: _Child, holdback: int, interval: int = 1) -> CompletionOutput | None:
        """What is new in a child since its last delta; None when nothing is, or when fewer
        than `interval` tokens are and the child has sent before and is not finishing."""
        new_finish = child.finished and not child.sent_finish
        if (
            interval > 1
            and not new_finish
            and child.sent_tokens
            and len(child.token_ids) - child.sent_tokens < interval
        ):
            return None
        text = child.visible_text(holdback)
        if (
            len(text) == child.sent_text
            and len(child.token_ids) == child.sent_tokens
            and not new_finish
        ):
            return None
        logprobs = None
        if child.logprobs is not None:
            logprobs = child.logprobs[child.sent_logprobs :]
            child.sent_logprobs = len(child.logprobs)
        co = CompletionOutput(
            index=child.index,
            text=text[child.sent_text :],
            token_ids=child.token_ids[child.sent_tokens :],
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
            logprobs=logprobs,
        )
        child.sent_text, child.sent_tokens = len(text), len(child.token_ids)
        child.sent_finish = child.finished
        return co
