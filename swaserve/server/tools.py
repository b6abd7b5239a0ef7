"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

How each `tool_choice` is served (vLLM's behaviour, which follows OpenAI's):

- `"none"`: the tools are rendered into the prompt, the answer is plain content.
- a named function (`{"type": "function", "function": {"name": ...}}`): a grammar holds the
  output to the function's `parameters` schema (sampling/structured.py), and the whole output is
  that call's arguments. finish_reason stays "stop", as OpenAI's does for a forced call.
- `"required"`: a grammar holds the output to a JSON array of at least one
  `{"name": <a tool>, "parameters": <its schema>}` (one at most with `parallel_tool_calls`
  false); each element is a call. finish_reason "tool_calls".
- `"auto"` (the default when tools are given): the model writes what it likes, and the
  server's tool-call parser (`--tool-call-parser`, server/tool_parsers.py; by default the one
  the chat template's own format implies) finds calls in it. finish_reason "tool_calls" when
  one was found. Without a parser, "auto" is a 400 naming the flag: tools are never silently
  ignored.
- `"auto"` with a `strict` tool (OpenAI's `function.strict: true`, served as SGLang does): a
  structural tag (`auto_tool_tag`) still lets the model write free text, but once it opens a
  call in the parser's format, the call must name a tool and its arguments keep to that tool's
  `parameters` schema: every tool's, strict or not (one strict tool constrains them all, as in
  SGLang; a call of a non-strict tool would otherwise be the only unchecked one). One call at
  most with `parallel_tool_calls` false. The pythonic format is not JSON: its calls stay
  unconstrained.

