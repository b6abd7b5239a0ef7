"""Tool calls found in a chat model's generated text (OpenAI `tool_choice="auto"`), in the
output formats of common model families. One parser per format:

- `hermes` (Hermes 2 Pro / 3, Qwen2.5, Qwen3): plain text, then zero or more
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (whitespace around the JSON
  allowed). The last block may lack its `</tool_call>` (generation stopped at EOS): its JSON runs
  to the end of the output.
- `llama3_json` (Llama 3.1 / 3.2 JSON tool calling): the whole output, after optional leading
  whitespace and an optional `<|python_tag|>`, is one JSON object `{"name": ...,
  "parameters": {...}}`, or several separated by `;` (a trailing `;` and whitespace allowed).
- `mistral`: text, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`
  objects (one bare object is taken as an array of one); there may be several `[TOOL_CALLS]`
  markers, each followed by its own array. (The newer `[TOOL_CALLS]name[ARGS]{...}` form is not
  read: such output stays content.)
- `pythonic` (Llama 3.2 and 4, ToolACE, Olmo 3): the whole output (Llama 4's
  `<|python_start|>` ... `<|python_end|>` around it allowed) is a Python list of calls with
  keyword arguments of literal values, `[get_weather(city="Paris"), get_time(zone="CET")]`;
  read with `ast` (never evaluated), JSON's true/false/null taken too.

- `openai` (gpt-oss, harmony format, server/harmony.py): messages among text; a message to a
  function, `<|start|>assistant to=functions.NAME<|channel|>commentary<|constrain|>json
  <|message|>ARGS<|call|>` (the recipient in the role or the channel part; `<|constrain|>`
  optional; ended by `<|call|>`, `<|end|>`, `<|return|>`, a new message or the end of the
  output) is a call, everything else content, as written. The `openai_gptoss` reasoning parser
  hands it content in this form (reasoning and plain messages already taken out).

A call is valid when its JSON parses to an object whose "name" is a string in `tool_names` and
whose arguments ("arguments", else "parameters"; absent means `{}`) are a JSON object or a JSON
string that holds one. `ParsedCall.arguments` is that object re-serialised with
`json.dumps(obj, ensure_ascii=False)`.

What is content, and what an invalid call does:

- Everywhere: when no valid call is found, the content is the whole text, unchanged, and the
  calls are []. When there are calls, the content is the non-call text stripped of surrounding
  whitespace, None when that is empty.
- `hermes` judges each block alone: a valid block is a call, an invalid one (bad JSON, unknown
  name, arguments not an object) stays in the content as its raw text, tags included. The
  content is the concatenation of every piece that is not a valid block (the text before, between
  and after blocks, and the invalid blocks), stripped.
- `openai`, as vLLM's: every message to a function is a call, whatever the name; its arguments
  are the message's text, re-serialised when it is JSON (any value), else as written but
  stripped ("{}" when empty). Messages to other recipients and the text around calls are content.
- `llama3_json`, `pythonic` and `mistral` are all or nothing: one invalid call (or anything
  else after the first `[TOOL_CALLS]` that is not a JSON array of calls, for mistral) makes the
  whole output content. For mistral the content beside calls is the text before the first
  `[TOOL_CALLS]`.

Streaming (`ToolParser.stream()`): `feed(delta)` returns the events certain so far, in order, and
`finish()` the rest; an event is a piece of content text or one complete `ParsedCall`, never
taken back. Plain text is emitted as soon as it cannot be the start of a marker (a suffix that
is a prefix of `<tool_call>` / `[TOOL_CALLS]` / `<|python_tag|>` / a harmony marker is held
back), and whitespace is held until non-whitespace content follows it (so content that ends up
trailing is never sent).
Once a marker is seen the rest is buffered: a hermes block is judged at its `</tool_call>` (or
at finish when unclosed); after a mistral `[TOOL_CALLS]`, and for llama3_json once the output
(after whitespace) starts with `{` or `<|python_tag|>`, everything waits for `finish()`; an
openai header waits for its `<|message|>`, a call for its end.

The invariant, for every way of splitting a text into deltas: the calls of feed()+finish() are
parse()'s calls, in order; and their str events joined equal parse()'s content (None as "")
exactly when there is no call. When there are calls, they are equal after `.strip()`: the only
difference is whitespace at the start of the content, sent before any call could be known (the
streamed content never ends in whitespace then). No str event is empty.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from swaserve.server import harmony


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the tool's name and its arguments object as JSON text."""

    name: str
    arguments: str


# A piece of plain content text, or one complete tool call.
Event = str | ParsedCall

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's pythonic calls
MISTRAL_MARKER = "[TOOL_CALLS]"
# What reading a model's JSON (or Python literal) may raise: nesting deep enough to overflow the
# parser's recursion is the model's text too, not a server error.
_BAD_JSON = (ValueError, RecursionError, MemoryError)


