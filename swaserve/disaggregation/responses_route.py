"""`/v1/responses` at the PD router: OpenAI's Responses API served over the pairs' chat
endpoint, with the stored responses kept here (server/responses.py does the translation).

A request becomes a chat completion request (`to_chat`) that goes through a pair as any chat
request does (forward.py: validation, pair choice, retries); the decode instance's answer,
whole or streamed, becomes a Response or its events. The router keeps what `store` asks for
(the last MAX_STORED_RESPONSES), so `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}` work whichever pair served the earlier turns. Router restarts forget them,
as an instance's restart does.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from swaserve.disaggregation.forward import forward_body, json_body
from swaserve.server import protocol as P
from swaserve.server.app import APIError, bad
from swaserve.server.responses import (
    ResponseEvents,
    ResponsesError,
    ResponsesRequest,
    ResponseStore,
    assistant_turn,
    from_completion,
    new_id,
    response_object,
    responses_param,
    to_chat,
)

if TYPE_CHECKING:
    from swaserve.disaggregation.router import Router

CHAT_PATH = "/v1/chat/completions"


async def sse_chunks(raw: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The JSON objects of an SSE byte stream (split anywhere), up to `data: [DONE]`."""
    buf = b""
    async for piece in raw:
        buf += piece
        while True:
            cut = buf.find(b"\n\n")
            if cut < 0:
                break
            event, buf = buf[:cut], buf[cut + 2:]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)


async def respond(router: Router, store: ResponseStore, raw: Request) -> Response:
    """POST /v1/responses through a pair."""
    try:
        body = ResponsesRequest.model_validate(await json_body(raw))
    except ValidationError as e:
        message, param = P.validation_error(list(e.errors()))
        raise bad(message, responses_param(param)) from None
    try:
        fields, conversation = to_chat(body, store.history(body.previous_response_id))
    except ResponsesError as e:
        raise APIError(400, str(e), e.param, code=e.code) from None
    try:
        answer = await forward_body(router, CHAT_PATH, fields, raw)
    except APIError as e:  # named by the chat field: name the Responses one
        e.param = responses_param(e.param)
        raise
    rid, created = new_id("resp"), int(time.time())

    def start(model: str) -> Any:
        return lambda status, output, usage: response_object(
            body, rid, created, model, status, output, usage)

    def done(response: dict) -> None:
        if body.store is not False:
            store.put(response, conversation + assistant_turn(response["output"]))

    if not isinstance(answer, StreamingResponse):
        completion = json.loads(answer.body)
        response = from_completion(completion, start(completion["model"]))
        done(response)
        return JSONResponse(response)

    relay = answer.body_iterator

    async def events() -> AsyncIterator[str]:
        chunks = sse_chunks(relay)
        try:
            first = await anext(chunks, None)  # names the model before response.created
            model = (first or {}).get("model") or body.model or ""

            async def every() -> AsyncIterator[dict]:
                if first is not None:
                    yield first
                async for chunk in chunks:
                    yield chunk

            async for event in ResponseEvents(start(model), done).stream(every()):
                yield event
        finally:  # the client left or the stream ended: both calls of the pair close
            await chunks.aclose()
            await relay.aclose()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
