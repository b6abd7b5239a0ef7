"""The Responses API's translation (server/responses.py): requests as chat requests, chat
answers as Response objects, and a chat stream's chunks as the Response event sequence the
official client's stream accumulator accepts."""

from __future__ import annotations

import asyncio
import json

import pytest

from swaserve.server import protocol as P
from swaserve.server.responses import (
    MAX_STORED_RESPONSES,
    ResponseEvents,
    ResponsesError,
    ResponsesRequest,
    ResponseStore,
    assistant_turn,
    input_messages,
    output_items,
    response_object,
    to_chat,
)

WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather"}, {"type": "input_text",
                                                                "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]  # fmt: skip
    msgs = input_messages(items)
    assert [m["role"] for m in msgs] == ["developer", "user", "assistant", "tool"]
    assert msgs[1]["content"] == "Weather\nin Paris?"
    assert msgs[2]["content"] == "Let me look." and [c["id"] for c in msgs[2]["tool_calls"]] \
        == ["c1", "c2"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    for m in msgs:  # every message is one the chat endpoint takes
        P.ChatMessage.model_validate(m)
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("items, words", [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "text only"),
    ([{"role": "tool", "content": "x"}], "role"),
    ([{"type": "web_search_call", "id": "w"}], "not supported"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "arguments"),
    ([{"role": "user", "content": 5}], "string or a list"),
])  # fmt: skip
def test_bad_input_items_name_the_item(items, words):
    with pytest.raises(ResponsesError, match=words) as e:
        input_messages(items)
    assert "input[0]" in str(e.value) and e.value.param == "input"


def test_the_request_as_a_chat_request():
    body = ResponsesRequest(
        model="m", input="Weather in Paris?", instructions="Use tools.", max_output_tokens=32,
        temperature=0.0, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        include=["message.output_text.logprobs"], reasoning={"effort": "low"}, stream=True,
    )
    chat, conversation = to_chat(body, [{"role": "user", "content": "before"}])
    assert chat["messages"][0] == {"role": "system", "content": "Use tools."}
    assert conversation == chat["messages"][1:]  # instructions are not carried over
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "strict": True, "parameters": WEATHER["parameters"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"]["json_schema"]["name"] == "w"
    assert chat["logprobs"] is True and chat["top_logprobs"] == 0
    assert chat["reasoning_effort"] == "low"
    assert chat["stream_options"] == {"include_usage": True}
    P.ChatCompletionRequest.model_validate(chat)  # the chat endpoint's own validation
    for bad, param in [({"background": True}, "background"),
                       ({"tools": [{"type": "web_search_preview"}]}, "tools"),
                       ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
                       ({"text": {"format": {"type": "grammar"}}}, "text")]:  # fmt: skip
        with pytest.raises(ResponsesError) as e:
            to_chat(ResponsesRequest(input="x", **bad), [])
        assert e.value.param == param


def test_unknown_fields_are_refused():
    with pytest.raises(ValueError, match="frobnicate"):
        ResponsesRequest(input="x", frobnicate=1)
    with pytest.raises(ValueError, match="include"):
        ResponsesRequest(input="x", include=["bogus"])
    ResponsesRequest(input="x", include=["reasoning.encrypted_content"])  # known, no effect


@pytest.mark.parametrize("fmt,words", [("x", "must be an object"), (5, "must be an object"),
                                       ({"type": "json_schema"}, "needs name and schema"),
                                       ({"type": "json_schema", "name": "n"}, "needs schema")])
def test_bad_text_formats_name_text(fmt, words):
    with pytest.raises(ResponsesError, match=words) as e:
        to_chat(ResponsesRequest(input="x", text={"format": fmt}), [])
    assert e.value.param == "text"


def _chat_choice(content, calls=None, reasoning=None, reason="stop"):
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return {"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}


def test_output_items_and_the_turn_sent_back():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    items = output_items(_chat_choice("Checking.", [call], reasoning="hmm"))
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"][0] == {"type": "reasoning_text", "text": "hmm"}
    assert items[1]["content"][0]["text"] == "Checking."
    assert items[2]["call_id"] == "call_1" and items[2]["arguments"] == '{"city": "Paris"}'
    turn = assistant_turn(items)
    assert turn == [{"role": "assistant", "content": "Checking.", "tool_calls": [call]}]
    assert [i["type"] for i in output_items(_chat_choice(None, [call]))] == ["function_call"]
    assert output_items(_chat_choice(""))[0]["type"] == "message"  # an empty answer: one message


def test_store_is_a_bounded_lru():
    store = ResponseStore(capacity=3)
    for i in range(4):
        store.put({"id": f"r{i}"}, [{"role": "user", "content": str(i)}])
    assert store.get("r0") is None and store.get("r1") is not None
    store.put({"id": "r4"}, [])  # r1 was used last: r2 goes
    assert store.get("r2") is None and store.get("r1") is not None
    assert store.history("r1") == [{"role": "user", "content": "1"}]
    with pytest.raises(ResponsesError) as e:
        store.history("r2")
    assert e.value.code == "previous_response_not_found"
    assert store.delete("r1") and not store.delete("r1")
    assert MAX_STORED_RESPONSES >= 100


def _events(chunks: list[dict]) -> tuple[list[dict], list[dict]]:
    body = ResponsesRequest(input="x")
    finals = []
    ev = ResponseEvents(lambda st, out, u: response_object(body, "resp_1", 0, "m", st, out, u),
                        finals.append)  # fmt: skip

    async def gen():
        for c in chunks:
            yield c

    async def run():
        return [s async for s in ev.stream(gen())]

    out = []
    for sse in asyncio.run(run()):
        head, data = sse.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out, finals


def _chunk(delta, reason=None, usage=None):
    c = {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
    if usage is not None:
        c = {"choices": [], "usage": usage}
    return c


USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
         "prompt_tokens_details": {"cached_tokens": 0}}


def test_stream_events_in_order():
    call = {"index": 0, "id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city"'}}
    more = {"index": 0, "function": {"arguments": ': "Paris"}'}}
    events, finals = _events([
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "Let me "}), _chunk({"reasoning_content": "think."}),
        _chunk({"content": "It is "}), _chunk({"content": "sunny."}),
        _chunk({"tool_calls": [call]}), _chunk({"tool_calls": [more]}, reason="tool_calls"),
        _chunk({}, usage=USAGE),
    ])  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert finals == [final] and final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "It is sunny."
    assert final["output"][2]["arguments"] == '{"city": "Paris"}'
    assert final["usage"]["input_tokens"] == 5 and final["usage"]["total_tokens"] == 9
    assert all(i["status"] == "completed" for i in final["output"])
    indices = {e["output_index"] for e in events if "output_index" in e}
    assert indices == {0, 1, 2}


def test_stream_cut_by_length_and_failed():
    events, finals = _events([_chunk({"content": "ab"}, reason="length"), _chunk({}, usage=USAGE)])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    events, finals = _events([_chunk({"content": "ab"}),
                              P.error_body("the core died", "server_error", code=500)])
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and finals == []
