"""A fuzz campaign against the real server (one `swaserve serve` of smollm2-135m-instruct, the
session's `server`): hypothesis draws request bodies for /v1/completions, /v1/chat/completions
and /v1/responses, every documented field given a valid value, an invalid one, a wrong type, a
null or left out, plus unknown fields, unicode and prompts past the context.

Each field's value carries a verdict: OK (the server must take it), BAD (it must refuse it with
a 400) or MAYBE (either). A body whose values are all OK (and whose fields agree) must get a
200; one with a BAD value a 400 with OpenAI's error body; none may get a 5xx or hang. 200 bodies
must parse as the `openai` client's types; streams must be JSON chunks ending in
`data: [DONE]` (the Responses API: events ending in response.completed or .incomplete). After
each run the server is healthy and idle: no request holds KV pages (/v1/memory).

Targeted tests: a client that leaves mid-stream (each endpoint) or before a whole answer, and
bursts of 16 mixed requests at once; both end idle.

Cases excluded from the generators are marked `# BUG:`: known server bugs, kept out so that the
rest of the space is explored; remove the exclusion with the fix.
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from tests.e2e.conftest import MODEL

EOS = 2  # smollm2-135m-instruct's end of sequence (<|im_end|>)

pytestmark = pytest.mark.slow

VOCAB = 49152  # smollm2's vocabulary
CONTEXT = 2048  # the session server's --max-model-len
MAX_N = 4  # its --max-n
MAX_LOGPROBS = 20
EXAMPLES = 600  # per endpoint: the whole file takes ~3 minutes on 2 cores

OK, MAYBE, BAD = 0, 1, 2  # a value's verdict; a body's is its worst value's

_RESPONSE_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


# ---- value strategies: (value, verdict) -------------------------------------------------------


class Field:
    """A field's strategies of (value, verdict): `valid` draws OK values, `invalid` BAD or
    MAYBE ones; `a | b` joins two fields' branches."""

    def __init__(self, good: list, rest: list) -> None:
        self.good, self.rest = good, rest

    def __or__(self, other: Field) -> Field:
        return Field(self.good + other.good, self.rest + other.rest)

    @property
    def valid(self) -> st.SearchStrategy:
        return st.one_of(self.good)

    @property
    def invalid(self) -> st.SearchStrategy:
        return st.one_of(self.rest or self.good)


def one(*fields: Field) -> Field:
    out = Field([], [])
    for f in fields:
        out = out | f
    return out


def ok(s: st.SearchStrategy) -> Field:
    return Field([s.map(lambda v: (v, OK))], [])


def bad(s: st.SearchStrategy) -> Field:
    return Field([], [s.map(lambda v: (v, BAD))])


def maybe(s: st.SearchStrategy) -> Field:
    return Field([], [s.map(lambda v: (v, MAYBE))])


def j(*values: Any) -> st.SearchStrategy:
    return st.sampled_from(values)


NULL = ok(st.none())  # null means the default, for every optional field
TEXT = st.text(max_size=12)  # any unicode (hypothesis draws surrogates too: see _lone)
NONEMPTY = st.text(min_size=1, max_size=12)
TOKEN = st.integers(0, VOCAB - 1)
PAST_VOCAB = st.one_of(st.integers(VOCAB, VOCAB + 10), j(10**9, 2**40))
WIRE_OVERFLOW = j(2**64, 2**70, -(2**63) - 1, -(2**70))  # past msgpack's integers
NAN_INF = j(math.nan, math.inf, -math.inf)  # JSON NaN/Infinity, which json.loads takes


def _not_int() -> st.SearchStrategy:
    """Wrong types for an integer field (strict: no "5", no 5.0, no true)."""
    return bad(st.one_of(j(1.0, 2.5, "3", "", True, False, [1], {"a": 1}), TEXT))


def _not_real() -> st.SearchStrategy:
    """Wrong types for a number field (an integer is a number)."""
    return bad(st.one_of(j("1.0", "", True, [0.5], {"v": 1}), TEXT))


def _not_bool() -> st.SearchStrategy:
    return bad(j(0, 1, "true", "false", "", [True], {}, 1.0))


def _not_str() -> st.SearchStrategy:
    return bad(j(0, 1.5, True, ["a"], {"a": "b"}))


def real(lo: float, hi: float, *, low_open: bool = False) -> st.SearchStrategy:
    """A number field valid in [lo, hi] (or (lo, hi])."""
    inside = st.floats(lo, hi, exclude_min=low_open, allow_nan=False)
    outside = st.one_of(
        st.floats(hi, 1e30, exclude_min=True), st.floats(-1e30, lo, exclude_max=not low_open)
    )
    return one(
        NULL,
        ok(inside),
        ok(st.integers(math.ceil(lo + low_open), math.floor(hi))),
        bad(outside),
        bad(NAN_INF),
        _not_real(),
    )


def boolean() -> st.SearchStrategy:
    return one(NULL, ok(st.booleans()), _not_bool())