def _to_call(obj: Any, tool_names: frozenset[str]) -> ParsedCall | None:
    """The call that a decoded JSON value stands for, None when it is not a valid one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or name not in tool_names:
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    else:
        args = obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except _BAD_JSON:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _content(pieces: list[str], calls: list[ParsedCall], text: str) -> str | None:
    """parse()'s content: the whole text when there is no call, else the non-call pieces joined
    and stripped (None when empty)."""
    if not calls:
        return text
    return "".join(pieces).strip() or None


class ToolStream:
    """Incremental parsing of one generation: feed() each delta, then finish() once."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self._tool_names = tool_names
        self._held = ""  # whitespace not yet sent: it is content only if content follows
        self._called = False
        self._done = False

    def feed(self, delta: str) -> list[Event]:
        """The events that are certain once `delta` is appended, in order."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        events: list[Event] = []
        if delta:
            self._feed(delta, events)
        return events

    def finish(self) -> list[Event]:
        """The remaining events, at the end of generation."""
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        events: list[Event] = []
        self._finish(events)
        if self._held and not self._called:
            events.append(self._held)
        self._held = ""
        return events

    def _feed(self, delta: str, events: list[Event]) -> None:
        raise NotImplementedError

    def _finish(self, events: list[Event]) -> None:
        raise NotImplementedError

    def _text(self, events: list[Event], text: str) -> None:
        """Sends content `text`, holding back its trailing whitespace."""
        text = self._held + text
        k = len(text.rstrip())
        if k:
            events.append(text[:k])
        self._held = text[k:]

    def _call(self, events: list[Event], call: ParsedCall) -> None:
        self._called = True
        events.append(call)


class ToolParser:
    """Base class: one subclass per output format, named by `name`."""

    name: ClassVar[str] = ""

    def __init__(self, tool_names: set[str]) -> None:
        self.tool_names = frozenset(tool_names)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole output -> (content, calls); see the module docstring for the rules."""
        raise NotImplementedError

    def stream(self) -> ToolStream:
        """A fresh incremental parser for one generation."""
        raise NotImplementedError


# --- hermes ----------------------------------------------------------------------------------


def _hermes_call(body: str, tool_names: frozenset[str]) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except _BAD_JSON:
        return None
    return _to_call(obj, tool_names)


class HermesParser(ToolParser):
    """`<tool_call>{...}</tool_call>` blocks, each judged alone."""

    name = "hermes"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        pieces: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            i = text.find(HERMES_OPEN, pos)
            if i < 0:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:i])
            start = i + len(HERMES_OPEN)
            j = text.find(HERMES_CLOSE, start)
            end = len(text) if j < 0 else j + len(HERMES_CLOSE)
            call = _hermes_call(text[start:len(text) if j < 0 else j], self.tool_names)
            if call is None:
                pieces.append(text[i:end])
            else:
                calls.append(call)
            pos = end
            if j < 0:
                break
        return _content(pieces, calls, text), calls

    def stream(self) -> ToolStream:
        return _HermesStream(self.tool_names)


class _HermesStream(ToolStream):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self._buf = ""  # outside a block: text held back; inside: the block's body so far
        self._in_block = False
        self._scan = 0  # inside a block: where to look for the close tag next

    def _feed(self, delta: str, events: list[Event]) -> None:
        self._buf += delta
        while True:
            if not self._in_block:
                i = self._buf.find(HERMES_OPEN)
                if i < 0:
                    keep = len(self._buf) - held_prefix(self._buf, HERMES_OPEN)
                    self._text(events, self._buf[:keep])
                    self._buf = self._buf[keep:]
                    return
                self._text(events, self._buf[:i])
                self._buf = self._buf[i + len(HERMES_OPEN):]
                self._in_block, self._scan = True, 0
            else:
                j = self._buf.find(HERMES_CLOSE, self._scan)
                if j < 0:
                    self._scan = max(0, len(self._buf) - len(HERMES_CLOSE) + 1)
                    return
                body = self._buf[:j]
                self._buf = self._buf[j + len(HERMES_CLOSE):]
                self._in_block = False
                self._block(events, body, HERMES_CLOSE)

    def _finish(self, events: list[Event]) -> None:
        if self._in_block:
            self._block(events, self._buf, "")
        else:
            self._text(events, self._buf)
        self._buf = ""

    def _block(self, events: list[Event], body: str, close: str) -> None:
        call = _hermes_call(body, self._tool_names)
        if call is None:
            self._text(events, HERMES_OPEN + body + close)
        else:
            self._call(events, call)


# --- llama3_json -----------------------------------------------------------------------------


