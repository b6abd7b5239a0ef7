"""The Responses API through the real server and the official client (server/responses.py):
text, streamed events through the client's own accumulator, a conversation continued by
previous_response_id, function tools, a JSON schema, retrieve and delete, and the 400s."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def test_text_equals_chat(client):
    """A string input answers as the chat endpoint does for one user message (greedy)."""
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                max_output_tokens=16, temperature=0)  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    cut = client.responses.create(model=MODEL, input="Count to fifty.", max_output_tokens=3,
                                  temperature=0)  # fmt: skip
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_stream_through_the_clients_accumulator(client):
    """The client's stream helper accumulates our events into the same answer; an answer cut
    by max_output_tokens ends with response.incomplete, as OpenAI's does."""
    ask = "What is the capital of France? One word."
    with client.responses.stream(model=MODEL, input=ask, max_output_tokens=64,
                                 temperature=0) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    whole = client.responses.create(model=MODEL, input=ask, max_output_tokens=64, temperature=0)
    assert final.status == whole.status == "completed"
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = list(client.responses.create(model=MODEL, input="Count to fifty.", stream=True,
                                          max_output_tokens=4, temperature=0))  # fmt: skip
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_and_retrieve_delete(client, server):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hi.",
                                    instructions="Answer in one short sentence.",
                                    max_output_tokens=16, temperature=0)  # fmt: skip
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=16,
                                     temperature=0)  # fmt: skip
    assert second.previous_response_id == first.id
    # the same conversation sent whole (the instructions are not carried over)
    whole = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada. Say hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert second.output_text == whole.choices[0].message.content
    assert second.usage.input_tokens == whole.usage.prompt_tokens
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert e.value.body["code"] == "previous_response_not_found"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_calls_and_their_outputs(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=[WEATHER], tool_choice="required", max_output_tokens=64,
                                temperature=0)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=24,
        temperature=0, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 21 C"}])  # fmt: skip
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=64, temperature=0) as stream:  # fmt: skip
        args = "".join(e.delta for e in stream
                       if e.type == "response.function_call_arguments.delta")  # fmt: skip
        final = stream.get_final_response()
    call = [o for o in final.output if o.type == "function_call"][0]
    assert call.name == "get_weather" and call.arguments == args and json.loads(args)["city"]


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model=MODEL, input="Capital of Italy, as JSON.", temperature=0, max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["capital"], str)


def test_bad_requests_are_400s_naming_the_field(server):
    def post(body: dict) -> httpx.Response:
        return httpx.post(server.base_url + "/responses", json={"model": MODEL, **body},
                          headers=server.headers(), timeout=30)  # fmt: skip

    cases = [
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input"),
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "priority": 1}, "priority"),  # the session server schedules fcfs
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                            "schema": {"type": "nope"}}}}, "text"),
    ]  # fmt: skip
    for body, param in cases:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
