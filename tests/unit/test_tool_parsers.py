"""Tool-call parsers (server/tool_parsers.py): each format's calls and content from a whole
output, the invalid-call rules (hermes per block, llama3_json and mistral all or nothing), and
the streaming invariant: however the output is cut into deltas, feed()+finish() give parse()'s
calls in order, and its content (exactly when there is no call, after .strip() when there are
calls), with no marker prefix ever sent as content early."""

from __future__ import annotations

import json
import random

import pytest

from swaserve.server.harmony import call_head
from swaserve.server.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    OpenAIParser,
    ParsedCall,
    ToolParser,
    detect_parser,
    get_parser,
)

TOOLS = {"get_weather", "search"}
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SEARCH = '{"name": "search", "arguments": {"q": "x", "n": 3}}'
W = ParsedCall("get_weather", '{"city": "Paris"}')
S = ParsedCall("search", '{"q": "x", "n": 3}')


def _hermes(*blocks: str) -> str:
    return "".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)


def _harmony(name: str, args: str, end: str = "<|call|>") -> str:
    """A call in the canonical form that the openai_gptoss reasoning parser writes."""
    return call_head(name) + args + end


# --- hermes ----------------------------------------------------------------------------------


def test_hermes_formats():
    p = HermesParser(TOOLS)
    assert p.parse(_hermes(WEATHER)) == (None, [W])
    assert p.parse(_hermes(WEATHER, SEARCH)) == (None, [W, S])
    assert p.parse("\n" + _hermes(WEATHER) + "\n" + _hermes(SEARCH) + "\n") == (None, [W, S])
    assert p.parse("Let me check.\n\n" + _hermes(WEATHER)) == ("Let me check.", [W])
    # Text between and after blocks stays content (the pieces joined, then stripped).
    assert p.parse("A " + _hermes(WEATHER) + " B " + _hermes(SEARCH) + " C\n") == (
        "A  B  C", [W, S])
    # No whitespace around the JSON; compact JSON re-serialised.
    assert p.parse('<tool_call>{"name":"search","arguments":{"q":"x","n":3}}</tool_call>') == (
        None, [S])


def test_hermes_missing_close_tag():
    p = HermesParser(TOOLS)
    assert p.parse("Sure.\n<tool_call>\n" + WEATHER + "\n") == ("Sure.", [W])
    assert p.parse(_hermes(SEARCH) + "<tool_call>" + WEATHER) == (None, [S, W])
    # Unclosed and not JSON to the end: content.
    text = "<tool_call>" + WEATHER + " and more"
    assert p.parse(text) == (text, [])


def test_hermes_argument_forms():
    p = HermesParser(TOOLS)
    as_string = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})})
    assert p.parse(_hermes(as_string)) == (None, [W])
    params = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert p.parse(_hermes(params)) == (None, [W])
    assert p.parse(_hermes('{"name": "search"}')) == (None, [ParsedCall("search", "{}")])
    uni = '{"name": "search", "arguments": {"q": "Zürich \\u00e9t\\u00e9 🌍"}}'
    (content, calls) = p.parse(_hermes(uni))
    assert calls == [ParsedCall("search", '{"q": "Zürich été 🌍"}')]
    assert json.loads(calls[0].arguments) == {"q": "Zürich été 🌍"}


@pytest.mark.parametrize("bad", [
    '{"name": "rm_rf", "arguments": {}}',                  # unknown tool
    '{"name": "search", "arguments": {"q": }',             # malformed JSON
    '{"name": "search", "arguments": [1, 2]}',             # arguments not an object
    '{"name": "search", "arguments": "not json"}',         # string that is not JSON
    '{"name": "search", "arguments": "[1]"}',              # string holding a non-object
    '{"name": "search", "arguments": null}',
    '{"name": 3, "arguments": {}}',
    '["search", {}]',
])
def test_hermes_invalid_block_is_content(bad):
    p = HermesParser(TOOLS)
    alone = _hermes(bad)
    assert p.parse(alone) == (alone, [])
    with_text = "Hi " + alone
    assert p.parse(with_text) == (with_text, [])
    # Per block: the valid block is a call, the invalid one stays as raw text.
    mixed = "Hi\n" + _hermes(WEATHER) + _hermes(bad)
    assert p.parse(mixed) == ("Hi\n" + _hermes(bad), [W])


