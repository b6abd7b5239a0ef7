"""server/tools.py: what each tool_choice becomes (grammar, parser, finish_reason), streamed
output equal to the whole, the prompt a template that ignores tools gets, and the errors."""

from __future__ import annotations

import json
import random

import pytest

from swaserve import SamplingParams
from swaserve.sampling.structured import check_syntax, normalise
from swaserve.server import protocol as P
from swaserve.server.tools import (
    ToolError,
    messages_for_template,
    plan_tools,
    resolve_parser,
)


def _tools(*names: str, params: dict | None = None) -> list[P.ToolDef]:
    schema = params or {"type": "object", "properties": {"x": {"type": "integer"}}}
    return [P.ToolDef.model_validate({"type": "function", "function": {
        "name": n, "description": f"tool {n}", "parameters": schema}}) for n in names]  # fmt: skip


def _named(name: str) -> P.NamedToolChoice:
    return P.NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def _streamed(plan, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], bool]:
    td = plan.stream()
    deltas, prev = [], 0
    for c in [*cuts, len(text)]:
        deltas += td.feed(text[prev:c])
        prev = c
    deltas += td.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], ["", ""])
            if "id" in tc:
                entry[0] = tc["function"]["name"]
            entry[1] += tc["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], td.called


@pytest.mark.parametrize("parallel", [None, False])
def test_required_is_a_grammar_of_calls_and_streams_like_the_whole(parallel):
    plan = plan_tools(_tools("a", "b"), "required", parallel, None)
    grammar = plan.structured_outputs()
    check_syntax(grammar)  # xgrammar compiles it
    array = grammar["json"]
    assert array["minItems"] == 1 and ("maxItems" in array) == (parallel is False)
    assert {c["properties"]["name"]["const"] for c in array["items"]["anyOf"]} == {"a", "b"}
    texts = {
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]':
            [("a", '{"x": 1}'), ("b", "{}")],
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "para':  # cut by max_tokens
            [("a", '{"x": 1}')],
        "not json": [],
        '[{"name": ["x"], "parameters": {}}]': [],  # a name that is not a string: no call
        '[{"name": "a", "parameters": {"x": 1}}, {"name": 5}]': [("a", '{"x": 1}')],
    }  # fmt: skip
    rng = random.Random(0)
    for text, want in texts.items():
        content, calls = plan.output(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want
        assert content == (None if want else text)
        assert plan.finish_reason("stop", bool(calls)) == ("tool_calls" if want else "stop")
        assert plan.finish_reason("length", bool(calls)) == "length"
        splits = [[i] for i in range(len(text) + 1)]
        splits += [sorted(rng.sample(range(len(text)), 5)) for _ in range(20)]
        for cuts in splits:
            s_content, s_calls, called = _streamed(plan, text, cuts)
            assert s_calls == want and called == bool(want), cuts
            assert s_content == ("" if want else text), cuts


def test_named_call_is_the_whole_output():
    plan = plan_tools(_tools("a", "b"), _named("b"), None, None)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    assert plan.structured_outputs() == {"json": schema}
    content, calls = plan.output('{"x": 3}')
    assert content is None and calls[0]["function"] == {"name": "b", "arguments": '{"x": 3}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert plan.finish_reason("stop", True) == "stop"  # OpenAI's for a forced call
    for cuts in ([], [1], [2, 5, 6]):
        assert _streamed(plan, '{"x": 3}', cuts) == ("", [("b", '{"x": 3}')], True)
    assert _streamed(plan, "", []) == ("", [("b", "")], True)  # the call's head still goes out


def test_auto_reads_calls_with_the_parser():
    plan = plan_tools(_tools("a"), None, None, "hermes")  # tools given: "auto" by default
    assert plan.mode == "auto" and plan.structured_outputs() is None
    text = 'Let me look.\n<tool_call>{"name": "a", "arguments": {"x": 2}}</tool_call>'
    content, calls = plan.output(text)
    assert content == "Let me look." and calls[0]["function"]["arguments"] == '{"x": 2}'
    for cuts in ([], [3], [14, 20], list(range(1, len(text)))):
        s_content, s_calls, called = _streamed(plan, text, cuts)
        assert s_content.strip() == "Let me look." and s_calls == [("a", '{"x": 2}')] and called
    assert plan.output("No call here.") == ("No call here.", [])
    none = plan_tools(_tools("a"), "none", None, None)
    assert none.structured_outputs() is None and none.output(text) == (text, [])


@pytest.mark.parametrize(("tools", "choice", "parser", "param", "says"), [
    (None, "required", "hermes", "tool_choice", "needs tools"),
    (_tools("a"), _named("b"), "hermes", "tool_choice", "not among the tools"),
    (_tools("a", "a"), "required", None, "tools", "given twice"),
    (_tools("bad name"), "required", None, "tools", "letters, digits"),
    (_tools("a", params={"type": "array"}), "required", None, "tools", "of an object"),
    (_tools("a"), "auto", None, "tool_choice", "--tool-call-parser"),
    (_tools("a"), None, None, "tool_choice", "--tool-call-parser"),
])  # fmt: skip
def test_bad_tool_requests(tools, choice, parser, param, says):
    with pytest.raises(ToolError, match=says) as e:
        plan_tools(tools, choice, None, parser)
    assert e.value.param == param


def test_prompt_for_templates_that_ignore_tools():
    plan = plan_tools(_tools("a"), "auto", None, "hermes")
    call = {"id": "call_1", "type": "function", "function": {"name": "a", "arguments": {"x": 1}}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                                                "tool_calls": [call]}]  # fmt: skip
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    out = messages_for_template([dict(m) for m in msgs], plan, plain)
    assert out[0]["role"] == "system" and '"name": "a"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]  # how to call, in the parser's format
    assert out[2]["content"] == '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
    assert "tool_calls" not in out[2]
    with_system = [{"role": "system", "content": "Be brief."}, *msgs]
    out = messages_for_template([dict(m) for m in with_system], plan, plain)
    assert out[0]["content"].startswith("Be brief.\n\nYou can call") and len(out) == 3
    reads = "{{ tools }}{% for m in messages %}{{ m.tool_calls }}{% endfor %}"
    out = messages_for_template([dict(m) for m in msgs], plan, reads)
    assert out == msgs  # the template shows both itself


def test_resolve_parser():
    assert resolve_parser("auto", "... <tool_call> ...") == "hermes"
    assert resolve_parser(None, "{{ messages }}") is None
    assert resolve_parser("mistral", None) == "mistral"
    with pytest.raises(ValueError, match="hermes"):
        resolve_parser("granite", None)


def test_assistant_calls_reach_the_template_as_objects():
    m = P.ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
        {"id": "d", "type": "function", "function": {"name": "a", "arguments": "not json"}}]})
    t = m.to_template()
    assert [c["function"]["arguments"] for c in t["tool_calls"]] == [{"x": 1}, "not json"]
    assert P.ChatMessage.model_validate(
        {"role": "tool", "tool_call_id": "c", "content": "5"}).to_template()["tool_call_id"] == "c"


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_earlier_calls_are_written_as_the_parser_reads_them(parser):
    """An assistant turn's calls, written into its content for a template that does not read
    `tool_calls`, parse back to the same calls with the server's parser."""
    from swaserve.server.tool_parsers import get_parser
    from swaserve.server.tools import calls_as_text

    calls = [{"id": "c1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
             {"id": "c2", "type": "function", "function": {
                 "name": "b", "arguments": {"s": "O'Neil \"q\"", "t": True}}}]  # fmt: skip
    text = calls_as_text(calls, parser)
    content, parsed = get_parser(parser, {"a", "b"}).parse(text)
    assert content is None and [(c.name, c.arguments) for c in parsed] == [
        ("a", '{"x": 1}'), ("b", '{"s": "O\'Neil \\"q\\"", "t": true}')]


def test_enable_auto_tool_choice_without_a_parser_fails_at_start(capsys):
    """vLLM's --enable-auto-tool-choice on a model whose template implies no tool format, and
    no --tool-call-parser: a one-line error before anything loads (exit 2)."""
    from swaserve.cli import main as cli_main

    rc = cli_main(["serve", "--device", "cpu", "--port", "0", "--enable-auto-tool-choice"])
    err = capsys.readouterr().err
    assert rc == 2 and "--tool-call-parser (hermes, llama3_json, mistral, pythonic, openai)" \
        in err, err


# --- "auto" with strict tools: a structural tag in the parser's format -----------------------

UNIT = {"type": "string", "enum": ["celsius", "fahrenheit"]}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 20}, "unit": UNIT}}
ZONE = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
W_ARGS, T_ARGS = '{"city": "Paris", "unit": "celsius"}', '{"zone": "CET"}'
BAD_ARGS = '{"city": "Paris", "unit": "kelvin"}'  # outside the enum