def _llama3_calls(text: str, tool_names: frozenset[str]) -> list[ParsedCall] | None:
    """The calls when the whole of `text` is `[<|python_tag|>] {...} [; {...}]* [;]` (whitespace
    allowed around each part), else None."""
    s = text.lstrip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):]
    decoder = json.JSONDecoder()
    calls: list[ParsedCall] = []
    pos, n = 0, len(s)
    while True:
        while pos < n and s[pos].isspace():
            pos += 1
        if pos == n and calls:
            return calls
        try:
            obj, pos = decoder.raw_decode(s, pos)
        except _BAD_JSON:
            return None
        call = _to_call(obj, tool_names)
        if call is None:
            return None
        calls.append(call)
        while pos < n and s[pos].isspace():
            pos += 1
        if pos == n:
            return calls
        if s[pos] != ";":
            return None
        pos += 1




class _WholeStream(ToolStream):
    """A format whose calls are the whole output (llama3_json, pythonic): once the output (after
    whitespace) starts with one of `starts`, everything waits for finish() and is then calls
    (`calls_of` the text) or, failing that, content; any other start streams as content."""

    def __init__(
        self,
        tool_names: frozenset[str],
        starts: tuple[str, ...],
        calls_of: Callable[[str, frozenset[str]], list[ParsedCall] | None],
    ) -> None:
        super().__init__(tool_names)
        self._starts, self._calls_of = starts, calls_of
        self._mode = ""  # "" undecided, "text": plain content, "calls": maybe calls, buffered
        self._chunks: list[str] = []

    def _feed(self, delta: str, events: list[Event]) -> None:
        if self._mode == "text":
            events.append(delta)
            return
        self._chunks.append(delta)
        if self._mode == "calls":
            return
        head = "".join(self._chunks)
        self._chunks = [head]
        s = head.lstrip()
        if not s or any(t.startswith(s) for t in self._starts):
            return  # whitespace, or maybe the start of a tag: not yet known
        if any(s.startswith(t) for t in self._starts):
            self._mode = "calls"
        else:
            self._mode = "text"
            self._chunks = []
            events.append(head)

    def _finish(self, events: list[Event]) -> None:
        text = "".join(self._chunks)
        self._chunks = []
        calls = self._calls_of(text, self._tool_names) if self._mode == "calls" else None
        if calls is None:
            if text:
                events.append(text)
        else:
            for call in calls:
                self._call(events, call)


# --- pythonic --------------------------------------------------------------------------------


def _literal(node: ast.expr) -> Any:
    """A Python literal's value (JSON's true, false and null read as Python's too)."""
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _pythonic_calls(text: str, tool_names: frozenset[str]) -> list[ParsedCall] | None:
    """The calls when the whole of `text` (a Llama 4 `<|python_start|>` ... `<|python_end|>`
    around it allowed) is a Python list of calls with keyword arguments of literal values:
    `[get_weather(city="Paris", days=2), get_time(zone="CET")]`; else None."""
    s = text.strip()
    if s.startswith(PYTHON_START):
        s = s[len(PYTHON_START):].removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(s, mode="eval").body
    except (SyntaxError, *_BAD_JSON):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls: list[ParsedCall] = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):  # fmt: skip
            return None
        try:
            args = {k.arg: _literal(k.value) for k in node.keywords}
            call = _to_call({"name": node.func.id, "arguments": args}, tool_names)
        except (TypeError, SyntaxError, *_BAD_JSON):  # not a literal, or not JSON's
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


# --- llama3_json and pythonic: the calls are the whole output --------------------------------


class _WholeParser(ToolParser):
    """A format whose calls are the whole output (`calls_of` it), else it is content; streamed
    by `_WholeStream`, which buffers once the output starts with one of `starts`."""

    starts: ClassVar[tuple[str, ...]] = ()
    calls_of: ClassVar[Callable[[str, frozenset[str]], list[ParsedCall] | None]]

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = type(self).calls_of(text, self.tool_names)
        if calls is None:
            return text, []
        return None, calls

    def stream(self) -> ToolStream:
        return _WholeStream(self.tool_names, self.starts, type(self).calls_of)


class Llama3JsonParser(_WholeParser):
    """The whole output one or more `;`-separated JSON calls, or content."""

    name = "llama3_json"
    starts = ("{", PYTHON_TAG)
    calls_of = staticmethod(_llama3_calls)


class PythonicParser(_WholeParser):
    """The whole output a Python list of calls (Llama 3.2 and 4, ToolACE), or content."""

    name = "pythonic"
    starts = ("[", PYTHON_START)
    calls_of = staticmethod(_pythonic_calls)


# --- mistral ---------------------------------------------------------------------------------


def _mistral_calls(tail: str, tool_names: frozenset[str]) -> list[ParsedCall] | None:
    """The calls in `tail` (the text after the first [TOOL_CALLS]) when every part between
    markers is a non-empty JSON array of valid calls (or one call object), else None."""
    calls: list[ParsedCall] = []
    for part in tail.split(MISTRAL_MARKER):
        try:
            obj = json.loads(part)
        except _BAD_JSON:
            return None
        items = obj if isinstance(obj, list) else [obj]
        if not items:
            return None
        for item in items:
            call = _to_call(item, tool_names)
            if call is None:
                return None
            calls.append(call)
    return calls