The tools reach the model through the chat template (`tools=`). A template that never reads
`tools` (neither built-in model's does) gets them in a system message instead, with the format
the answer should take; one that never reads `tool_calls` gets earlier turns' calls written
into their content, in the parser's format, so the model sees what it called.

Streaming: a named call streams its arguments as they come; required and auto calls are sent
whole, each when it is complete (its array element closed, its `</tool_call>` seen), and plain
content as soon as it cannot be the start of a call. A stream and the non-streamed response of
the same output give the same calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from swaserve.sampling.structured import MAX_JSON_WHITESPACE
from swaserve.server.tool_parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_MARKER,
    PARSERS,
    PYTHON_TAG,
    ParsedCall,
    ToolStream,
    detect_parser,
    get_parser,
)

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A bad tools request: the message and the field it names (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def resolve_parser(name: str | None, chat_template: Any) -> str | None:
    """The server's tool-call parser: `name` ("auto" or None: the one the template's own tool
    format implies, None when it implies none)."""
    if name and name != "auto":
        get_parser(name, set())  # a ValueError naming the choices for an unknown name
        return name
    return detect_parser(chat_template if isinstance(chat_template, str) else None)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(call: ParsedCall, index: int | None = None) -> dict[str, Any]:
    """One call as the API returns it (`index` in stream deltas)."""
    out: dict[str, Any] = {} if index is None else {"index": index}
    out.update(id=call_id(), type="function",
               function={"name": call.name, "arguments": call.arguments})  # fmt: skip
    return out


@dataclass
class ToolPlan:
    """How one chat request uses its tools (module docstring)."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # {"type": "function", "function": {...}}, as the template takes
    named: str | None  # mode "named": the function
    parser: str | None  # mode "auto": the server's parser
    parallel: bool
    strict: bool = False  # some tool asked for `function.strict`: "auto" calls under a grammar

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def schema(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def structured_outputs(self) -> dict[str, Any] | None:
        """The grammar a named or required choice runs under, or "auto" with a strict tool
        (`auto_tool_tag`; none for the pythonic parser); None for the others."""
        if self.mode == "named":
            return {"json": self.schema(self.named or "")}
        if self.mode == "auto" and self.strict:
            schemas = {n: self.schema(n) for n in sorted(self.names)}
            tag = auto_tool_tag(self.parser or "", schemas, self.parallel)
            return None if tag is None else {"structural_tag": tag}
        if self.mode != "required":
            return None
        calls = [
            {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
             "properties": {"name": {"const": n}, "parameters": self.schema(n)}}
            for n in sorted(self.names)
        ]  # fmt: skip
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return {"json": array}

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def output(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole answer -> (content, the API's tool_calls), non-streamed."""
        if self.mode == "named":
            return None, [call_json(ParsedCall(self.named or "", text))]
        if self.mode == "none":
            return text, []
        stream = self.stream()
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        for c in calls:
            c.pop("index", None)
        if calls:
            return (content.strip() or None), calls
        return content, []

    def stream(self) -> ToolDeltas:
        """Incremental output for one streamed choice."""
        if self.mode == "auto":
            return ToolDeltas(self, get_parser(self.parser or "", self.names).stream())
        return ToolDeltas(self, None)


class _RequiredStream(ToolStream):
    """The elements of a JSON array of {"name", "parameters"} calls, each once it closes; a
    text that yields no call is content at the end."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        super().__init__(tool_names)
        self._buf = ""
        self._pos = -1  # past "[" and the elements decoded so far; -1 before the "["
        self._dec = json.JSONDecoder()
        self._stopped = False  # a malformed element: nothing after it is read

    def _feed(self, delta: str, events: list) -> None:
        self._buf += delta
        s = self._buf
        if self._pos < 0:
            i = s.find("[")
            if i < 0:
                return
            self._pos = i + 1
        while not self._stopped:
            p = self._pos
            while p < len(s) and (s[p].isspace() or s[p] == ","):
                p += 1
            if p >= len(s) or s[p] == "]":
                return
            try:
                obj, end = self._dec.raw_decode(s, p)
            except (ValueError, RecursionError):
                return  # not complete yet (or never will be: then it stays unread)
            self._pos = end
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)
                    and obj["name"] in self._tool_names
                    and isinstance(obj.get("parameters"), dict)):  # fmt: skip
                self._stopped = True
                return
            self._call(events, ParsedCall(obj["name"], json.dumps(obj["parameters"],
                                                                  ensure_ascii=False)))

    def _finish(self, events: list) -> None:
        if not self._called and self._buf:
            events.append(self._buf)


class ToolDeltas:
    """One streamed choice's output as chat deltas: {"content": ...} or {"tool_calls": [...]};
    `called` once a call went out."""

    def __init__(self, plan: ToolPlan, parser_stream: ToolStream | None) -> None:
        self.plan = plan
        self.called = False
        self._index = 0
        self._named_started = False
        if plan.mode == "required":
            self._inner: ToolStream | None = _RequiredStream(frozenset(plan.names))
        else:
            self._inner = parser_stream

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.plan.mode == "none":
            return [{"content": text}] if text else []
        if self.plan.mode == "named":
            return self._named(text)
        assert self._inner is not None
        return self._deltas(self._inner.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            return self._named("") if not self._named_started else []
        if self._inner is None:
            return []
        return self._deltas(self._inner.finish())

    def _named(self, text: str) -> list[dict[str, Any]]:
        if self._named_started:
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        self._named_started = self.called = True
        return [{"tool_calls": [call_json(ParsedCall(self.plan.named or "", text), 0)]}]

    def _deltas(self, events: list) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ParsedCall):
                out.append({"tool_calls": [call_json(ev, self._index)]})
                self._index += 1
                self.called = True
            elif ev:
                out.append({"content": ev})
        return out


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None, parser: str | None
) -> ToolPlan | None:
    """The request's ToolPlan, None without tools; ToolError names a bad field. `tools`:
    protocol.ToolDef models, or (offline) dicts of the same shape."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    defs = [_tool_dict(t, i) for i, t in enumerate(tools)]
    seen: set[str] = set()
    for i, t in enumerate(defs):
        name = t["function"]["name"]
        if not TOOL_NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name {name!r} must be 1 to 64 letters, digits, "
                            "'_', '.' or '-'", "tools")  # fmt: skip
        if name in seen:
            raise ToolError(f"tools: the function name {name!r} is given twice", "tools")
        seen.add(name)
        params = t["function"].get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema of an object",
                            "tools")  # fmt: skip
    # "strict" stays out of the tools the template renders; under a grammar every call keeps to
    # its schema anyway, and under "auto" one strict tool asks for that grammar (ToolPlan)
    flags = [t["function"].pop("strict", None) for t in defs]  # every one popped
    strict = any(f is True for f in flags)
    if tool_choice is None:
        tool_choice = "auto"
    named = None
    if isinstance(tool_choice, str):
        mode = tool_choice
    else:
        mode, named = "named", tool_choice.function.name
        if named not in seen:
            raise ToolError(f"tool_choice names {named!r}, which is not among the tools",
                            "tool_choice")  # fmt: skip
    if mode == "auto" and parser is None:
        raise ToolError(
            "tool_choice 'auto' needs a tool-call parser, and this model's chat template does "
            f"not imply one: start the server with --tool-call-parser ({', '.join(PARSERS)}), "
            "or pass tool_choice 'required', 'none' or a named function",
            "tool_choice",
        )
    return ToolPlan(mode, defs, named, parser, True if parallel is None else parallel, strict)