def _strict_tools(strict: bool = True) -> list[P.ToolDef]:
    """get_weather (strict unless told) and get_time (never strict: held all the same)."""
    return [P.ToolDef.model_validate({"type": "function", "function": {
                "name": "get_weather", "parameters": WEATHER, "strict": strict}}),
            P.ToolDef.model_validate({"type": "function", "function": {
                "name": "get_time", "parameters": ZONE}})]  # fmt: skip


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def _obj(name: str, args: str, key: str = "arguments") -> str:
    return f'{{"name": "{name}", "{key}": {args}}}'


# parser -> (texts the tag takes, with the calls they parse to; texts it refuses; what a second
# call looks like after a first, refused with parallel_tool_calls false)
STRICT_CASES = {
    "hermes": (
        {"Let me look.\n" + _hermes("get_weather", W_ARGS):
             [("get_weather", W_ARGS)],
         _hermes("get_time", T_ARGS) + " then " + _hermes("get_weather", W_ARGS) + " done.":
             [("get_time", T_ARGS), ("get_weather", W_ARGS)],
         "No call, just {braces}.": []},
        ["Sure. " + _hermes("get_weather", BAD_ARGS),
         _hermes("get_weather", '{"city": "Paris"}'),  # a required argument missing
         _hermes("get_time", '{"zone": 5}'),  # the non-strict tool's schema holds too
         _hermes("get_date", "{}"),  # no such tool
         "Sure. " + _hermes("get_weather", W_ARGS)[:-3]],  # an opened call must close
        _hermes("get_weather", W_ARGS) + "<tool_call>"),
    "mistral": (
        {"Sure. [TOOL_CALLS][" + _obj("get_weather", W_ARGS) + ", "
         + _obj("get_time", T_ARGS) + "]": [("get_weather", W_ARGS), ("get_time", T_ARGS)],
         "[TOOL_CALLS][" + _obj("get_time", T_ARGS) + "]": [("get_time", T_ARGS)],
         "No call.": []},
        ["[TOOL_CALLS][" + _obj("get_weather", BAD_ARGS) + "]",
         "[TOOL_CALLS][" + _obj("get_weather", W_ARGS) + "] and then text",
         "[TOOL_CALLS][]"],
        "[TOOL_CALLS][" + _obj("get_weather", W_ARGS) + ", {"),
    "llama3_json": (
        {_obj("get_weather", W_ARGS, "parameters"): [("get_weather", W_ARGS)],
         "<|python_tag|>" + _obj("get_time", T_ARGS, "parameters") + "; "
         + _obj("get_weather", W_ARGS, "parameters"): [("get_time", T_ARGS),
                                                      ("get_weather", W_ARGS)],
         "No call, just {braces}.": []},
        [_obj("get_weather", BAD_ARGS, "parameters"),
         " " + _obj("get_weather", BAD_ARGS, "parameters"),
         "\x1c" + _obj("get_weather", BAD_ARGS, "parameters"),  # Python strips \x1c too
         "<|python_tag|>" + _obj("get_weather", BAD_ARGS, "parameters"),
         _obj("get_date", "{}", "parameters")],
        _obj("get_weather", W_ARGS, "parameters") + "; {"),
}  # fmt: skip