SAMPLING: dict[str, st.SearchStrategy] = {
    # any temperature >= 0 (vLLM's rule; OpenAI's 2 is no limit here)
    "temperature": one(
        NULL,
        ok(st.floats(0, 1e6)),
        ok(st.integers(0, 5)),
        ok(j(2.5, 1e300)),
        bad(st.floats(-1e30, 0, exclude_max=True)),
        bad(NAN_INF),
        _not_real(),
    ),
    "top_p": real(0.0, 1.0, low_open=True),
    "top_k": one(
        NULL, ok(j(-1, 0, 1, 2, 50, VOCAB, 10**6)), bad(j(-2, -100)), bad(WIRE_OVERFLOW), _not_int()
    ),
    "min_p": real(0.0, 1.0),
    "seed": one(
        NULL,
        ok(st.integers(-(2**63), 2**64 - MAX_N)),
        bad(j(2**64, -(2**63) - 1)),
        bad(WIRE_OVERFLOW),
        _not_int(),
    ),
    "repetition_penalty": one(
        NULL, ok(st.floats(0.01, 3)), bad(j(0, 0.0, -1.0)), bad(NAN_INF), _not_real()
    ),
    "frequency_penalty": real(-2.0, 2.0),
    "presence_penalty": real(-2.0, 2.0),
    "user": one(NULL, ok(TEXT), _not_str()),
}

