"""Tool calling through the real server and the official client (server/tools.py): named and
required calls under their grammar, auto calls read by the hermes parser, streamed and not,
earlier calls sent back, and the 400s. The session server runs `--tool-call-parser hermes`
(SmolLM2's template implies no tool format)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object",
                       "properties": {"zone": {"type": "string", "maxLength": 12}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def _args_ok(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(args) == {"zone"}
    return args


def _streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    """Content, calls (arguments joined over deltas by index) and finish_reason of a stream."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
            if tc.id:
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_named_and_required_tool_calls(client):
    """A named call is that function's arguments under its schema, finish_reason "stop"
    (OpenAI's for a forced call); "required" gives one or more calls of the given tools (one
    with parallel_tool_calls false), finish_reason "tool_calls"; a stream gives the same calls
    as the response."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not msg.content
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather"
    assert msg.tool_calls[0].id.startswith("call_") and msg.tool_calls[0].type == "function"
    args = _args_ok("get_weather", msg.tool_calls[0].function.arguments)
    content, calls, reason = _streamed_calls(
        client.chat.completions.create(tool_choice=named, stream=True, **kw))
    assert content == "" and reason == "stop" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == args

    r = client.chat.completions.create(tool_choice="required", **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
    got = [(c.function.name, _args_ok(c.function.name, c.function.arguments))
           for c in ch.message.tool_calls]  # fmt: skip
    assert len({c.id for c in ch.message.tool_calls}) == len(got)  # ids are distinct
    content, calls, reason = _streamed_calls(
        client.chat.completions.create(tool_choice="required", stream=True, **kw))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == got

    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    assert len(r.choices[0].message.tool_calls) == 1


def test_auto_tool_calls_read_by_the_parser(client):
    """tool_choice "auto" (the default with tools): an answer in the hermes format is a call
    (a choice grammar makes the model write one), any other answer is content; streamed, the
    call comes as one delta and no part of its tag leaks into the content."""
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60)
    forced = {"structured_outputs": {"choice": [call]}}
    r = client.chat.completions.create(extra_body=forced, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in ch.message.tool_calls] == [("get_time", {"zone": "CET"})]  # fmt: skip
    content, calls, reason = _streamed_calls(
        client.chat.completions.create(extra_body=forced, stream=True, **kw))
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_time", {"zone": "CET"})]
    plain = {"structured_outputs": {"choice": ["It is sunny."]}}
    r = client.chat.completions.create(extra_body=plain, tool_choice="auto", **kw)
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(tool_choice="none", **kw)  # free text, never a call
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


def test_tools_reach_the_prompt_and_calls_go_back(server):
    """SmolLM2's template reads neither `tools` nor `tool_calls`: the tools go into a system
    message, an earlier call into its assistant turn (in the parser's format), and the tool's
    result is its own turn (/tokenize renders what a chat request would)."""
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]  # fmt: skip
    r = httpx.post(server.url + "/tokenize", headers=h, timeout=30,
                   json={"messages": messages, "tools": [WEATHER]})  # fmt: skip
    assert r.status_code == 200, r.text
    text = httpx.post(server.url + "/detokenize", headers=h, timeout=30,
                      json={"tokens": r.json()["tokens"]}).json()["prompt"]  # fmt: skip
    assert '"name": "get_weather"' in text and "The weather in a city" in text  # the tool
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text  # the call
    assert "<|im_start|>tool\n18 degrees" in text  # the result
    body = {"model": MODEL, "messages": messages, "tools": [WEATHER], "max_tokens": 8}
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json=body, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {  # xgrammar refuses
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, "tools"),
])  # fmt: skip
def test_bad_tool_requests_are_400s(server, body, param):
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    req = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **body}
    req = {k: v for k, v in req.items() if v is not None}
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json=req, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_strict_tools_under_auto(client):
    """A strict tool under tool_choice "auto": the model may write text, and the call it opens
    keeps to the schema. SmolLM2, shown an earlier call with "unit": "C" (outside the enum),
    copies it unless held; held, its call has a unit of the enum, streamed or not. With a
    response_format too it is a 400 naming the tools."""
    earlier = {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [earlier]},
                {"role": "user", "content": "Weather in Paris?"}]  # fmt: skip
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    kw = dict(model=MODEL, messages=messages, tools=[strict, TIME], temperature=0,
              max_tokens=60)  # fmt: skip
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls or []) == 1, ch
    call = ch.message.tool_calls[0].function
    assert call.name == "get_weather"
    args = _args_ok("get_weather", call.arguments)
    content, calls, reason = _streamed_calls(client.chat.completions.create(stream=True, **kw))
    assert reason == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", args)]
    assert content.strip() == (ch.message.content or "")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(response_format={"type": "json_object"}, **kw)
    assert e.value.body["param"] == "tools" and "strict" in e.value.body["message"]
