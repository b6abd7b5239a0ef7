"""gpt-oss's harmony output (server/harmony.py): the `openai_gptoss` reasoning parser and the
`openai` tool-call parser on the format doc's examples and on multi-message, preamble,
role-part recipient, cut-off and stop-token cases; the same result however the text streams
in, with no marker or header text ever sent as reasoning or content; the launch defaults for
a harmony template; and a harmony answer through the chat view, streamed and not."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest

from swaserve import SamplingParams
from swaserve.outputs import CompletionOutput, RequestOutput
from swaserve.server import protocol as P
from swaserve.server.harmony import CALL, MARKERS, HarmonyStream, Header, call_head, parse_header
from swaserve.server.reasoning import get_reasoning_parser
from swaserve.server.tool_parsers import ParsedCall, detect_parser, get_parser

TOOLS = {"get_weather", "generate_file"}
THINK = 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
DOC_ANSWER = f"<|channel|>analysis<|message|>{THINK}<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4."  # noqa: E501
DOC_CALL = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>"
            "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"location":"San Francisco"}')  # fmt: skip
PLAN = "**Action plan**:\n1. Generate an HTML file\n---\nWill start executing the plan"
DOC_PREAMBLE = ("<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant"
                f"<|channel|>commentary<|message|>{PLAN}<|end|><|start|>assistant<|channel|>"
                "commentary to=functions.generate_file<|constrain|>json<|message|>"
                '{"template": "basic_html", "path": "index.html"}')  # fmt: skip
SF = ParsedCall("get_weather", '{"location": "San Francisco"}')
FILE = ParsedCall("generate_file", '{"template": "basic_html", "path": "index.html"}')

# text -> (reasoning, content, calls) once the reasoning parser (calls on) and then the openai
# tool-call parser have read it
CASES: dict[str, tuple[str | None, str | None, list[ParsedCall]]] = {
    DOC_ANSWER + "<|return|>": (THINK, "2 + 2 = 4.", []),
    DOC_ANSWER: (THINK, "2 + 2 = 4.", []),  # the stop token's text left out (the default)
    DOC_CALL + "<|call|>": ("Need to use function get_weather.", None, [SF]),
    DOC_CALL: ("Need to use function get_weather.", None, [SF]),
    DOC_PREAMBLE + "<|call|>": ("{long chain of thought}", PLAN, [FILE]),
    # several analysis messages, joined by "\n"; the recipient in the role part, a bare type
    "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B."
    "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    '{"location": "San Francisco"}<|call|>': ("A.\nB.", None, [SF]),
    # the first header's recipient in its role part (the prompt ended `<|start|>assistant`)
    ' to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"location":'
    '"San Francisco"}': (None, None, [SF]),
    # a preamble, then a final message: contents joined by "\n"
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
    "<|message|>Done.<|return|>": (None, "Checking.\nDone.", []),
    # a built-in tool's call (browser, python) is reasoning
    "<|channel|>analysis<|message|>Search it.<|end|><|start|>assistant<|channel|>analysis "
    'to=browser.search code<|message|>{"query": "x"}<|call|>': (
        'Search it.\n{"query": "x"}', None, []),
    "<|channel|>analysis to=python code<|message|>print(1)<|call|>": ("print(1)", None, []),
    # cut by max_tokens: in the first header, in a later header, in content, in a call
    "<|channel|>analy": (None, None, []),
    "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>fin": ("A.", None, []),
    "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>commentary to=functions"
    ".get_weather <|constrain|>js": ("A.", None, []),
    "<|channel|>analysis<|message|>User asks: \"What": ('User asks: "What', None, []),
    "<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2":
        ("A.", "2 + 2", []),
    "<|channel|>commentary to=functions.get_weather<|message|>{\"location\": \"San": (
        None, None, [ParsedCall("get_weather", '{"location": "San')]),
    # no header: a grammar from the first token (response_format, a named call), or the
    # markers skipped by the request's skip_special_tokens
    '{"a": 1}<|return|>': (None, '{"a": 1}', []),
    '  {"a": [1, 2]}': (None, '  {"a": [1, 2]}', []),
    "analysisThinking.assistantfinal4": (None, "analysisThinking.assistantfinal4", []),
    "": (None, None, []),
    # a message with no channel, an unknown function (still a call, as in vLLM), empty args
    "<|channel|>final<|message|>a < b<|end|><|start|>assistant<|message|>c<|return|>": (
        None, "a < b\nc", []),
    "<|channel|>commentary to=functions.nope<|message|><|call|>": (
        None, None, [ParsedCall("nope", "{}")]),
}  # fmt: skip


def _splits(text: str, seed: int = 0) -> list[list[str]]:
    """Every 2-piece split, one character at a time, and seeded random multi-piece splits."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(seed)
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def _whole(text: str) -> tuple[str | None, str | None, list[ParsedCall]]:
    reasoning, content = get_reasoning_parser("openai_gptoss", calls=True).split(text)
    content, calls = get_parser("openai", TOOLS).parse(content or "")
    return reasoning, content or None, calls


