"""OpenAI API shapes: request models (pydantic, strict) and the response pieces built from
`RequestOutput`s.

Requests are validated strictly: wrong types are errors (no "5" -> 5, no true -> 1), and any
field not listed here is a 400 naming it (`suffix`, ... are never silently ignored).
`response_format` (and vLLM's `structured_outputs`) become a grammar (sampling/structured.py);
`tools` and `tool_choice` are read by server/tools.py.
Accepted beyond the OpenAI fields, with vLLM's names: `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, `stop_token_ids`, `allowed_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `structured_outputs`, `return_token_ids`, `priority`,
`truncate_prompt_tokens`, `bad_words`, `stream_options.continuous_usage_stats`,
`prompt_logprobs` and `add_generation_prompt`, `continue_final_message`, `echo`, `documents`
(chat). A JSON null means "the
default" everywhere.

Logprobs follow each endpoint's OpenAI format: completions give parallel lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), chat gives `content: [{token, logprob,
bytes, top_logprobs}]`. Values are raw log-softmax (docs/serving.md, Logprobs), -inf clamped
to -9999.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swaserve.outputs import Logprob
from swaserve.sampling.params import MAX_LOGPROBS, SamplingParams

LOGPROB_FLOOR = -9999.0


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # schemas are always enforced


class TagStructure(_Strict):
    """One structure of a legacy structural tag (vLLM's and SGLang's): once the output writes
    `begin`, a JSON value of `schema`, then `end`."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(_Strict):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object),
    "json_schema" (the given schema), or vLLM's and SGLang's "structural_tag", in xgrammar's
    form (`format`) or the legacy one (`structures` and `triggers`); held by a grammar
    (sampling/structured.py)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None  # structural_tag
    structures: list[TagStructure] | None = None  # structural_tag, legacy
    triggers: list[str] | None = None  # structural_tag, legacy

    def structured_outputs(self) -> dict[str, Any] | None:
        tag_fields = [f for f in ("format", "structures", "triggers")
                      if getattr(self, f) is not None]  # fmt: skip
        if tag_fields and self.type != "structural_tag":
            raise ValueError(f"response_format {tag_fields[0]} is only for type structural_tag")
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "structural_tag":
            if self.json_schema is not None:
                raise ValueError("response_format json_schema is not for type structural_tag")
            tag: dict[str, Any] = {"type": "structural_tag"}
            if self.format is not None:
                tag["format"] = self.format
            if self.structures is not None:
                tag["structures"] = [{"begin": s.begin, "schema": s.schema_, "end": s.end}
                                     for s in self.structures]  # fmt: skip
            if self.triggers is not None:
                tag["triggers"] = self.triggers
            return {"structural_tag": tag}  # its shape is checked there
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return {"json": self.json_schema.schema_}