def test_no_call_is_content_unchanged():
    for name in PARSERS:
        p = get_parser(name, TOOLS)
        for text in ["", "   ", "\n Hello, world!  \n", "<tool", "[TOOL", "<|python_tag|",
                     '{"a": 1}', "a < b and [c]"]:
            assert p.parse(text) == (text, []), (name, text)


# --- llama3_json -----------------------------------------------------------------------------


def test_llama3_formats():
    p = Llama3JsonParser(TOOLS)
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    two = '{"name": "search", "parameters": {"q": "x", "n": 3}}'
    assert p.parse(one) == (None, [W])
    assert p.parse("  \n" + one + "\n") == (None, [W])
    assert p.parse("<|python_tag|>" + one) == (None, [W])
    assert p.parse("\n<|python_tag|> " + one + " ; " + two + ";") == (None, [W, S])
    assert p.parse(one + "; " + two) == (None, [W, S])
    assert p.parse(WEATHER) == (None, [W])  # "arguments" accepted too
    assert p.parse('{"type": "function", "name": "search", "parameters": {}}') == (
        None, [ParsedCall("search", "{}")])
    uni = '{"name": "search", "parameters": {"q": "日本語"}}'
    assert p.parse(uni) == (None, [ParsedCall("search", '{"q": "日本語"}')])
    as_string = json.dumps({"name": "get_weather", "parameters": json.dumps({"city": "Paris"})})
    assert p.parse(as_string) == (None, [W])


@pytest.mark.parametrize("text", [
    'The answer: {"name": "search", "parameters": {}}',           # text before
    '{"name": "search", "parameters": {}} thanks',                # text after
    '{"name": "search", "parameters": {}}; {"name": "nope", "parameters": {}}',
    '{"name": "search", "parameters": {"q": }',
    '{"name": "search", "parameters": "q"}',
    '{"name": "search", "parameters": {}};;',
    '<|python_tag|>brave_search.call(query="x")',
    "<|python_tag|>",
    '[{"name": "search", "parameters": {}}]',
])
def test_llama3_all_or_nothing(text):
    assert Llama3JsonParser(TOOLS).parse(text) == (text, [])


# --- mistral ---------------------------------------------------------------------------------


def test_mistral_formats():
    p = MistralParser(TOOLS)
    assert p.parse(f"[TOOL_CALLS] [{WEATHER}]") == (None, [W])
    assert p.parse(f"[TOOL_CALLS][{WEATHER}, {SEARCH}]") == (None, [W, S])
    assert p.parse(f"Checking.\n[TOOL_CALLS] [{WEATHER}]\n") == ("Checking.", [W])
    assert p.parse(f"[TOOL_CALLS] [{WEATHER}][TOOL_CALLS] [{SEARCH}]") == (None, [W, S])
    assert p.parse(f"[TOOL_CALLS] {SEARCH}") == (None, [S])
    params = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert p.parse(f"[TOOL_CALLS] [{params}]") == (None, [W])
    as_string = json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris"})})
    assert p.parse(f"[TOOL_CALLS] [{as_string}]") == (None, [W])
    uni = '{"name": "search", "arguments": {"q": "ça va 👍"}}'
    assert p.parse(f"[TOOL_CALLS] [{uni}]") == (None, [ParsedCall("search", '{"q": "ça va 👍"}')])


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]',
    f'[TOOL_CALLS] [{WEATHER}, {{"name": "nope", "arguments": {{}}}}]',
    '[TOOL_CALLS] [{"name": "search", "arguments": {"q": }]',
    '[TOOL_CALLS] [{"name": "search", "arguments": 7}]',
    f"[TOOL_CALLS] [{WEATHER}] and then some text",
    f"[TOOL_CALLS] [{WEATHER}][TOOL_CALLS] oops",
    "[TOOL_CALLS] []",
    "[TOOL_CALLS]",
    "Hi [TOOL_CALLS]get_weather[ARGS]{}",
])
def test_mistral_all_or_nothing(text):
    assert MistralParser(TOOLS).parse(text) == (text, [])


# --- registry --------------------------------------------------------------------------------