# --- "auto" with strict tools: a structural tag per parser format --------------------------------


def auto_tool_tag(
    parser: str, schemas: dict[str, dict[str, Any]], parallel: bool
) -> dict[str, Any] | None:
    """The structural tag (xgrammar's form, sampling/structured.py) of tool_choice "auto" with
    strict tools, for the parser's format: free text, and any call written in that format
    names one of `schemas` (tool name -> its parameters schema) with arguments that keep to its
    schema; one call at most unless `parallel`. None for a format it cannot hold (pythonic).

    The invariant: whatever the tag allows, the parser reads no call whose arguments break
    their schema (an output may be narrower than the parser takes: one spelling per call)."""
    if parser == "hermes":
        fmt = _hermes_format(schemas, parallel)
    elif parser == "mistral":
        fmt = _mistral_format(schemas, parallel)
    elif parser == "llama3_json":
        fmt = _llama3_format(schemas, parallel)
    else:
        return None
    return {"type": "structural_tag", "format": fmt}


def _call_tag(begin: str, schema: dict[str, Any], end: str) -> dict[str, Any]:
    """`begin`, a JSON object of `schema` (whitespace bounded as the "json" kind's), `end`."""
    content = {"type": "json_schema", "json_schema": schema,
               "max_whitespace_cnt": MAX_JSON_WHITESPACE}  # fmt: skip
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _head(name: str, key: str) -> str:
    """A call object up to its arguments: `{"name": "f", "<key>": `."""
    return f'{{"name": {json.dumps(name)}, "{key}": '