LOGIT_BIAS = one(
    NULL,
    ok(st.dictionaries(TOKEN.map(str), st.floats(-100, 100), max_size=3)),
    bad(st.dictionaries(PAST_VOCAB.map(str), st.floats(-100, 100), min_size=1, max_size=2)),
    bad(
        j(
            {"abc": 1},
            {"-1": 1},
            {"1.5": 1},
            {" 7": 1},
            {"\u0663": 1},
            {"": 1},
            {"99999999999999999999999": 1},
        )
    ),
    bad(
        st.dictionaries(
            TOKEN.map(str),
            st.one_of(
                st.floats(100, 1e9, exclude_min=True),
                st.floats(-1e9, -100, exclude_max=True),
                NAN_INF,
            ),
            min_size=1,
            max_size=2,
        )
    ),
    bad(j({"5": "x"}, {"5": None}, {"5": [1]}, {"5": True}, [[5, 1]], [5], "5:1", 5)),
)
IDS = st.lists(TOKEN, min_size=1, max_size=4)
BAD_IDS = st.one_of(
    st.lists(TOKEN, max_size=2).flatmap(lambda xs: PAST_VOCAB.map(lambda t: [*xs, t])),
    j([-1], [1, -5], [1.5], ["1"], [True], [None], [[1]], 3, "1,2"),
)
COMMON: dict[str, st.SearchStrategy] = {
    **SAMPLING,
    "n": one(
        NULL,
        ok(j(1, 2)),
        ok(j(3, MAX_N)),
        bad(j(0, -1, MAX_N + 1, 100, 10**12)),
        bad(WIRE_OVERFLOW),
        _not_int(),
    ),
    "stop": one(
        NULL,
        ok(NONEMPTY),
        ok(st.lists(NONEMPTY, max_size=3)),
        ok(j("\n", ".", "\u00e9", "\U0001f600", " the")),
        bad(j("", [""], ["a", ""], [1], 5, [None], {"a": 1}, [["a"]])),
    ),
    "stop_token_ids": one(NULL, ok(IDS), ok(st.just([])), bad(BAD_IDS)),
    "allowed_token_ids": one(
        NULL, ok(IDS), ok(j([2], [28, 29, 30], list(range(100)))), bad(BAD_IDS), bad(st.just([]))
    ),
    "logit_bias": LOGIT_BIAS,
    "min_tokens": one(NULL, ok(st.integers(0, 3)), bad(j(-1, -100)), _not_int()),
    "ignore_eos": boolean(),
    "skip_special_tokens": boolean(),
    "include_stop_str_in_output": boolean(),
    "return_token_ids": boolean(),
    "priority": one(NULL, ok(st.just(0)), bad(j(1, -1, 2**40)), _not_int()),
    "model": one(ok(j(MODEL)), NULL, Field([], [st.just(("no-such-model", "404"))]), _not_str()),
}

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a"]}  # fmt: skip
RESPONSE_FORMAT = one(
    NULL,
    ok(
        j(
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": True}},
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "array", "items": {"enum": [1, 2]}},
                },
            },
        )
    ),
    maybe(
        j(
            {
                "type": "structural_tag",
                "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}],
                "triggers": ["<a"],
            },
            {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}},
        )
    ),
    bad(
        j(
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"name": "x"}},
            {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "y": 1}},
            {"type": "xml"},
            {"type": "text", "format": {}},
            {},
            "json",
            [],
            1,
            {"type": "structural_tag"},
            {"type": "structural_tag", "format": 5},
        )
    ),
    maybe(j({"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}})),
)


def _nested(depth: int) -> dict:
    """A schema of arrays `depth` deep."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# Schemas nested past MAX_JSON_DEPTH (xgrammar's compile time grows steeply with depth: ~600
# levels held the server 10-35 s once) and past Python's recursion limit are 400s.
STRUCTURED = one(
    NULL,
    ok(
        j(
            {"regex": "[a-z]{1,5}"},
            {"choice": ["yes", "no"]},
            {"json": SCHEMA},
            {"json": json.dumps(SCHEMA)},
            {"json_object": True},
            {"grammar": 'root ::= "a" | "b"'},
            {"choice": ["\u00e9t\u00e9", "\U0001f600"]},
        )
    ),
    bad(
        j(
            {"regex": "("},
            {"regex": "[a-"},
            {"bogus": 1},
            {"regex": "a", "choice": ["b"]},
            {"json": "{not json"},
            {"grammar": "root ::="},
            {"grammar": ""},
            {"choice": [1, 2]},
            {"regex": 5},
            {"json": {"type": "bogus"}},
            {"choice": "ab"},
            {"json": _nested(300)},
            {"json": "[" * 5000 + "]" * 5000},
        )
    ),
    maybe(
        j(
            {},
            {"choice": []},
            {"choice": [""]},
            {"regex": ""},
            {"json": None},
            {"regex": "\\d+", "json": None},
            {"json_object": False},
        )
    ),
)


def _verdict(fields: dict[str, tuple[Any, Any]]) -> tuple[dict, set[int]]:
    """(the body, the statuses its values allow)."""
    body, worst, wrong_model = {}, OK, False
    for k, (v, verdict) in fields.items():
        body[k] = v
        if verdict == "404":
            wrong_model = True
        else:
            worst = max(worst, verdict)
    if wrong_model:
        return body, {404} if worst == OK else {400, 404}
    return body, {OK: {200}, MAYBE: {200, 400}, BAD: {400}}[worst]


BAD_COUNTS = st.sampled_from([0, 0, 0, 1, 1, 2])  # fields drawn from `invalid` per body


@st.composite
def _fields(draw, required: dict[str, Field], optional: dict[str, Field], most: int = 6) -> dict:
    """`required`'s fields and a few of `optional`'s, 0-2 of them invalid."""
    names = [*required, *draw(st.lists(st.sampled_from(sorted(set(optional) - set(required))),
                                       max_size=most, unique=True))]  # fmt: skip
    spec = {**optional, **required}
    k = draw(BAD_COUNTS)
    wrong = set(draw(st.lists(st.sampled_from(names), min_size=1, max_size=k, unique=True))
                if k else ())  # fmt: skip
    return {n: draw(spec[n].invalid if n in wrong else spec[n].valid) for n in names}


def _pack(items: list[tuple[Any, Any]]) -> tuple[list, Any]:
    return [v for v, _ in items], max(v for _, v in items)


@st.composite
def _with_one(draw, item: Field, most: int = 3) -> tuple[list, Any]:
    """A list of valid items and one invalid one, somewhere."""
    xs = draw(st.lists(item.valid, max_size=most - 1))
    xs.insert(draw(st.integers(0, len(xs))), draw(item.invalid))
    return _pack(xs)


def items(item: Field, most: int = 3) -> Field:
    """A list field of `item`s (at least one)."""
    return Field(
        [st.lists(item.valid, min_size=1, max_size=most).map(_pack)], [_with_one(item, most)]
    )


@st.composite
def _extras(draw) -> dict:
    """Unknown fields: OpenAI's that swaserve does not implement, and made-up ones."""
    if draw(st.integers(0, 9)) != 0:
        return {}
    name = draw(
        st.one_of(
            j(
                "suffix",
                "best_of",
                "functions",
                "function_call",
                "logprobs_x",
                "max_tokens ",
                "Temperature",
                "guided_json",
                "modalities",
            ),
            st.text(min_size=1, max_size=8),
        )
    )
    return {name: (draw(st.one_of(st.none(), st.integers(), TEXT)), BAD)}


def _long_text(words: int) -> str:
    return " ".join(["hello world"] * (words // 2))


STREAM = {
    "stream": boolean(),
    "stream_options": one(
        ok(j({"include_usage": True}, {"include_usage": False}, {}, {"include_usage": None})),
        bad(j({"include_usage": 1}, {"bogus": True}, "yes", [])),
    ),
}


def _cross_checks(fields: dict, max_tokens: tuple[Any, Any] | None) -> None:
    """Field pairs that must agree: min_tokens <= max_tokens; one grammar at most;
    stream_options only with stream true."""
    so = fields.get("stream_options")
    if so and so[1] == OK and so[0] is not None and fields.get("stream", (None,))[0] is not True:
        fields["stream_options"] = (so[0], BAD)
    mt, mn = max_tokens, fields.get("min_tokens")
    if mt and mn and mt[1] == OK and mn[1] == OK and mt[0] is not None and mn[0] is not None:
        if mn[0] > mt[0]:
            fields["min_tokens"] = (mn[0], BAD)
    # min_tokens with allowed_token_ids that all end the request (smollm2's EOS is 2): a 400
    allowed, mn = fields.get("allowed_token_ids"), fields.get("min_tokens")
    if allowed and mn and allowed[1] == OK and mn[1] == OK and allowed[0] and mn[0]:
        stops = fields.get("stop_token_ids", (None, OK))
        ends = set(stops[0] or []) if stops[1] == OK else set()
        if fields.get("ignore_eos", (None,))[0] is not True:
            ends.add(EOS)
        if set(allowed[0]) <= ends:
            fields["min_tokens"] = (mn[0], BAD)
    rf, so = fields.get("response_format"), fields.get("structured_outputs")
    if rf and so and rf[0] is not None and so[0] is not None:
        fields["structured_outputs"] = (so[0], max(so[1], BAD))
    # A grammar with allowed_token_ids may leave no token the grammar takes: either answer.
    grammar = (rf and rf[0] not in (None, {"type": "text"})) or (so and so[0] is not None)
    allowed = fields.get("allowed_token_ids")
    if grammar and allowed and allowed[0] is not None and allowed[1] == OK:
        fields["allowed_token_ids"] = (allowed[0], MAYBE)


# ---- /v1/completions ---------------------------------------------------------------------------

MAX_TOKENS = one(
    ok(st.integers(1, 8)),
    bad(j(0, -1, -(2**31), CONTEXT, 10**9)),  # 0, negative, past the context
    bad(WIRE_OVERFLOW),
    _not_int(),
)

PROMPT = one(
    ok(st.text(min_size=1, max_size=60)),
    ok(st.lists(st.text(min_size=1, max_size=15), min_size=1, max_size=3)),
    ok(st.lists(TOKEN, min_size=1, max_size=16)),
    ok(st.lists(st.lists(TOKEN, min_size=1, max_size=6), min_size=1, max_size=2)),
    ok(j("\U0001f600" * 5, "\u0000\u0001", "<|im_start|>user\nhi<|im_end|>", "   ", "\n")),
    ok(st.just([1] * (CONTEXT - 8))),  # long, with room for max_tokens <= 8
    bad(
        j(
            "",
            [],
            [""],
            ["a", ""],
            [[]],
            [[1], []],
            [-1],
            [1, -1],
            [[1, 2], [-3]],
            None,
            5,
            1.5,
            [1, "a"],
            [[["x"]]],
            [[1.5]],
            [True],
            {"text": "a"},
            [None],
        )
    ),
    bad(PAST_VOCAB.map(lambda t: [1, t])),
    bad(st.just([5] * CONTEXT)),  # fills the context
    bad(st.just(_long_text(4000))),  # text past the context
    bad(st.just("\udc80 lone")),  # a lone surrogate
)


COMPLETION_FIELDS = {
    **COMMON,
    **STREAM,
    "echo": boolean(),
    "logprobs": one(
        NULL,
        ok(st.integers(0, 5)),
        ok(j(MAX_LOGPROBS)),
        bad(j(-1, MAX_LOGPROBS + 1, 1000)),
        _not_int(),
    ),
    "prompt_logprobs": one(NULL, ok(st.integers(0, 3)), bad(j(-1, MAX_LOGPROBS + 1)), _not_int()),
    "response_format": RESPONSE_FORMAT,
    "structured_outputs": STRUCTURED,
}


@st.composite
def completion_body(draw) -> tuple[dict, set[int]]:
    required = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": STREAM["stream"]}
    fields = draw(_fields(required, COMPLETION_FIELDS))
    fields.update(draw(_extras()))
    _cross_checks(fields, fields["max_tokens"])
    return _verdict(fields)


# ---- /v1/chat/completions ----------------------------------------------------------------------

PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
MESSAGE = one(
    ok(
        st.fixed_dictionaries(
            {
                "role": j("system", "user", "assistant", "developer"),
                "content": st.one_of(TEXT, st.lists(PART, max_size=2)),
            }
        )
    ),
    ok(
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": NONEMPTY}, optional={"name": st.text(max_size=6)}
        )
    ),
    ok(
        j(
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "not json"}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            {"role": "user", "content": None},
        )
    ),
    maybe(
        j(
            {"role": "tool", "content": "42"},
            {"role": "user", "content": "x", "tool_calls": [CALL]},
            {"role": "system", "content": [], "name": ""},
            {"role": "assistant", "content": None},
        )
    ),
    bad(
        j(
            {"role": "bogus", "content": "x"},
            {"content": "x"},
            {"role": "user", "x": 1},
            {"role": "user", "content": 5},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
            {"role": "user", "content": [{"text": "a"}]},
            {"role": "user", "content": [{"type": "text"}]},
            {"role": "function", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
                ],
            },
            {"role": "user", "content": "\udcff"},
            "hi",
            None,
            ["user", "hi"],
            {"role": None},
        )
    ),
)
TOOL = {"type": "function", "function": {"name": "f", "description": "adds",
                                         "parameters": SCHEMA}}  # fmt: skip
TOOL_G = {"type": "function", "function": {"name": "g"}}
TOOLS = one(
    NULL,
    ok(
        j(
            [TOOL],
            [TOOL, TOOL_G],
            [TOOL_G],
            [{"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}],
        )
    ),
    bad(
        j(
            [],
            [TOOL, TOOL],
            [{"type": "function", "function": {"name": "bad name"}}],
            [{"type": "function", "function": {"name": ""}}],
            [{"type": "function", "function": {"name": "x" * 65}}],
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            [{"type": "code_interpreter"}],
            [{"function": {"name": "f"}}],
            ["f"],
            {"f": 1},
            [{"type": "function", "function": {"name": "f"}, "x": 1}],
        )
    ),
)
TOOL_CHOICE = one(
    NULL,
    ok(j("none", "auto", "required")),
    ok(st.just({"type": "function", "function": {"name": "f"}})),
    bad(
        j(
            "any",
            "",
            {"type": "function"},
            {"type": "function", "function": {"name": "zz"}},
            {"type": "tool", "function": {"name": "f"}},
            1,
            ["auto"],
        )
    ),
)


def _tools_verdict(fields: dict) -> None:
    """tool_choice against tools (and against a grammar of the request's own)."""
    tools, choice = fields.get("tools", (None, OK)), fields.get("tool_choice", (None, OK))
    if choice[1] != OK or tools[1] != OK:
        return
    if not tools[0] and choice[0] not in (None, "none"):
        fields["tool_choice"] = (choice[0], BAD)  # tool_choice needs tools
        return
    names = {t["function"]["name"] for t in tools[0] or []}
    if isinstance(choice[0], dict) and choice[0]["function"]["name"] not in names:
        fields["tool_choice"] = (choice[0], BAD)
        return
    grammar = [
        k
        for k in ("response_format", "structured_outputs")
        if fields.get(k, (None,))[0] not in (None, {"type": "text"})
    ]
    if tools[0] and grammar:
        forced = choice[0] == "required" or isinstance(choice[0], dict)
        strict = any(t["function"].get("strict") for t in tools[0])
        if forced or (choice[0] in (None, "auto") and strict):
            fields[grammar[0]] = (fields[grammar[0]][0], BAD)
        else:
            fields[grammar[0]] = (fields[grammar[0]][0], max(fields[grammar[0]][1], MAYBE))


CHAT_FIELDS = {
    **COMMON,
    "max_tokens": one(NULL, ok(st.integers(1, 8)), _not_int()),
    "logprobs": boolean(),
    "top_logprobs": one(NULL, ok(st.integers(0, 5)), bad(j(-1, MAX_LOGPROBS + 1)), _not_int()),
    "add_generation_prompt": boolean(),
    "tools": TOOLS,
    "tool_choice": TOOL_CHOICE,
    "parallel_tool_calls": boolean(),
    "chat_template_kwargs": one(
        NULL,
        ok(j({}, {"enable_thinking": False}, {"foo": "bar"})),
        bad(j({"add_generation_prompt": True}, {"tools": []}, {"messages": []}, "x", [1])),
    ),
    "reasoning_effort": one(
        NULL, ok(j("none", "minimal", "low", "medium", "high")), bad(j("max", "", 1, "LOW"))
    ),
    "response_format": RESPONSE_FORMAT,
    "structured_outputs": STRUCTURED,
}


MESSAGES = items(MESSAGE) | one(
    bad(j([], None, "hi", {"role": "user", "content": "x"})),
    ok(st.just([{"role": "user", "content": _long_text(600)}])),  # long, in the context
    bad(st.just([{"role": "user", "content": _long_text(4000)}])),  # past the context
)


@st.composite
def chat_body(draw) -> tuple[dict, set[int]]:
    limit = "max_completion_tokens" if draw(st.integers(0, 5)) else "max_tokens"
    required = {"messages": MESSAGES, limit: MAX_TOKENS, "stream": STREAM["stream"]}
    fields = draw(_fields(required, {**CHAT_FIELDS, **STREAM}))
    fields.update(draw(_extras()))
    mct = fields.get("max_completion_tokens")
    mt = mct if mct is not None and mct[0] is not None else fields.get("max_tokens")
    if mt is None or mt[0] is None:  # keep generation short: no "rest of the context"
        fields["max_completion_tokens"] = mt = (4, OK)
    lp, tlp = fields.get("logprobs", (None, OK)), fields.get("top_logprobs", (None, OK))
    if tlp[0] is not None and tlp[1] == OK and lp[0] is not True:
        fields["top_logprobs"] = (tlp[0], BAD)  # top_logprobs needs logprobs=true
    _cross_checks(fields, mt)
    _tools_verdict(fields)
    return _verdict(fields)


# ---- /v1/responses -----------------------------------------------------------------------------

R_TOOL = {"type": "function", "name": "f", "parameters": SCHEMA}
R_ITEM = one(
    ok(
        st.fixed_dictionaries(
            {
                "role": j("user", "system", "developer", "assistant"),
                "content": st.one_of(
                    NONEMPTY,
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": j("input_text", "output_text"), "text": TEXT}
                        ),
                        max_size=2,
                    ),
                ),
            },
            optional={"type": st.just("message")},
        )
    ),
    ok(
        j(
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "3"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        )
    ),
    bad(
        j(
            {"role": "tool", "content": "x"},
            {"role": "user", "content": 5},
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]},
            {"role": "user", "content": [{"type": "input_text"}]},
            {"type": "web_search_call"},
            {"type": "function_call", "name": "f"},
            {"type": "function_call_output", "output": "x"},
            {"type": "function_call_output", "call_id": "c", "output": None},
            {"role": None},
            "hi",
            5,
            None,
            [],
        )
    ),
)
RESPONSES_FIELDS = {
    **{k: v for k, v in SAMPLING.items() if not k.endswith("_penalty")},
    "repetition_penalty": SAMPLING["repetition_penalty"],  # vLLM's; OpenAI's two are not taken
    "model": COMMON["model"],
    "instructions": one(NULL, ok(TEXT), _not_str()),
    "top_logprobs": one(NULL, ok(st.integers(0, 5)), bad(j(-1, MAX_LOGPROBS + 1)), _not_int()),
    "tools": one(
        NULL,
        ok(j([R_TOOL], [R_TOOL, {"type": "function", "name": "g"}])),
        bad(
            j(
                [{"type": "web_search"}],
                [{"type": "function", "name": "f", "x": 1}],
                [{"type": "function"}],
                ["f"],
                [R_TOOL, R_TOOL],
            )
        ),
    ),
    "tool_choice": one(
        NULL,
        ok(j("none", "auto", "required")),
        ok(st.just({"type": "function", "name": "f"})),
        bad(j("any", {"type": "function"}, {"type": "x", "name": "f"}, 5)),
    ),
    "parallel_tool_calls": boolean(),
    "text": one(
        NULL,
        ok(
            j(
                {},
                {"format": {"type": "text"}},
                {"format": None},
                {"format": {"type": "json_object"}},
                {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
            )
        ),
        bad(
            j(
                {"format": {"type": "xml"}},
                {"format": {"type": "json_schema"}},
                {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}},
                "x",
                5,
                {"format": "x"},
                {"format": 5},
                {"format": []},
            )
        ),
    ),
    "reasoning": one(
        NULL,
        ok(j({}, {"effort": "low"}, {"effort": None})),
        bad(j({"effort": "max"}, {"effort": 1}, "low")),
    ),
    "store": boolean(),
    "metadata": one(
        NULL, ok(st.dictionaries(TEXT, TEXT, max_size=2)), bad(j({"a": 1}, ["a"], "a"))
    ),
    "include": one(NULL, ok(j([], ["message.output_text.logprobs"],
                              ["reasoning.encrypted_content"])),
                   bad(j(["bogus"], "message.output_text.logprobs", [5]))),
    "truncation": one(NULL, ok(j("disabled")), maybe(j("auto")), bad(j("x", 1))),
    "background": one(NULL, ok(st.just(False)), bad(j(True, "no"))),
    "previous_response_id": one(NULL, bad(j("resp_nope", "")), _not_str()),
    "service_tier": one(NULL, ok(j("auto", "default"))),
    "prompt_cache_key": one(NULL, ok(TEXT)),
    "safety_identifier": one(NULL, ok(TEXT)),
}


