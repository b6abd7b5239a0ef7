"""SamplingParams: one request's decoding knobs, with vLLM's names, defaults and limits.

Validation happens once, in `__post_init__`, and raises `ValueError` naming the field and
the allowed range; the server turns that into a 400. Everything downstream (sampler,
scheduler, output processor) may trust the values. `to_dict`/`from_dict` use plain types
only, because the params cross the msgpack IPC boundary between server and core.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from swaserve.sampling.structured import normalise as normalise_structured

# Below this temperature a request is treated as greedy (vLLM's _SAMPLING_EPS): dividing
# logits by a tiny temperature only risks inf/nan for the same answer as argmax.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # what both torch.Generator and msgpack accept
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off (-1 is normalised to 0)
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    max_tokens: int | None = None  # None = the rest of the context (the engine decides)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = chosen token plus top-k alternatives
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> value added to its logit before penalties and sampling (OpenAI's logit_bias;
    # -100 in effect bans a token, +100 forces it). JSON's string keys ("50256") are accepted
    # and normalised to int; logprobs stay those of the raw logits.
    logit_bias: dict[int, float] | None = None
    # vLLM's: sample only among these token ids (the others' logits at -inf)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output never contains (sampling/bad_words.py). The frontend, which
    # has the tokenizer, fills bad_words_token_ids (the token sequences spelling them); the
    # engine core reads only those.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # The output held to a grammar (sampling/structured.py): exactly one of {"json": schema},
    # {"json_object": True}, {"regex": str}, {"choice": [str, ...]}, {"grammar": EBNF},
    # {"structural_tag": ...} (vLLM's `structured_outputs`); the server maps OpenAI's
    # response_format onto it.
    structured_outputs: dict[str, Any] | None = None
    # A thinking model's reasoning block, kept out of the grammar (sampling/reasoning_gate.py;
    # the server sets these with --reasoning-parser, as vLLM starts the grammar after the
    # reasoning): [open, close] token ids (`<think>`, `</think>`). The grammar holds from the
    # first token unless the output opens with `open` (which the first token's mask allows),
    # then from the token after `close`. `reasoning_started`: the prompt opened the block
    # (DeepSeek-R1's template), so the grammar waits for `close` from the start. Without
    # structured_outputs they change nothing.
    reasoning_markers: list[int] | None = None
    reasoning_started: bool = False
    # --scheduling-policy priority (engine/scheduler.py, vLLM's): lower runs first, ties by
    # arrival; must stay 0 under fcfs
    priority: int = 0
    # vLLM's: k >= 1 keeps only the prompt's last k tokens (left truncation); -1 keeps the
    # last max_model_len (engine/limits.py truncate_prompt); None keeps the whole prompt
    truncate_prompt_tokens: int | None = None
    # False: token ids only, no text (as vLLM's): saves the incremental detokenization's host
    # work per token (train-drafter's answers, benchmarks); stop strings then cannot be found
    detokenize: bool = True

    def __post_init__(self) -> None:
        self._check_real("temperature", 0.0, math.inf, "must be >= 0")
        self._check_real("top_p", 0.0, 1.0, "must be in (0, 1]", low_open=True)
        self._check_real("min_p", 0.0, 1.0, "must be in [0, 1]")
        self._check_real("frequency_penalty", -2.0, 2.0, "must be in [-2, 2]")
        self._check_real("presence_penalty", -2.0, 2.0, "must be in [-2, 2]")
        self._check_real("repetition_penalty", 0.0, math.inf, "must be > 0", low_open=True)

        self._check_int("n", 1, None, "must be >= 1")
        self._check_int("top_k", -1, None, "must be -1 or 0 (off) or >= 1")
        if self.top_k == -1:
            self.top_k = 0
        self._check_int("min_tokens", 0, None, "must be >= 0")
        if self.max_tokens is not None:
            self._check_int("max_tokens", 1, None, "must be >= 1 or None")
            if self.min_tokens > self.max_tokens:
                raise ValueError(
                    f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                    f"and max_tokens={self.max_tokens}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                self._check_int(name, 0, MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}] or None")
        self._check_int("priority", -(2**63), 2**63 - 1, "must be an integer")
        if self.truncate_prompt_tokens is not None:
            self._check_int("truncate_prompt_tokens", -1, None, "must be -1 or >= 1")
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 or >= 1, got 0")
        if self.seed is not None:
            self._check_int("seed", _SEED_MIN, _SEED_MAX, "must be an integer in [-2**63, 2**64)")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not (isinstance(ids, (list, tuple)) and ids
                    and all(_is_int(t) and 0 <= t < 2**63 for t in ids)):
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}"
                )
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            w = self.bad_words
            if not (isinstance(w, (list, tuple)) and all(isinstance(x, str) and x.strip()
                                                         for x in w)):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {w!r}")
            self.bad_words = list(w)
        if self.bad_words_token_ids is not None:
            w = self.bad_words_token_ids
            if not (isinstance(w, (list, tuple)) and all(
                    isinstance(x, (list, tuple)) and x and all(_is_int(t) and 0 <= t < 2**63
                                                               for t in x) for x in w)):
                raise ValueError("bad_words_token_ids must be a list of non-empty token id "
                                 f"lists, got {w!r}")
            self.bad_words_token_ids = [list(x) for x in w]
        self.structured_outputs = normalise_structured(self.structured_outputs)
        if self.reasoning_markers is not None:
            m = self.reasoning_markers
            if not (isinstance(m, (list, tuple)) and len(m) == 2
                    and all(_is_int(t) and 0 <= t < 2**63 for t in m) and m[0] != m[1]):
                raise ValueError(
                    f"reasoning_markers must be two different token ids [open, close], got {m!r}"
                )
            self.reasoning_markers = list(m)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "detokenize", "reasoning_started"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are found in the text)")

    # ---- validation helpers -------------------------------------------------------------

    def _check_real(self, name: str, lo: float, hi: float, rule: str, low_open=False) -> None:
        x = getattr(self, name)
        # NaN and inf fail every check.
        ok = _is_real(x) and math.isfinite(x) and (lo < x if low_open else lo <= x) and x <= hi
        if not ok:
            raise ValueError(f"{name} {rule}, got {x!r}")
        setattr(self, name, float(x))

    def _check_int(self, name: str, lo: int, hi: int | None, rule: str) -> None:
        x = getattr(self, name)
        if not (_is_int(x) and x >= lo and (hi is None or x <= hi)):
            raise ValueError(f"{name} {rule}, got {x!r}")

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers or None, got {ids!r}")
        for t in ids:
            if not (_is_int(t) and t >= 0):
                raise ValueError(f"stop_token_ids must be integers >= 0, got {t!r}")
        return list(ids)

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        """A dict (or the list of [id, value] pairs `to_dict` writes) -> {id: value}; an empty
        one is None."""
        if bias is None:
            return None
        if isinstance(bias, (list, tuple)) and all(
            isinstance(kv, (list, tuple)) and len(kv) == 2 for kv in bias
        ):
            bias = dict(bias)
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        out: dict[int, float] = {}
        for k, v in bias.items():
            t = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k
            if not (_is_int(t) and 0 <= t < 2**63):
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
            if not (_is_real(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):  # NaN fails too
                raise ValueError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {v!r} for token {k}"
                )
            out[t] = float(v)
        return out or None

    # ---- derived -----------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature (effectively) 0, or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def edits_logits(self) -> bool:
        """A logit bias, an allowed set or bad words: its argmax is not the raw logits' (as
        penalties)."""
        return (self.logit_bias is not None or self.allowed_token_ids is not None
                or bool(self.bad_words_token_ids))

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    # ---- IPC -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (int, float, bool, str, None, list), safe for msgpack (logit_bias as
        [id, value] pairs: msgpack's default unpacker takes only string keys)."""
        d = asdict(self)
        if self.logit_bias is not None:
            d["logit_bias"] = [[t, b] for t, b in self.logit_bias.items()]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown SamplingParams fields: {sorted(unknown)}")
        return cls(**d)