def test_pythonic_formats():
    p = get_parser("pythonic", TOOLS)
    assert p.parse('[get_weather(city="Paris")]') == (None, [W])
    assert p.parse(" [get_weather(city='Paris'), search(q='x', n=3)]\n") == (None, [W, S])
    assert p.parse('<|python_start|>[search(q="x", n=3)]<|python_end|>') == (None, [S])
    # JSON's literals read too (Olmo 3 writes them), nested values become JSON
    got = p.parse('[search(q=None, n=true, f=[1, {"a": False}])]')
    assert got == (None, [ParsedCall("search", '{"q": null, "n": true, "f": [1, {"a": false}]}')])
    assert p.parse("[search()]") == (None, [ParsedCall("search", "{}")])


@pytest.mark.parametrize("text", [
    "[get_weather('Paris')]",  # a positional argument
    "[get_weather(city=city)]",  # not a literal
    "[nope(city='Paris')]",  # not a tool
    "[get_weather(city='Paris')] and more",
    "[get_weather(**kw)]",
    "[os.system(cmd='ls')]",  # an attribute, not a name
    "[search(q={1, 2})]",  # a set: no JSON for it
    "[]",
    "get_weather(city='Paris')",  # not a list
])  # fmt: skip
def test_pythonic_all_or_nothing(text):
    assert get_parser("pythonic", TOOLS).parse(text) == (text, [])


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_deep_nesting_is_content_not_an_error(name):
    """Nesting deep enough to overflow json's or ast's recursion is the model's text: content."""
    deep = "[" * 100_000
    for text in (deep, '{"name": "search", "arguments": ' + deep,
                 "<tool_call>" + deep, "[TOOL_CALLS]" + deep, "[search(q=" + deep):
        parser = get_parser(name, TOOLS)
        assert parser.parse(text) == (text, [])
        stream = parser.stream()
        assert "".join(e for e in stream.feed(text) + stream.finish()) == text


def test_registry():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "openai"}
    for name, cls in PARSERS.items():
        p = get_parser(name, TOOLS)
        assert isinstance(p, cls) and isinstance(p, ToolParser) and p.name == name
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral"):
        get_parser("qwen_xml", TOOLS)


def test_detect_parser():
    assert detect_parser(None) is None
    assert detect_parser("") is None
    assert detect_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_parser("{{- '<tool_call>\\n' -}}{{ tool_call | tojson }}") == "hermes"
    assert detect_parser("{%- if message.role == 'ipython' %}") == "llama3_json"
    assert detect_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert detect_parser("{{- '[TOOL_CALLS][' }}") == "mistral"
    assert detect_parser("[func_name1(params_name1=params_value1)] ipython") == "pythonic"
    assert detect_parser("{{- '<|python_start|>' }}") == "pythonic"
    # gpt-oss's harmony template, checked first
    assert detect_parser("{{- '<|start|>assistant<|channel|>final<|message|>' }} ipython") == (
        "openai")


# --- openai (harmony) ------------------------------------------------------------------------


def test_openai_formats():
    p = OpenAIParser(TOOLS)
    assert p.parse(_harmony("get_weather", '{"city":"Paris"}')) == (None, [W])
    assert p.parse("Let me check.\n" + _harmony("get_weather", '{"city": "Paris"}')
                   + _harmony("search", '{"q": "x", "n": 3}', "<|end|>")) == ("Let me check.",
                                                                            [W, S])  # fmt: skip
    # the recipient in the channel part, a bare content type, no <|start|>; cut (no end)
    raw = '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Paris"}'
    assert p.parse(raw) == (None, [W])
    # arguments that are not JSON stay as written; empty ones are {}
    assert p.parse(_harmony("search", "q=x")) == (None, [ParsedCall("search", "q=x")])
    assert p.parse(_harmony("search", "")) == (None, [ParsedCall("search", "{}")])
    # other messages stay content as written (markers too: no reasoning parser took them)
    other = "<|start|>assistant<|channel|>final<|message|>Hi<|end|>"
    assert p.parse(other) == (other, [])
    assert p.parse(other + _harmony("search", "{}")) == (other, [ParsedCall("search", "{}")])


# --- streaming -------------------------------------------------------------------------------