INPUT = items(R_ITEM) | one(
    ok(TEXT),
    bad(j([], None, 5, {"role": "user", "content": "x"}, "\udc80")),
    bad(st.just(_long_text(4000))),
)


@st.composite
def responses_body(draw) -> tuple[dict, set[int]]:
    required = {"input": INPUT, "max_output_tokens": MAX_TOKENS, "stream": boolean()}
    fields = draw(_fields(required, RESPONSES_FIELDS))
    fields.update(draw(_extras()))
    inp = fields["input"]
    if (
        isinstance(inp[0], list)
        and inp[1] == OK
        and all(isinstance(x, dict) and x.get("type") == "reasoning" for x in inp[0])
        and not fields.get("instructions", (None,))[0]
    ):
        fields["input"] = (inp[0], BAD)  # reasoning items alone: no messages
    tools, choice = fields.get("tools", (None, OK)), fields.get("tool_choice", (None, OK))
    if tools[1] == OK and choice[1] == OK:
        names = {t["name"] for t in tools[0] or []}
        if (not names and choice[0] not in (None, "none")) or (
            isinstance(choice[0], dict) and choice[0]["name"] not in names
        ):
            fields["tool_choice"] = (choice[0], BAD)
        fmt = fields.get("text", ({}, OK))[0] or {}
        fmt = (fmt.get("format") if isinstance(fmt, dict) else None) or {}
        grammar = isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")
        if names and grammar and (choice[0] == "required" or isinstance(choice[0], dict)):
            fields["tool_choice"] = (choice[0], BAD)
    return _verdict(fields)