def _streamed(pieces: list[str]) -> tuple[str | None, str | None, list[ParsedCall]]:
    """Both parsers fed delta by delta, as the chat view does; no marker is ever sent."""
    rs, ts = get_reasoning_parser("openai_gptoss", calls=True).stream(), get_parser(
        "openai", TOOLS).stream()  # fmt: skip
    reasoning, events = "", []
    for i, piece in enumerate([*pieces, None]):
        out = rs.feed(piece) if piece is not None else rs.finish()
        assert all(t for _, t in out), out  # no empty piece
        thought = "".join(t for k, t in out if k == "reasoning")
        assert "<|" not in thought, (pieces, i, thought)
        reasoning += thought
        content = "".join(t for k, t in out if k == "content")
        events += ts.feed(content) + (ts.finish() if piece is None else [])
    text = "".join(e for e in events if isinstance(e, str))
    assert all(m not in text for m in MARKERS), (pieces, text)
    calls = [e for e in events if isinstance(e, ParsedCall)]
    return reasoning or None, (text.strip() if calls else text) or None, calls


@pytest.mark.parametrize("text", list(CASES))
def test_split_and_stream_agree(text):
    want = CASES[text]
    assert _whole(text) == want
    for pieces in _splits(text, len(text)):
        assert _streamed(pieces) == want, pieces


@pytest.mark.parametrize("text", list(CASES))
def test_without_a_tool_parser_calls_are_reasoning(text):
    """No tools (or tool_choice "none"): a function's message is reasoning, and every piece of
    reasoning or content, however the text streams, is free of marker and header text."""
    parser = get_reasoning_parser("openai_gptoss")
    reasoning, content = parser.split(text)
    want_r, want_c, calls = CASES[text]
    assert content == want_c
    if not calls:
        assert reasoning == want_r
    for pieces in _splits(text, 1)[::3]:
        stream, got = parser.stream(), []
        for piece in pieces:
            got += stream.feed(piece)
        got += stream.finish()
        for _, t in got:
            assert t and all(m not in t for m in MARKERS) and "to=" not in t, (pieces, got)
            assert "assistant" not in t or text.startswith("analysisThinking"), (pieces, got)
        joined = tuple("".join(t for k, t in got if k == kind) or None
                       for kind in ("reasoning", "content"))  # fmt: skip
        assert joined == (reasoning, content), pieces


def test_stream_sends_early_and_holds_marker_prefixes():
    stream = get_reasoning_parser("openai_gptoss").stream()
    assert stream.feed("<|channel|>analysis<|mess") == []  # a header goes out only whole
    assert stream.feed("age|>Thin") == [("reasoning", "Thin")]  # reasoning as it comes
    assert stream.feed("king.<|e") == [("reasoning", "king.")]  # "<|e" may be <|end|>
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>4<") == [
        ("content", "4")]
    assert stream.feed("3") == [("content", "<3")]  # not a marker after all
    assert stream.finish() == []

    calls = get_reasoning_parser("openai_gptoss", calls=True).stream()
    assert calls.feed("<|channel|>commentary to=functions.f<|constrain|>json<|message|>{") == [
        ("content", call_head("f")), ("content", "{")]
    assert calls.finish() == [("content", CALL)]  # a cut call is closed


