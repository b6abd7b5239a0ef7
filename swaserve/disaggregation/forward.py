"""One client request through the PD router: validate, pick a pair, make the two calls, answer.

    validate (the instances' own request models: a malformed request is a 400 here)
    pick a (prefill, decode) pair (instance_pool.py: prefix affinity, then load) and give
    it one bootstrap id; the same body to both, with headers:
        prefill  X-Swaserve-Bootstrap, and stream=false: its answer only says "sent"
        decode   X-Swaserve-Bootstrap, X-Swaserve-Prefill (the prefill core's address),
                 sent once the prefill request is on the wire
    the decode instance's answer (or stream) goes to the client unchanged

Retry, and its invariants:
- A call that fails before its request was wholly written (connection refused, a stale
  connection) never reached its instance: the instance is marked down (back-off) and the
  request goes to another pair (a new bootstrap id), `_Unreachable` below. So does a 503
  answer (the instance's queue is full or its engine core is gone: the request does not run
  there). Any other failure is the client's error (503 naming the instance): the instance
  may have started the request.
- The decode call starts only after the prefill request is on the wire, so an unreachable
  prefill instance costs no decode reservation; an unreachable decode instance costs an
  aborted prefill call. Either way no request is ever live on two decode instances.
- Retries happen only before the router answers: nothing has reached the client yet (a stream
  answers once the decode instance sent its headers; an error after that ends the stream with
  an error event). With every pair tried or down, the client gets a 503 (OpenAI error body).

The prefill call ends once the pages were sent. If it fails first (an error status, or the
instance died), the decode call is closed (the decode instance aborts the request and frees
its reservation) and the client gets the prefill side's error; a client that goes away
closes both calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from swaserve.disaggregation.bootstrap import BOOTSTRAP_HEADER, PEER_HEADER
from swaserve.disaggregation.instance_pool import Instance
from swaserve.disaggregation.prompt_keys import num_sequences, prompt_keys
from swaserve.server import protocol as P
from swaserve.server.app import APIError, bad

if TYPE_CHECKING:
    from swaserve.disaggregation.router import Router

log = logging.getLogger("swaserve.router")
WRITTEN = "http11.send_request_body.complete"  # httpcore's trace event: the request is out


class _Unreachable(Exception):
    """Send the request to another pair: a call failed before its request was wholly written
    (`inst` never saw it), or `inst` answered 503 (`_refusal`)."""

    def __init__(self, inst: Instance, error: BaseException) -> None:
        super().__init__(f"{inst.role} instance {inst.url}: {type(error).__name__}: {error}")
        self.inst, self.error = inst, error


class InstanceRefused(Exception):
    """An instance's 503 answer: a full queue, or its engine core gone (`swaserve serve`
    answers 503 for nothing else); nothing of the request runs there any more."""


def _refusal(inst: Instance, err: APIError) -> BaseException:
    """An instance's error for the client, or, for a 503, `_Unreachable`: no answer reached
    the client yet, and the request does not run on that instance, so another pair takes it."""
    if err.status != 503:
        return err
    return _Unreachable(inst, InstanceRefused(f"answered 503: {err.message}"))


def _written_flag() -> tuple[asyncio.Event, Callable[[str, Any], Awaitable[None]]]:
    """An event set once the request was wholly written, and the trace hook that sets it."""
    event = asyncio.Event()

    async def trace(name: str, _info: Any) -> None:
        if name == WRITTEN:
            event.set()

    return event, trace


def validate(path: str, body: Any) -> P.CompletionRequest | P.ChatCompletionRequest:
    """The instances' request models: a malformed request never reaches them."""
    model = (
        P.CompletionRequest
        if path.endswith("/completions") and "chat" not in path
        else P.ChatCompletionRequest
    )
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        message, param = P.validation_error(list(e.errors()))
        raise bad(message, param) from None
    if req.stream_options is not None and not req.stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    try:
        req.sampling_params()
    except ValueError as e:
        raise bad(str(e), P.param_of(str(e))) from None
    return req