# ---- checks ------------------------------------------------------------------------------------


class Checker:
    """Sends bodies and checks what comes back; counts cases."""

    def __init__(self, server) -> None:
        self.server = server
        self.http = httpx.Client(
            headers={**server.headers(), "Content-Type": "application/json"},
            timeout=httpx.Timeout(90, connect=10),
        )
        self.counts: dict[str, dict[int, int]] = {}

    def close(self) -> None:
        self.http.close()

    def send(self, path: str, body: Any, allowed: set[int]) -> tuple[int, Any]:
        content = json.dumps(body, allow_nan=True)  # NaN/Infinity on purpose
        with self.http.stream("POST", self.server.base_url + path, content=content) as r:
            data = r.read()
        where = f"POST {path} {content[:600]}\n-> {r.status_code} {data[:800]!r}"
        per = self.counts.setdefault(path, {})
        per[r.status_code] = per.get(r.status_code, 0) + 1
        assert r.status_code in allowed, f"status not in {sorted(allowed)}: {where}"
        if r.status_code != 200:
            check_error(r.status_code, data, where)
            return r.status_code, None
        stream = isinstance(body, dict) and body.get("stream") is True
        try:
            if path == "/responses":
                return 200, check_responses(data, stream, where)
            return 200, check_openai(path, body, data, stream, where)
        except (ValueError, pydantic.ValidationError) as e:  # JSON or the openai types
            raise AssertionError(f"{type(e).__name__}: {e}\n{where}") from None