def test_parse_header():
    assert parse_header("<|channel|>final<|message|>") == Header(channel="final")
    assert parse_header("<|start|>assistant<|channel|>commentary to=functions.get_weather "
                        "<|constrain|>json<|message|>") == Header(
        "assistant", "commentary", "functions.get_weather", "json")  # fmt: skip
    assert parse_header("assistant to=functions.f<|channel|>commentary json") == Header(
        "assistant", "commentary", "functions.f", "json")
    assert parse_header(" to=python<|channel|>analysis code").recipient == "python"
    h = parse_header("<|start|>assistant to=functions.a.b<|channel|>commentary")
    assert h.function == "a.b" and h.raw.startswith("<|start|>")
    assert parse_header("<|channel|>analysis to=browser.search").function is None
    assert parse_header("<|channel|>commentary to=functions.").function is None


def test_events_give_the_text_back():
    """Every event's text joined (a header's raw) is the input, whatever the split."""
    texts = [*CASES, "x<|end|>y<|start|>a<|end|>b<|start|>c<|start|>d<|message|>e<|channel|>f"]
    for text in texts:
        for opening in (True, False):
            for pieces in _splits(text)[::5]:
                s = HarmonyStream(opening)
                events = [e for p in pieces for e in s.feed(p)] + s.finish()
                assert "".join(v.raw if k == "header" else v for k, v in events) == text
                assert all(v for k, v in events if k != "end")