@pytest.mark.parametrize("parser", sorted(STRICT_CASES))
def test_strict_auto_holds_calls_to_their_schemas(smollm_engine, parser):
    """tool_choice "auto" with a strict tool: the grammar (compiled on SmolLM2's vocabulary)
    takes free text and calls in the parser's format whose arguments keep to their tool's
    schema, and the parser reads those calls back; it refuses a call that breaks a schema or
    names no tool, and a second call with parallel_tool_calls false."""
    grammars = smollm_engine.core.grammars
    eos = grammars.stop_token_ids[0]
    takes, refuses, second = STRICT_CASES[parser]

    def complete(matcher, text: str) -> bool:
        return matcher.accept_string(text) and matcher.accept_token(eos) and (
            matcher.is_terminated())

    plan = plan_tools(_strict_tools(), "auto", None, parser)
    assert all("strict" not in t["function"] for t in plan.tools)  # never rendered
    spec = normalise(plan.structured_outputs())
    assert "structural_tag" in spec
    for text, want in takes.items():
        assert complete(grammars.matcher(spec), text), text
        _, calls = plan.output(text)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == want
        assert _streamed(plan, text, [len(text) // 3, len(text) // 2])[1] == want
    for text in refuses:
        assert not complete(grammars.matcher(spec), text), text
    assert grammars.matcher(spec).accept_string(second)  # parallel calls allowed ...
    one = normalise(plan_tools(_strict_tools(), "auto", False, parser).structured_outputs())
    assert not grammars.matcher(one).accept_string(second)  # ... or not
    first = next(t for t, want in takes.items() if len(want) == 1)
    assert complete(grammars.matcher(one), first)


def test_strict_auto_needs_a_strict_tool_and_a_json_format():
    assert plan_tools(_strict_tools(False), "auto", None, "hermes").structured_outputs() is None
    # pythonic calls are not JSON: no grammar, the parser reads what comes
    assert plan_tools(_strict_tools(), "auto", None, "pythonic").structured_outputs() is None
    # under "required" and named choices the grammar is theirs, as without strict
    assert "json" in plan_tools(_strict_tools(), "required", None, "hermes").structured_outputs()


def test_strict_auto_through_the_engine(smollm_engine):
    """SmolLM2, shown one earlier call whose unit ("C") is outside the enum, copies it; under
    the strict tag its call keeps to the schema, and the free text before it stays content."""
    engine = smollm_engine
    earlier = {"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [earlier]},
                {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
    plan = plan_tools(_strict_tools(), "auto", None, "hermes")
    template = engine.tokenizer.chat_template
    prompt = engine.apply_chat_template(messages_for_template(messages, plan, template))
    params = SamplingParams(max_tokens=60, temperature=0,
                            structured_outputs=plan.structured_outputs())  # fmt: skip
    out = engine.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    content, calls = plan.output(out.text)
    assert out.finish_reason == "stop" and len(calls) == 1, out.text
    assert calls[0]["function"]["name"] == "get_weather", out.text
    args = json.loads(calls[0]["function"]["arguments"])
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit"), out.text
    assert plan.finish_reason(out.finish_reason, True) == "tool_calls"