def check_error(status: int, data: bytes, where: str) -> None:
    err = json.loads(data)
    assert set(err) == {"error"}, where
    err = err["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str) and err["message"], where
    assert err["type"] == "invalid_request_error", where
    assert err["param"] is None or isinstance(err["param"], str), where
    if status == 401:
        assert err["code"] == "invalid_api_key", where
    if status == 404:
        assert err["param"] == "model" and err["code"] == "model_not_found", where


def _sse_data(data: bytes, where: str) -> list[str]:
    text = data.decode("utf-8")
    events = [e for e in text.split("\n\n") if e.strip()]
    out = []
    for ev in events:
        lines = ev.split("\n")
        datas = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
        assert len(datas) == 1, f"an event without one data line {ev!r}: {where}"
        out.append(datas[0])
    return out


def _echo_fix(obj: dict) -> dict:
    """An echoed prompt's first token has null logprobs (as OpenAI's and vLLM's), which the
    openai client's Completion type does not declare: 0 and {} stand in for validation."""
    for ch in obj.get("choices") or []:
        lp = ch.get("logprobs") or {}
        if lp.get("token_logprobs"):
            lp["token_logprobs"] = [0.0 if x is None else x for x in lp["token_logprobs"]]
            lp["top_logprobs"] = [{} if x is None else x for x in lp["top_logprobs"]]
    return obj


def check_openai(path: str, body: dict, data: bytes, stream: bool, where: str) -> Any:
    n = body.get("n") or 1
    if not stream:
        obj = json.loads(data)
        assert "error" not in obj, where
        if path == "/completions":
            c = Completion.model_validate(_echo_fix(obj))
            prompt = body["prompt"]
            k = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
            assert sorted(ch.index for ch in c.choices) == list(range(n * k)), where
            for ch in c.choices:
                if body.get("logprobs") is not None:
                    assert ch.logprobs is not None, where
        else:
            c = ChatCompletion.model_validate(obj)
            assert sorted(ch.index for ch in c.choices) == list(range(n)), where
            for ch in c.choices:
                assert ch.finish_reason in ("stop", "length", "tool_calls"), where
        assert c.usage is not None and c.usage.total_tokens == (
            c.usage.prompt_tokens + c.usage.completion_tokens
        ), where
        return c
    chunks = _sse_data(data, where)
    assert chunks and chunks[-1] == "[DONE]", f"the stream does not end with [DONE]: {where}"
    assert "[DONE]" not in chunks[:-1], where
    parsed = []
    for raw in chunks[:-1]:
        obj = json.loads(raw)
        assert "error" not in obj, f"an error in a 200 stream: {raw[:500]} {where}"
        if path == "/completions":  # a chunk is a Completion whose finish_reason may be null
            c = Completion.model_validate(
                _echo_fix(
                    {
                        **obj,
                        "choices": [
                            {**ch, "finish_reason": ch["finish_reason"] or "length"}
                            for ch in obj["choices"]
                        ],
                    }
                )
            )
            for ch, raw_ch in zip(c.choices, obj["choices"]):
                ch.finish_reason = raw_ch["finish_reason"]
            parsed.append(c)
        else:
            parsed.append(ChatCompletionChunk.model_validate(obj))
    finished = {ch.index for p in parsed for ch in p.choices if ch.finish_reason is not None}
    k = 1
    if path == "/completions" and not (
        isinstance(body["prompt"], str) or isinstance(body["prompt"][0], int)
    ):
        k = len(body["prompt"])
    assert finished == set(range(n * k)), f"choices without a finish_reason: {where}"
    if (body.get("stream_options") or {}).get("include_usage"):
        assert parsed[-1].usage is not None, where
    return parsed


def check_responses(data: bytes, stream: bool, where: str) -> Any:
    if not stream:
        r = Response.model_validate(json.loads(data))
        assert r.status in ("completed", "incomplete"), where
        return r
    events = [json.loads(x) for x in _sse_data(data, where)]
    assert events, where
    for e in events:
        _RESPONSE_EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events))), where
    assert events[0]["type"] == "response.created", where
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), where
    return events