SAMPLES: dict[str, list[str]] = {
    "hermes": [
        "",
        "Hello, world!",
        "  leading and trailing  \n",
        "a < b, <tool and <tool_cal but no call",
        _hermes(WEATHER),
        "Let me check.\n\n" + _hermes(WEATHER, SEARCH) + "\n",
        "\n\n" + _hermes(WEATHER) + "\n",
        "A " + _hermes(WEATHER) + " B " + _hermes(SEARCH) + " C\n",
        "Sure.\n<tool_call>\n" + WEATHER + "\n",
        _hermes(SEARCH) + "<tool_call>" + WEATHER,
        "<tool_call>" + WEATHER + " trailing junk",
        "Hi\n" + _hermes(WEATHER) + _hermes('{"name": "nope", "arguments": {}}') + "  ",
        _hermes('{"name": "search", "arguments": {"q": }') + "\n",
        "<<tool_call>" + SEARCH + "</tool_call></tool_call>x",
        _hermes('{"name": "search", "arguments": {"q": "Zürich 🌍"}}'),
        "x</tool_call><tool_call></tool_call>",
    ],
    "llama3_json": [
        "",
        "   ",
        "Hello!",
        " <b>bold</b>",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}} ; '
        '{"name": "search", "parameters": {"q": "x", "n": 3}};\n',
        '{"name": "search", "parameters": {}} thanks',
        '{"a": 1}',
        "<|python_tag|>brave_search.call(query='x')",
        "<|python_tag",
        '<|python_tag|>{"name": "search", "parameters": {"q": "日本語"}}',
    ],
    "pythonic": [
        "",
        "Hello!",
        " [1, 2] is a list",
        "[get_weather(city='Paris')]",
        "\n<|python_start|>[get_weather(city='Paris'), search(q='x', n=3)]<|python_end|>\n",
        "[nope()]",
        "<|python_st",
        "[search(q='Zürich 🌍')]",
    ],
    "openai": [
        "",
        "Hello, world!",
        "  a < b, <|sta and a stray <|end|> \n",
        _harmony("get_weather", '{"city": "Paris"}'),
        "Let me check.\n\n" + _harmony("get_weather", WEATHER) + _harmony("search", SEARCH),
        "  " + _harmony("search", '{"q": "Zürich 🌍"}', "") + "\n",
        "A " + _harmony("search", "not json", "<|end|>") + " B <|start|>assistant<|channel|>"
        "final<|message|>C<|return|>",
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
        "<|channel|>analysis<|message|>No call.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Done.<|return|>",
        "<|start|>assistant to=functions.search<|channel|>comm",  # a cut header: content
        "x<|start|>a<|start|>b<|message|>c<|channel|>d to=functions.search<|message|>{}",
    ],
    "mistral": [
        "",
        "Hello, world!",
        "arrays [1, 2] and [TOOL but no call ",
        f"[TOOL_CALLS] [{WEATHER}]",
        f"Checking.\n[TOOL_CALLS] [{WEATHER}, {SEARCH}]\n",
        f"  [TOOL_CALLS] [{WEATHER}][TOOL_CALLS] [{SEARCH}]",
        f"Hi [TOOL_CALLS] [{WEATHER}] and text",
        '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]  ',
        "[[TOOL_CALLS] []",
        '[TOOL_CALLS] [{"name": "search", "arguments": {"q": "ça va"}}]',
    ],
}


def _run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    s = parser.stream()
    events = [e for piece in pieces for e in s.feed(piece)] + s.finish()
    assert all(e != "" for e in events), events
    assert all(isinstance(e, (str, ParsedCall)) for e in events)
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ParsedCall)]


def _check(parser: ToolParser, text: str, pieces: list[str]) -> None:
    want_content, want_calls = parser.parse(text)
    content, calls = _run(parser, pieces)
    assert calls == want_calls, (text, pieces)
    if want_calls:
        assert content.strip() == (want_content or ""), (text, pieces)
        assert content == content.rstrip(), (text, pieces)
    else:
        assert content == want_content == text, (text, pieces)


def _cases():
    return [(name, text) for name, texts in SAMPLES.items() for text in texts]


@pytest.mark.parametrize("name,text", _cases())
def test_stream_matches_parse(name, text):
    parser = get_parser(name, TOOLS)
    _check(parser, text, [text])
    _check(parser, text, list(text))  # one character at a time
    for i in range(len(text) + 1):  # every 2-piece split
        _check(parser, text, [text[:i], text[i:]])
    rng = random.Random(len(text))
    for _ in range(20):  # random multi-piece splits
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 6))))
        bounds = [0, *cuts, len(text)]
        _check(parser, text, [text[a:b] for a, b in zip(bounds, bounds[1:])])