def _check_unicode(x: Any) -> None:
    """JSON may escape lone surrogates ("\\udc80"), which no tokenizer or encoder takes."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (a lone surrogate was found)") from None
    elif isinstance(x, dict):
        for k, v in x.items():
            _check_unicode(k)
            _check_unicode(v)
    elif isinstance(x, list):
        for v in x:
            _check_unicode(v)


class _TextRequest(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_unicode(data)
        return data


class _SamplingRequest(_TextRequest):
    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key) -> value in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json" | "regex" | ...: ...}
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking; carries no behaviour
    # Extensions (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None  # vLLM's: with --scheduling-policy priority, lower runs first
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    bad_words: list[str] | None = None  # vLLM's: words the output never contains

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every stream chunk (vLLM's continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def _structured_outputs(self) -> dict[str, Any] | None:
        if self.response_format is not None and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs: give one of them")
        if self.response_format is not None:
            return self.response_format.structured_outputs()
        return self.structured_outputs

    def _params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """SamplingParams with OpenAI defaults, or the model's (`defaults`, from its
        generation_config: sampling/generation_defaults.py) for the fields left out; raises
        ValueError naming a bad field."""
        given = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "structured_outputs": self._structured_outputs(),
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "priority": self.priority,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "bad_words": self.bad_words,
        }
        for k, v in (defaults or {}).items():
            if given.get(k) is None:
                given[k] = v
        return SamplingParams(**{k: v for k, v in given.items() if v is not None})


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list: each item is text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        plp = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            plp = max(plp or 0, self.logprobs)
        return self._params(self.max_tokens, self.logprobs, plp, defaults)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionDef(_Strict):
    """A tool's function: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # the arguments are held to the schema whenever a grammar runs; under tool_choice "auto"
    # one strict tool asks for that grammar (server/tools.py)
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallMessage(_Strict):
    """A tool call of an earlier assistant turn, sent back in `messages`."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # An earlier answer's reasoning (--reasoning-parser's reasoning_content, or vLLM's newer
    # `reasoning`), given to the template as `reasoning_content` (Qwen3's renders it): a
    # client that appends the returned message object sends it back.
    reasoning_content: str | None = None
    reasoning: str | None = None
    # What the official client also sends back with a returned message: accepted, ignored
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: None = None  # OpenAI's legacy field: null only (tool_calls carry calls)

    def to_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: text parts joined into one string; a
        tool call's arguments as an object where they parse (templates serialise them)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        msg: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None \
            else self.reasoning
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        return msg


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: the response's top-level prompt_logprobs
    add_generation_prompt: bool | None = None
    tools: list[ToolDef] | None = Field(default=None, min_length=1)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, for reasoning models: passed to the chat template as `reasoning_effort` (as
    # vLLM does; gpt-oss's template reads it), unless chat_template_kwargs sets it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: the answer continues the last message (an assistant prefill) instead of opening
    # a new turn (add_generation_prompt then defaults to false; true with it is a 400)
    continue_final_message: bool | None = None
    # vLLM's: the answer's content starts with the last message's when that is an assistant
    # turn (with continue_final_message: the whole assistant message)
    echo: bool | None = None
    # vLLM's: documents for retrieval-augmented templates ({"title": ..., "text": ...} each)
    documents: list[dict[str, str]] | None = None

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.top_logprobs}")  # fmt: skip
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, self.prompt_logprobs, defaults)


class TokenizeRequest(_TextRequest):
    """vLLM's /tokenize: a prompt (special tokens added unless add_special_tokens is false), or
    chat messages through the chat template (none added: the template holds them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # rendered by the chat template, as for chat requests
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids to text."""

    model: str | None = None
    tokens: list[int]


# ---- errors ---------------------------------------------------------------------------------


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _path(loc: tuple) -> str:
    """A dotted field path; union branches add their type to a location ("prompt",
    "list[int]", 0): those parts are dropped."""
    return ".".join(
        str(x)
        for x in loc
        if x != "body" and not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS))
    )


def validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic/FastAPI validation errors -> (message, param) of a 400."""

    def field(e: dict) -> str | None:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        return loc[0] if loc else None

    extra = sorted({_path(e["loc"]) for e in errors if e.get("type") == "extra_forbidden"})
    if extra:
        names = ", ".join(f"'{x}'" for x in extra)
        return f"Unsupported field(s): {names}; swaserve does not implement them", extra[0]
    e = errors[0]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return f"Malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if kind == "missing" and field(e) is None:
        return "The request has no body: send a JSON object", None
    if kind == "missing":
        return f"Missing required field '{field(e)}'", field(e)
    if kind == "model_attributes_type" and field(e) is None:
        return (
            "The request body must be a JSON object (with Content-Type: application/json)",
            None,
        )
    where = _path(e.get("loc", ()))
    msg = e.get("msg")
    if len({str(x.get("loc", ())[:2]) for x in errors}) == 1 and len(errors) > 1:
        msg = "; ".join(dict.fromkeys(str(x.get("msg")) for x in errors))
    if not where:
        return f"Invalid request: {msg}", None
    return f"Invalid value for '{where}': {msg}", field(e)


def param_of(message: str) -> str | None:
    """The field a SamplingParams ValueError names (its first word), if it is one."""
    word = message.split(" ", 1)[0]
    return word if word.isidentifier() else None


# ---- response pieces ------------------------------------------------------------------------


def clamp(x: float) -> float:
    return LOGPROB_FLOOR if math.isnan(x) or x < LOGPROB_FLOOR else x


class TokenText:
    """Token id -> its text (as one token decodes alone), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            if self._backend is None:
                s = f"token_id:{tid}"
            else:
                s = self._backend.decode([tid], skip_special_tokens=False)
            if len(self._cache) < 1_000_000:
                self._cache[tid] = s
        return s


def completion_logprobs(
    lps: list[Logprob | None], text: TokenText, offset: int = 0
) -> dict[str, list]:
    """OpenAI completions format; a None entry (the first prompt token) has no logprob."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for lp in lps:
        if lp is None:
            continue
        tok = text(lp.token_id)
        out["tokens"].append(tok)
        out["token_logprobs"].append(clamp(lp.logprob))
        out["top_logprobs"].append({text(t): clamp(v) for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def prompt_completion_logprobs(
    prompt_ids: list[int], lps: list[Logprob | None] | None, text: TokenText
) -> dict[str, list]:
    """Echoed prompt tokens in completions format: the first has null logprobs."""
    lps = list(lps or [])
    lps += [None] * (len(prompt_ids) - len(lps))
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = 0
    for tid, lp in zip(prompt_ids, lps):
        tok = text(tid)
        out["tokens"].append(tok)
        out["token_logprobs"].append(None if lp is None else clamp(lp.logprob))
        out["top_logprobs"].append(None if lp is None else {text(t): clamp(v) for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def merge_completion_logprobs(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    shift = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
    return {
        "tokens": a["tokens"] + b["tokens"],
        "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
        "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
        "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]],
    }


def chat_logprobs(lps: list[Logprob], text: TokenText) -> dict[str, Any]:
    def entry(tid: int, v: float) -> dict[str, Any]:
        tok = text(tid)
        return {"token": tok, "logprob": clamp(v), "bytes": list(tok.encode("utf-8"))}

    content = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(e)
    return {"content": content, "refusal": None}


def vllm_prompt_logprobs(lps: list[Logprob | None], text: TokenText) -> list[dict | None]:
    """The `prompt_logprobs` extension (vLLM's shape): per prompt token, id -> details."""
    out: list[dict | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        d = {
            str(lp.token_id): {
                "logprob": clamp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": text(lp.token_id),
            }
        }
        for rank, (t, v) in enumerate(lp.top, start=1):
            d.setdefault(str(t), {"logprob": clamp(v), "rank": rank, "decoded_token": text(t)})
        out.append(d)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