def memory(server) -> dict:
    return httpx.get(server.base_url + "/memory", headers=server.headers(), timeout=10).json()


def assert_healthy_and_idle(server, timeout: float = 30.0) -> None:
    """/health is 200 and, within `timeout`, no request holds pages, runs or waits."""
    assert server.proc.poll() is None, "the server exited"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + timeout
    while True:
        m = memory(server)
        busy = m["pages_held_by_requests"] + m["num_requests"] + m["num_running"] + m["num_waiting"]
        if busy == 0:
            return
        assert time.monotonic() < deadline, f"not idle: {m}"
        time.sleep(0.2)


def _fuzz(server, path: str, strategy: st.SearchStrategy) -> None:
    checker = Checker(server)
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=strategy)
    def run(case):
        body, allowed = case
        status, _ = checker.send(path, body, allowed)
        seen[status] = seen.get(status, 0) + 1

    try:
        run()
    finally:
        checker.close()
        print(f"{path}: {sum(seen.values())} cases, statuses {seen}")
    assert seen.get(200, 0) >= EXAMPLES // 10 and seen.get(400, 0) >= EXAMPLES // 10, seen
    assert_healthy_and_idle(server)


# ---- the tests ---------------------------------------------------------------------------------


def test_fuzz_completions(server):
    _fuzz(server, "/completions", completion_body())


def test_fuzz_chat(server):
    _fuzz(server, "/chat/completions", chat_body())


def test_fuzz_responses(server):
    _fuzz(server, "/responses", responses_body())