def test_stream_holds_marker_prefixes():
    text = "Sure <tool_call>" + WEATHER + "</tool_call>"
    s = HermesParser(TOOLS).stream()
    sent = []
    for ch in text:
        sent += s.feed(ch)
        assert not any(isinstance(e, str) and "<" in e for e in sent), sent
    sent += s.finish()
    assert "".join(e for e in sent if isinstance(e, str)) == "Sure" and sent[-1] == W

    s = MistralParser(TOOLS).stream()
    sent = []
    for ch in f"Ok [TOOL_CALLS] [{WEATHER}]":
        sent += s.feed(ch)
        assert not any(isinstance(e, str) and "[" in e for e in sent), sent
    sent += s.finish()
    assert "".join(e for e in sent if isinstance(e, str)) == "Ok" and sent[-1] == W

    s = Llama3JsonParser(TOOLS).stream()
    for ch in "  <|python_tag|>":
        assert s.feed(ch) == []

    s = OpenAIParser(TOOLS).stream()
    sent = []
    for ch in "Ok " + _harmony("get_weather", '{"city": "Paris"}'):
        sent += s.feed(ch)
        assert not any(isinstance(e, str) and "<" in e for e in sent), sent
    sent += s.finish()
    assert "".join(e for e in sent if isinstance(e, str)) == "Ok" and sent[-1] == W


def test_stream_sends_plain_text_early():
    for name in PARSERS:
        s = get_parser(name, TOOLS).stream()
        got = ""
        for ch in "Hello there, world":
            got += "".join(e for e in s.feed(ch) if isinstance(e, str))
        # All but whitespace held until more content follows it.
        assert got == "Hello there, world", name
        # A held marker prefix that turns out not to be one is sent once it can't be.
        got += "".join(e for e in s.feed(" <to") + s.feed("p>") if isinstance(e, str))
        assert got == "Hello there, world <top>", name
        assert s.finish() == []


def test_hermes_stream_sends_each_call_at_its_close_tag():
    s = HermesParser(TOOLS).stream()
    assert s.feed("Hi <tool_call>" + WEATHER) == ["Hi"]
    assert s.feed("</tool_call>\n<tool_call>" + SEARCH + "</tool") == [W]
    assert s.feed("_call>") == [S]
    assert s.finish() == []


def test_stream_feed_after_finish_raises():
    s = HermesParser(TOOLS).stream()
    s.finish()
    with pytest.raises(RuntimeError):
        s.feed("x")
    with pytest.raises(RuntimeError):
        s.finish()


def test_stream_matches_parse_generated():
    """Seeded generated outputs near each format (valid, invalid, unclosed, noise around)."""
    rng = random.Random(0)
    ws, txt = ["", " ", "\n", "\n\n"], ["", "Hi", "a<b", "[x]", "ok "]
    calls = [WEATHER, SEARCH, '{"name": "nope", "arguments": {}}', '{"name": "search"']

    def call() -> str:
        return rng.choice(calls) if rng.random() < 0.3 else rng.choice(calls[:2])

    for _ in range(150):
        hermes = rng.choice(txt) + rng.choice(ws) + "".join(
            "<tool_call>" + rng.choice(ws) + call() + rng.choice(ws)
            + rng.choice(["</tool_call>", "</tool_call>", ""]) + rng.choice(ws)
            + (rng.choice(txt) if rng.random() < 0.2 else "")
            for _ in range(rng.randint(1, 3)))
        llama3 = (rng.choice(ws) + rng.choice(["", "<|python_tag|>"])
                  + (rng.choice(ws) + ";").join(call() for _ in range(rng.randint(1, 3)))
                  + rng.choice(["", ";", " x"]) + rng.choice(ws))
        mistral = rng.choice(txt) + rng.choice(ws) + "".join(
            "[TOOL_CALLS]" + rng.choice(ws) + "[" + ", ".join(call() for _ in range(
                rng.randint(1, 2))) + "]" for _ in range(rng.randint(1, 2))) + rng.choice(ws)
        for name, text in (("hermes", hermes), ("llama3_json", llama3), ("mistral", mistral)):
            parser = get_parser(name, TOOLS)
            _check(parser, text, list(text))
            cuts = sorted(rng.sample(range(len(text) + 1), 3))
            bounds = [0, *cuts, len(text)]
            _check(parser, text, [text[a:b] for a, b in zip(bounds, bounds[1:])])