def _hermes_format(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """Text; each `<tool_call>` opens `<tool_call>\n{"name": "f", "arguments": ARGS}\n</tool_call>`
    (Qwen's spelling), text again after it. The trigger is the parser's marker: no block the
    parser reads escapes the tag."""
    tags = [_call_tag(f"{HERMES_OPEN}\n{_head(n, 'arguments')}", s, f"}}\n{HERMES_CLOSE}")
            for n, s in schemas.items()]  # fmt: skip
    return {"type": "triggered_tags", "triggers": [HERMES_OPEN], "tags": tags,
            "stop_after_first": not parallel}  # fmt: skip


def _mistral_format(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """Text, then at most one `[TOOL_CALLS][{"name": "f", "arguments": ARGS}, ...]` that ends
    the output (the parser reads every array after the first marker, so none may follow)."""
    tags = [_call_tag(_head(n, "arguments"), s, "}") for n, s in schemas.items()]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ",
             "at_least_one": True, "stop_after_first": not parallel}  # fmt: skip
    block = {"type": "tag", "begin": f"{MISTRAL_MARKER}[", "content": calls, "end": "]"}
    return {"type": "triggered_tags", "triggers": [MISTRAL_MARKER], "tags": [block],
            "stop_after_first": True}  # fmt: skip


# llama3_json content starts with this: its first non-space character is not "{" (the spaces
# Python strips, as the parser does, include \x1c-\x1f and \x85, which xgrammar's \s lacks).
# With the python tag kept out of it too, the parser reads no call in such text.
_LLAMA3_TEXT_START = r"[ \t\n\r]*[^\s{\x1c-\x1f\x85]"


def _llama3_format(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The parser reads calls only when they are the whole output, so: either the whole output
    is `[<|python_tag|>]{"name": "f", "parameters": ARGS}` (`; ` between more), or it is text
    that does not start as a call (`_LLAMA3_TEXT_START`). Such text cannot open with "{"."""
    tags = [_call_tag(_head(n, "parameters"), s, "}") for n, s in schemas.items()]
    calls = {"type": "sequence", "elements": [
        {"type": "regex", "pattern": r"[ \t\n\r]*(<\|python_tag\|>)?"},
        {"type": "tags_with_separator", "tags": tags, "separator": "; ",
         "at_least_one": True, "stop_after_first": not parallel}]}  # fmt: skip
    # the tag less its "<" is excluded: that "<" may be the first character, which the regex took
    text = {"type": "sequence", "elements": [
        {"type": "regex", "pattern": _LLAMA3_TEXT_START},
        {"type": "any_text", "excludes": [PYTHON_TAG[1:]]}]}  # fmt: skip
    return {"type": "or", "elements": [calls, text]}


def _tool_dict(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict):
        return tool.model_dump(exclude_none=True)
    f = tool.get("function")
    if tool.get("type") != "function" or not isinstance(f, dict) or not isinstance(
            f.get("name"), str):  # fmt: skip
        raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                        "tools")  # fmt: skip
    if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
        raise ToolError(f"tools[{i}].function.parameters must be a JSON schema", "tools")
    return {"type": "function", "function": dict(f)}


def template_reads(template: Any, word: str) -> bool:
    """Whether a chat template's source mentions `word` (a dict of templates: any of them)."""
    if isinstance(template, dict):
        return any(word in str(t) for t in template.values())
    return word in str(template or "")


def tools_system_text(plan: ToolPlan) -> str:
    """The tools, for a chat template that does not render them, and how to answer."""
    lines = ["You can call these tools (JSON schemas):"]
    lines += [json.dumps(t["function"], ensure_ascii=False) for t in plan.tools]
    if plan.mode == "named":
        lines.append(f"Call {plan.named}: answer with its arguments as one JSON object.")
    elif plan.mode == "required":
        lines.append('Answer with a JSON array of calls, each {"name": ..., "parameters": {...}}.')
    elif plan.mode == "auto" and plan.parser is not None:
        lines.append("To call a tool, answer with " + _call_format(plan.parser) + "; otherwise "
                     "answer normally.")  # fmt: skip
    return "\n".join(lines)


def _call_format(parser: str | None) -> str:
    if parser == "pythonic":
        return "[name(argument=value, ...), ...]"
    if parser == "hermes":
        return f'{HERMES_OPEN}{{"name": ..., "arguments": {{...}}}}{HERMES_CLOSE}'
    if parser == "mistral":
        return f'{MISTRAL_MARKER}[{{"name": ..., "arguments": {{...}}}}]'
    return f'{PYTHON_TAG}{{"name": ..., "parameters": {{...}}}}'


def calls_as_text(calls: list[dict[str, Any]], parser: str | None) -> str:
    """Earlier turns' calls written in the parser's format (for a template that does not read
    `tool_calls`), so that the parser would read them back: one list for pythonic, `;` between
    llama3_json's, a block each for hermes (the default) and one array for mistral."""
    bodies, pythonic = [], []
    for c in calls:
        f = c["function"]
        args = _arguments(f["arguments"])
        bodies.append(f'{{"name": {json.dumps(f["name"])}, "arguments": {json.dumps(args)}}}')
        pythonic.append(f"{f['name']}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items())
                        + ")")  # fmt: skip
    if parser == "pythonic":  # JSON's literals are the pythonic parser's too
        return "[" + ", ".join(pythonic) + "]"
    if parser == "mistral":
        return f"{MISTRAL_MARKER}[" + ", ".join(bodies) + "]"
    if parser == "llama3_json":
        return "; ".join(bodies)
    return "\n".join(f"{HERMES_OPEN}{b}{HERMES_CLOSE}" for b in bodies)


def _arguments(arguments: Any) -> dict[str, Any]:
    """A call's arguments as an object: parsed from JSON text; {} for what is not one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return {}
    return arguments if isinstance(arguments, dict) else {}


def messages_for_template(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template: Any
) -> list[dict[str, Any]]:
    """The messages with the tools and earlier calls where this template will show them."""
    if not template_reads(template, "tool_calls"):
        for m in messages:
            calls = m.pop("tool_calls", None)
            if calls:
                text = calls_as_text(calls, plan.parser if plan else None)
                m["content"] = f"{m['content']}\n{text}" if m["content"] else text
    if plan is None or template_reads(template, "tools"):
        return messages
    text = tools_system_text(plan)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]