def test_tool_parser_reads_the_canonical_form():
    p = get_parser("openai", TOOLS)
    call = call_head("get_weather") + '{"location":"San Francisco"}' + CALL
    assert p.parse(call) == (None, [SF])
    assert p.parse("Checking.\n" + call) == ("Checking.", [SF])
    assert p.parse(call + call_head("generate_file") + "not json") == (
        None, [SF, ParsedCall("generate_file", "not json")])  # args as written, as vLLM's
    # raw harmony (no reasoning parser): calls found, the rest content as written
    content, calls = p.parse(DOC_CALL + "<|call|>")
    assert calls == [SF] and content == (
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>")
    raw = DOC_ANSWER + "<|return|>"
    assert p.parse(raw) == (raw, [])  # no call: the text unchanged, as every parser's


def test_detect_parser_on_a_harmony_template():
    snippet = ('{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking }}'
               "{%- if tool_call %}<|tool_call|>{{ '<tool_call>' }}{% endif %}")  # fmt: skip
    assert detect_parser(snippet) == "openai"  # harmony's checked first


def test_launch_defaults_for_a_harmony_template():
    from swaserve.server.launch import ServerArgs, _reasoning_parser, _tool_parser

    harmony = "{{- '<|start|>assistant<|channel|>final<|message|>' }}"
    tok = SimpleNamespace(chat_template=harmony)
    assert _reasoning_parser(ServerArgs(), None, harmony) == "openai_gptoss"
    assert _reasoning_parser(ServerArgs(), tok, None) == "openai_gptoss"  # the tokenizer's
    assert _reasoning_parser(ServerArgs(reasoning_parser="qwen3"), tok, None) == "qwen3"
    assert _reasoning_parser(ServerArgs(), None, "{{ '<tool_call>' }}") is None
    with pytest.raises(ValueError, match="openai_gptoss"):
        _reasoning_parser(ServerArgs(reasoning_parser="granite"), None, None)
    assert _tool_parser(ServerArgs(), tok, None) == "openai"
    assert _tool_parser(ServerArgs(tool_call_parser="hermes"), tok, None) == "hermes"


def test_harmony_requests_keep_special_tokens():
    from swaserve.server.app import _keep_markers
    from swaserve.server.tools import plan_tools

    ask = P.ChatCompletionRequest.model_validate
    msgs = [{"role": "user", "content": "hi"}]
    params = SamplingParams()
    for parser, want in (("openai_gptoss", False), ("qwen3", True), (None, True)):
        state = SimpleNamespace(reasoning_parser=parser)
        assert _keep_markers(state, ask({"messages": msgs}), None, params).skip_special_tokens \
            is want  # fmt: skip
        body = ask({"messages": msgs, "skip_special_tokens": True})  # the request's own wins
        assert _keep_markers(state, body, None, params).skip_special_tokens is True
    body = ask({"messages": msgs, "tools": [WEATHER]})
    plan = plan_tools(body.tools, None, None, "openai")
    state = SimpleNamespace(reasoning_parser=None)
    assert _keep_markers(state, body, plan, params).skip_special_tokens is False


# --- through the chat view (server/app.py) ---------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"location": {"type": "string"}}}}}  # fmt: skip


def _view(tools: bool):
    from swaserve.server.app import _ChatView
    from swaserve.server.tools import plan_tools

    state = SimpleNamespace(tokenizer=None, model_name="m", reasoning_parser="openai_gptoss")
    fields: dict = {"messages": [{"role": "user", "content": "Weather in SF?"}]}
    if tools:
        fields["tools"] = [WEATHER]
    body = P.ChatCompletionRequest.model_validate(fields)
    plan = plan_tools(body.tools, body.tool_choice, None, "openai")
    return _ChatView(state, body, SamplingParams(), [1, 2, 3], "chatcmpl-1", 0, plan)


def _out(text: str, reason: str | None) -> RequestOutput:
    co = CompletionOutput(0, text, [0] * len(text), reason, 200012 if reason else None)
    return RequestOutput("r", None, [1, 2, 3], [co])


def _stream(view, pieces: list[str]) -> dict:
    async def events():
        for i, piece in enumerate(pieces):
            yield "r", _out(piece, "stop" if i == len(pieces) - 1 else None)

    async def collect() -> list[dict]:
        return [c async for c in view.chunks(events())]

    got: dict = {"reasoning_content": "", "content": "", "tool_calls": [], "finish_reason": None}
    for chunk in asyncio.run(collect()):
        for c in chunk["choices"]:
            d = c["delta"]
            got["reasoning_content"] += d.get("reasoning_content") or ""
            got["content"] += d.get("content") or ""
            got["tool_calls"] += [(t["function"]["name"], t["function"]["arguments"])
                                  for t in d.get("tool_calls", [])]  # fmt: skip
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
    return got


@pytest.mark.parametrize("tools", [True, False])
def test_chat_view_streamed_and_not(tools):
    """A harmony answer with a preamble and a call: reasoning_content, content and tool_calls,
    the same streamed (in pieces of every size) and not; without tools the call is reasoning."""
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        "commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"location":"SF"}'
    )
    message = _view(tools).response(_out(text, "stop"))["choices"][0]
    m = message["message"]
    if tools:
        assert (m["reasoning_content"], m["content"]) == ("Need the weather.", "Let me check.")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in m["tool_calls"]] == [("get_weather", {"location": "SF"})]  # fmt: skip
        assert message["finish_reason"] == "tool_calls"
    else:
        assert m["reasoning_content"] == 'Need the weather.\n{"location":"SF"}'
        assert m["content"] == "Let me check." and "tool_calls" not in m
        assert message["finish_reason"] == "stop"
    want = {"reasoning_content": m["reasoning_content"], "content": m["content"],
            "tool_calls": [(c["function"]["name"], c["function"]["arguments"])
                           for c in m.get("tool_calls", [])],
            "finish_reason": message["finish_reason"]}  # fmt: skip
    for size in (1, 2, 3, 7, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        assert _stream(_view(tools), pieces) == want, size
