"""swaserve chat --url's client (chat_repl.ServerChat) against an HTTP exchange written here:
the model comes from /v1/models, the answer's content is streamed back, a reasoning_content
goes to stderr and not into the answer, an error status is a ValueError naming it."""

from __future__ import annotations

import json

import httpx
import pytest

from swaserve.chat_repl import ServerChat


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


def test_server_chat_streams_content_and_shows_reasoning(monkeypatch, capsys):
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m1"}]})
        body = json.loads(request.content)
        seen.append(body)
        if body["messages"][-1]["content"] == "fail":
            return httpx.Response(400, json={"error": {"message": "too long"}})
        return httpx.Response(200, content=_sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"reasoning_content": "think"}}]},
            {"choices": [{"index": 0, "delta": {"content": "Par"}}]},
            {"choices": [{"index": 0, "delta": {"content": "is"}, "finish_reason": "stop"}]},
            {"choices": []}))  # fmt: skip

    real = httpx.Client
    monkeypatch.setattr(httpx, "Client", lambda **kw: real(transport=httpx.MockTransport(handler),
                                                           **kw))  # fmt: skip
    chat = ServerChat("http://x:1", "k", {"max_tokens": 5, "temperature": 0})
    assert chat.model == "m1" and chat.base == "http://x:1/v1"
    assert list(chat([{"role": "user", "content": "hi"}])) == ["Par", "is"]
    assert capsys.readouterr().err == "think"
    assert seen[0] == {"max_tokens": 5, "temperature": 0, "model": "m1", "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    with pytest.raises(ValueError, match="400: too long"):
        list(chat([{"role": "user", "content": "fail"}]))