RAW_BODIES = [
    b"",
    b"{",
    b"[]",
    b"null",
    b"5",
    b'"x"',
    b'{"prompt": "a",}',
    b"\xff\xfe",
    b'{"prompt": "a", "prompt": 5}',
    b'{"max_tokens": NaN}',
    b"[{}]" * 3,
]


def test_raw_bodies_and_auth(server):
    """Not JSON objects, no key, a wrong key, an unknown path: 400 / 401 / 404, never a 5xx."""
    checker = Checker(server)
    try:
        for path in ("/completions", "/chat/completions", "/responses"):
            for raw in RAW_BODIES:
                r = checker.http.post(server.base_url + path, content=raw)
                check_error(r.status_code, r.content, f"{path} {raw!r} -> {r.text[:300]}")
                assert r.status_code == 400, (path, raw, r.text)
            body = {
                "prompt": "a",
                "messages": [{"role": "user", "content": "a"}],
                "input": "a",
                "max_tokens": 1,
            }
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "wrong"}):
                r = httpx.post(server.base_url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, r.text
                check_error(401, r.content, r.text)
        r = checker.http.post(server.base_url + "/no-such-path", content=b"{}")
        assert r.status_code == 404, r.text
        r = checker.http.post(
            server.base_url + "/completions",
            content=b'{"prompt": "a"}',
            headers={"Content-Type": "text/plain"},
        )
        assert r.status_code in (200, 400), r.text
    finally:
        checker.close()
    assert_healthy_and_idle(server)


LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
STREAMS = [
    ("/completions", {"prompt": "Count to a thousand:", "stream": True, **LONG}),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "Count to a thousand."}], "stream": True, **LONG},
    ),
    (
        "/responses",
        {
            "input": "Count to a thousand.",
            "stream": True,
            "max_output_tokens": 400,
            "temperature": 0,
        },
    ),
]


@pytest.mark.parametrize("path,body", STREAMS, ids=["completions", "chat", "responses"])
def test_disconnect_mid_stream(server, path, body):
    """A client that leaves after the first chunks: its request ends and its pages come back."""
    for _ in range(2):
        with httpx.stream("POST", server.base_url + path, json=body, headers=server.headers(),
                          timeout=60) as r:  # fmt: skip
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                got += line.startswith("data:")
                if got == 3:
                    break
        assert got >= 1
    assert_healthy_and_idle(server)


@pytest.mark.parametrize("path,body", STREAMS, ids=["completions", "chat", "responses"])
def test_disconnect_before_answer(server, path, body):
    """A non-streamed request whose client times out: aborted, pages back."""
    body = {**body, "stream": False}
    try:  # 400 tokens take many seconds on CPU
        httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=1.0)
    except httpx.ReadTimeout:
        pass
    assert_healthy_and_idle(server)


def _burst_bodies() -> list[tuple[str, dict, set[int]]]:
    """56 requests, valid and invalid, streamed and not, over the three endpoints; 8 of them
    ("leave") from clients that go away early."""
    cases: list[tuple[str, dict, set[int]]] = []
    msgs = [{"role": "user", "content": "Say hi."}]
    for i in range(8):
        stream = i % 2 == 1
        cases += [
            (
                "/completions",
                {
                    "prompt": f"{i} plus {i} is",
                    "max_tokens": 6,
                    "n": 1 + i % 3,
                    "stream": stream,
                    "logprobs": i % 3,
                },
                {200},
            ),
            ("/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 0}, {400}),
            (
                "/chat/completions",
                {
                    "messages": msgs,
                    "max_completion_tokens": 5,
                    "stream": stream,
                    "seed": i,
                    "response_format": {"type": "json_object"},
                },
                {200},
            ),
            ("/chat/completions", {"messages": msgs, "max_tokens": 4, "top_p": 0}, {400}),
            ("/responses", {"input": "Hi", "max_output_tokens": 5, "stream": stream}, {200}),
            ("/responses", {"input": [{"role": "tool", "content": "x"}]}, {400}),
            (*STREAMS[i % 3][:1], {**STREAMS[i % 3][1], "stream": stream}, {"leave"}),
        ]
    return cases


def _leave_early(server, path: str, body: dict) -> None:
    """A client that goes away: after the first chunk of a stream, or before a whole answer."""
    if body.get("stream"):
        with httpx.stream("POST", server.base_url + path, json=body, headers=server.headers(),
                          timeout=60) as r:  # fmt: skip
            assert r.status_code == 200, r.read()
            next(line for line in r.iter_lines() if line.startswith("data:"))
        return
    try:
        httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=0.5)
    except httpx.ReadTimeout:
        pass


def test_concurrent_bursts(server):
    """16 requests at once, mixed valid and invalid, streamed and not, some of whose clients
    leave early, twice; then idle."""
    checker = Checker(server)
    errors: list[str] = []
    lock = threading.Lock()

    def one(case):
        path, body, allowed = case
        try:
            if allowed == {"leave"}:
                _leave_early(server, path, body)
            else:
                checker.send(path, body, allowed)
        except Exception as e:  # noqa: BLE001 (reported below)
            with lock:
                errors.append(f"{type(e).__name__}: {e}")

    try:
        cases = _burst_bodies()
        with ThreadPoolExecutor(16) as pool:
            for _ in range(2):
                list(pool.map(one, cases))
    finally:
        checker.close()
    assert not errors, "\n".join(errors[:5])
    assert_healthy_and_idle(server)