class MistralParser(ToolParser):
    """Text, then `[TOOL_CALLS]` and JSON arrays of calls; all valid or all content."""

    name = "mistral"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        i = text.find(MISTRAL_MARKER)
        if i < 0:
            return text, []
        calls = _mistral_calls(text[i + len(MISTRAL_MARKER):], self.tool_names)
        if calls is None:
            return text, []
        return _content([text[:i]], calls, text), calls

    def stream(self) -> ToolStream:
        return _MistralStream(self.tool_names)


class _MistralStream(ToolStream):
    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self._buf = ""  # before the marker: text held back
        self._tail: list[str] | None = None  # after the first marker: everything, buffered

    def _feed(self, delta: str, events: list[Event]) -> None:
        if self._tail is not None:
            self._tail.append(delta)
            return
        self._buf += delta
        i = self._buf.find(MISTRAL_MARKER)
        if i < 0:
            keep = len(self._buf) - held_prefix(self._buf, MISTRAL_MARKER)
            self._text(events, self._buf[:keep])
            self._buf = self._buf[keep:]
            return
        self._text(events, self._buf[:i])
        self._tail = [self._buf[i + len(MISTRAL_MARKER):]]
        self._buf = ""

    def _finish(self, events: list[Event]) -> None:
        if self._tail is None:
            self._text(events, self._buf)
            self._buf = ""
            return
        tail = "".join(self._tail)
        calls = _mistral_calls(tail, self._tool_names)
        if calls is None:
            self._text(events, MISTRAL_MARKER + tail)
        else:
            for call in calls:
                self._call(events, call)


# --- openai (harmony) ------------------------------------------------------------------------


def _openai_call(name: str, text: str) -> ParsedCall:
    """A call to `name` with `text` as its arguments: JSON re-serialised, else stripped."""
    try:
        args = json.dumps(json.loads(text), ensure_ascii=False)
    except _BAD_JSON:
        args = text.strip() or "{}"
    return ParsedCall(name, args)


class OpenAIParser(ToolParser):
    """Harmony messages to `functions.NAME` are calls; the rest is content as written."""

    name = "openai"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        calls = [e for e in events if isinstance(e, ParsedCall)]
        return _content([e for e in events if isinstance(e, str)], calls, text), calls

    def stream(self) -> ToolStream:
        return _OpenAIStream(self.tool_names)


class _OpenAIStream(ToolStream):
    """The harmony events of the text (harmony.HarmonyStream, from outside any message): a
    function's message is buffered and sent as a call when it ends; all else is content, each
    piece as written (a header once it is whole)."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self._messages = harmony.HarmonyStream(opening=False)
        self._function: str | None = None  # inside a call: the function
        self._args: list[str] = []

    def _feed(self, delta: str, events: list[Event]) -> None:
        self._read(self._messages.feed(delta), events)

    def _finish(self, events: list[Event]) -> None:
        self._read(self._messages.finish(), events)

    def _read(self, messages: list[harmony.Event], events: list[Event]) -> None:
        for kind, value in messages:
            if kind == "header":
                self._function = value.function
                self._args = []
                if self._function is None:
                    self._text(events, value.raw)
            elif self._function is None:  # text, an end marker, loose text: as written
                self._text(events, value)
            elif kind == "text":
                self._args.append(value)
            else:  # "end": the call is whole
                self._call(events, _openai_call(self._function, "".join(self._args)))
                self._function = None


# --- registry --------------------------------------------------------------------------------

PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, OpenAIParser)
}
# Their markers are special tokens, which the default skip_special_tokens would erase.
SPECIAL_MARKERS = frozenset({"mistral", "openai"})


def get_parser(name: str, tool_names: set[str]) -> ToolParser:
    """The parser called `name` for these tools; ValueError naming the choices otherwise."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(PARSERS)}")
    return cls(tool_names)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser that a chat template's own tool-call format implies, None when it shows none:
    harmony's `<|channel|>` -> openai, `func_name1(` or `<|python_start|>` -> pythonic,
    `<tool_call>` -> hermes, `<|python_tag|>` or `ipython` -> llama3_json, `[TOOL_CALLS]` ->
    mistral (checked in that order)."""
    if not chat_template:
        return None
    if harmony.is_harmony_template(chat_template):
        return "openai"
    if "func_name1(" in chat_template or PYTHON_START in chat_template:  # before ipython
        return "pythonic"
    if HERMES_OPEN in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3_json"
    if MISTRAL_MARKER in chat_template:
        return "mistral"
    return None