def error_of(inst: Instance, r: httpx.Response) -> APIError:
    """An instance's error answer: the request's own (4xx) as it is, a server error (5xx)
    with the instance named."""
    try:
        err = r.json()["error"]
        e = APIError(
            r.status_code, err["message"], err.get("param"), err.get("type"), err.get("code")
        )
    except (ValueError, KeyError, TypeError):
        e = APIError(r.status_code, r.text[:500] or f"status {r.status_code}")
    if r.status_code >= 500:
        e.message = f"{inst.role} instance {inst.url}: {e.message}"
    return e


def _sse_error(e: APIError) -> bytes:
    body = P.error_body(e.message, e.type, e.param, e.code if e.code is not None else e.status)
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def _watch_disconnect(raw: Request) -> None:
    while True:
        if (await raw.receive())["type"] == "http.disconnect":
            return


async def _settle(task: asyncio.Task | None) -> None:
    """Cancel a call (closing its connection: the instance aborts) and wait until it ended."""
    if task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task})


class _Pair:
    """One request's two calls on one (prefill, decode) pair."""

    def __init__(
        self, router: Router, prefill: Instance, decode: Instance, keys: list[tuple], seqs: int
    ) -> None:
        self.router, self.p, self.d, self.seqs = router, prefill, decode, seqs
        bootstrap = uuid.uuid4().hex
        base = router.headers()
        self.p_headers = {**base, BOOTSTRAP_HEADER: bootstrap}
        self.d_headers = {
            **base,
            BOOTSTRAP_HEADER: bootstrap,
            PEER_HEADER: prefill.info["bootstrap"],
        }
        self.p_task: asyncio.Task | None = None
        self.p_written, self._p_trace = _written_flag()
        self.closed = False
        for inst, pool in ((prefill, router.prefill), (decode, router.decode)):
            inst.in_flight += seqs
            pool.record(inst, keys)
        router.requests.labels(prefill=prefill.url, decode=decode.url).inc()

    def start_prefill(self, path: str, body: dict) -> None:
        pbody = {**body, "stream": False}
        pbody.pop("stream_options", None)
        self.p_task = asyncio.get_running_loop().create_task(
            self.router.client.post(
                self.p.url + path,
                json=pbody,
                headers=self.p_headers,
                extensions={"trace": self._p_trace},
            )
        )
        self.p_task.add_done_callback(lambda _: self._prefill_ended())

    def _prefill_ended(self) -> None:
        self.p.in_flight -= self.seqs

    async def prefill_written(self) -> None:
        """Returns once the prefill request is on the wire, or the call ended (its error is
        `prefill_error`'s); raises _Unreachable when it failed before that."""
        assert self.p_task is not None
        written = asyncio.ensure_future(self.p_written.wait())
        try:
            await asyncio.wait({written, self.p_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            written.cancel()
        t = self.p_task
        if not self.p_written.is_set() and t.done() and not t.cancelled():
            exc = t.exception()
            if isinstance(exc, httpx.TransportError):
                raise _Unreachable(self.p, exc)

    def prefill_error(self) -> APIError | None:
        """None while the prefill call runs or if it succeeded; else the client's error."""
        t = self.p_task
        if t is None or not t.done() or t.cancelled():
            return None
        if t.exception() is not None:
            return self.router.down(self.p, t.exception())
        r = t.result()
        if r.status_code != 200:
            if r.status_code != 503:  # a 503 is counted when the instance is marked down
                self.router.failures.labels(instance=self.p.url, role="prefill").inc()
            return error_of(self.p, r)
        self.p.mark_ok()
        return None

    async def close(self) -> None:
        """Both calls over (the prefill one cancelled if it still runs); idempotent."""
        await _settle(self.p_task)
        if not self.closed:
            self.closed = True
            self.d.in_flight -= self.seqs


async def json_body(raw: Request) -> Any:
    try:
        return json.loads(await raw.body())
    except RecursionError:
        raise bad("the request nests JSON too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None


async def forward(router: Router, path: str, raw: Request) -> Response:
    return await forward_body(router, path, await json_body(raw), raw)


async def forward_body(router: Router, path: str, body: Any, raw: Request) -> Response:
    """`body` (a client's request for `path`) through a pair: the decode instance's 200
    answer (a StreamingResponse of its SSE bytes when body streams), else an APIError."""
    req = validate(path, body)
    keys, seqs = prompt_keys(req), num_sequences(req)
    tried: set[Instance] = set()  # instances this request could not reach
    while True:  # each failed round marks one more instance tried: at most all of them
        p = await router.pick(router.prefill, keys, tried)
        d = await router.pick(router.decode, keys, tried)
        pair = _Pair(router, p, d, keys, seqs)
        try:
            resp = await _decode_answer(pair, path, body, raw)
        except _Unreachable as e:  # the pair is closed: nothing of it lives on
            tried.add(e.inst)
            router.down(e.inst, e.error)
            router.retries.labels(instance=e.inst.url, role=e.inst.role).inc()
            log.warning("%s; sending the request to another pair", e)
            continue
        if body.get("stream"):
            return StreamingResponse(
                _relay(pair, resp),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return Response(
                resp.content,
                status_code=resp.status_code,
                media_type=resp.headers.get("content-type", "application/json"),
            )
        finally:
            await pair.close()


async def _decode_answer(pair: _Pair, path: str, body: dict, raw: Request) -> httpx.Response:
    """Starts both calls; returns the decode instance's 200 answer (whole, or its headers for
    a stream). Raises _Unreachable (retry elsewhere), or the client's APIError with the pair
    closed."""
    router, loop = pair.router, asyncio.get_running_loop()
    stream = bool(body.get("stream"))
    pair.start_prefill(path, body)
    try:
        await pair.prefill_written()
        err = pair.prefill_error()  # it may have refused the request already (a 400, a 503)
        if err is not None:
            raise _refusal(pair.p, err)
    except BaseException:
        await pair.close()
        raise
    d_written, d_trace = _written_flag()
    request = router.client.build_request(
        "POST", pair.d.url + path, json=body, headers=pair.d_headers, extensions={"trace": d_trace}
    )
    d_task = loop.create_task(router.client.send(request, stream=stream))
    watcher = loop.create_task(_watch_disconnect(raw))
    resp: httpx.Response | None = None
    try:
        pending = {d_task, pair.p_task, watcher}
        while not d_task.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise APIError(499, "client disconnected")
            err = pair.prefill_error()
            if err is not None:
                raise _refusal(pair.p, err)
        exc = d_task.exception()
        if exc is not None:
            if not d_written.is_set() and isinstance(exc, httpx.TransportError):
                raise _Unreachable(pair.d, exc)
            raise router.down(pair.d, exc)
        resp = d_task.result()
        if resp.status_code != 200:
            await resp.aread()
            if resp.status_code != 503:  # a 503 is counted when the instance is marked down
                router.failures.labels(instance=pair.d.url, role="decode").inc()
            raise _refusal(pair.d, error_of(pair.d, resp))
        pair.d.mark_ok()
        return resp
    except BaseException:
        await _settle(d_task)  # closes the connection: the decode instance aborts
        if resp is not None:
            await resp.aclose()
        await pair.close()
        raise
    finally:
        watcher.cancel()


async def _relay(pair: _Pair, resp: httpx.Response) -> AsyncIterator[bytes]:
    """The decode instance's stream, chunk by chunk; a prefill failure first ends it with an
    error event. Closing it (the client left) closes both calls."""
    loop = asyncio.get_running_loop()
    chunks = resp.aiter_raw().__aiter__()
    nxt: asyncio.Task | None = None
    try:
        while True:
            nxt = loop.create_task(chunks.__anext__())
            waits = {nxt}
            if not pair.p_task.done():
                waits.add(pair.p_task)
            while not nxt.done():
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                err = pair.prefill_error()
                if err is not None:
                    yield _sse_error(err)
                    return
                waits = {nxt}
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                return
            except httpx.HTTPError as e:
                yield _sse_error(pair.router.down(pair.d, e))
                return
            yield chunk
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()
        await resp.aclose()
        await pair.close()
