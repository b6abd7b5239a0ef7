"""`swaserve router --prefill URL... --decode URL...`: the OpenAI-compatible front door of
prefill/decode pairs (DESIGN §9.3).

Per request (completions or chat, streaming or not, any n):

    validate (the instances' own request models: a malformed request is a 400 here)
    pick the least loaded prefill and decode instances (requests in flight through this
    router; ties: the one given fewer so far) whose /v1/disaggregation answered
    one bootstrap id; the same body to both, with headers:
        decode   X-Swaserve-Bootstrap, X-Swaserve-Prefill (the prefill core's address)
        prefill  X-Swaserve-Bootstrap, and stream=false: its answer only says "sent"
    the decode instance's answer (or stream) goes to the client unchanged

The prefill call ends once the pages were sent. If it fails first (an error status, or the
instance is unreachable), the decode call is closed (the decode instance aborts the request
and frees its reservation) and the client gets the prefill side's error; a client that goes
away closes both calls. An instance that is down gives a 503 with the OpenAI error body,
naming it. `--api-key` is checked here and sent on to the instances (they share it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import ValidationError

from swaserve.disaggregation.bootstrap import BOOTSTRAP_HEADER, PEER_HEADER
from swaserve.server import protocol as P
from swaserve.server.app import APIError, APIKeyMiddleware, bad
from swaserve.server.metrics import CONTENT_TYPE

log = logging.getLogger("swaserve.router")
INFO_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0


@dataclass
class Instance:
    url: str
    role: str  # prefill | decode
    info: dict | None = None  # its /v1/disaggregation answer; None while down or unknown
    in_flight: int = 0
    routed: int = 0
    error: str | None = None  # why it is down


def choose(instances: list[Instance]) -> Instance | None:
    """The least loaded instance that is up; ties go to the one routed fewer requests."""
    up = [i for i in instances if i.info is not None]
    if not up:
        return None
    return min(up, key=lambda i: (i.in_flight, i.routed))


class Router:
    def __init__(self, prefill: list[str], decode: list[str], api_key: str | None) -> None:
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self.api_key = api_key
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        r = self.registry = CollectorRegistry()
        self.requests = Counter("swaserve:router_requests", "Requests routed",
                                ["prefill", "decode"], registry=r)
        self.failures = Counter("swaserve:router_failures", "Requests failed by an instance",
                                ["instance", "role"], registry=r)
        self.up = Gauge("swaserve:router_instance_up", "1 while the instance answers",
                        ["instance", "role"], registry=r)

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def refresh(self, inst: Instance) -> None:
        """Ask the instance for its PD info; mark it down (with the reason) if it cannot say."""
        try:
            r = await self.client.get(inst.url + "/v1/disaggregation", headers=self.headers(),
                                      timeout=INFO_TIMEOUT_S)
            if r.status_code != 200:
                raise ValueError(f"/v1/disaggregation answered {r.status_code}: {r.text[:200]}")
            info = r.json()
            if info.get("mode") != inst.role:
                raise ValueError(f"it is a {info.get('mode')!r} instance, not {inst.role}")
            inst.info, inst.error = info, None
        except (httpx.HTTPError, ValueError) as e:
            inst.info, inst.error = None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        self.up.labels(instance=inst.url, role=inst.role).set(inst.info is not None)

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(i) for i in self.instances))

    async def pick(self, pool: list[Instance]) -> Instance:
        inst = choose(pool)
        if inst is None:  # all down: maybe one is back
            await asyncio.gather(*(self.refresh(i) for i in pool))
            inst = choose(pool)
        if inst is None:
            why = "; ".join(f"{i.url}: {i.error}" for i in pool)
            raise APIError(503, f"no {pool[0].role} instance is available ({why})",
                           code="instance_unavailable")
        return inst

    def down(self, inst: Instance, error: Exception) -> APIError:
        """A call to `inst` failed at the transport level: mark it down, the client's 503."""
        inst.info, inst.error = None, f"{type(error).__name__}: {error}"
        self.up.labels(instance=inst.url, role=inst.role).set(0)
        self.failures.labels(instance=inst.url, role=inst.role).inc()
        return APIError(503, f"{inst.role} instance {inst.url} is unavailable: {inst.error}",
                        code="instance_unavailable")


def _validate(path: str, body: Any) -> None:
    """The instances' request models: a malformed request never reaches them."""
    model = P.CompletionRequest if path.endswith("/completions") and "chat" not in path \
        else P.ChatCompletionRequest
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


def _error_of(inst: Instance, r: httpx.Response) -> APIError:
    """An instance's error answer: the request's own (4xx) as it is, a server error (5xx)
    with the instance named."""
    try:
        err = r.json()["error"]
        e = APIError(r.status_code, err["message"], err.get("param"), err.get("type"),
                     err.get("code"))
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


class _Pair:
    """One request's two calls."""

    def __init__(self, router: Router, prefill: Instance, decode: Instance) -> None:
        self.router, self.p, self.d = router, prefill, decode
        bootstrap = uuid.uuid4().hex
        base = router.headers()
        self.p_headers = {**base, BOOTSTRAP_HEADER: bootstrap}
        self.d_headers = {**base, BOOTSTRAP_HEADER: bootstrap,
                          PEER_HEADER: prefill.info["bootstrap"]}
        self.p_task: asyncio.Task | None = None
        prefill.in_flight += 1
        decode.in_flight += 1
        prefill.routed += 1
        decode.routed += 1
        router.requests.labels(prefill=prefill.url, decode=decode.url).inc()

    def start_prefill(self, path: str, body: dict) -> None:
        pbody = {**body, "stream": False}
        pbody.pop("stream_options", None)
        self.p_task = asyncio.get_running_loop().create_task(
            self.router.client.post(self.p.url + path, json=pbody, headers=self.p_headers)
        )
        self.p_task.add_done_callback(lambda _: self._done(self.p))

    def prefill_error(self) -> APIError | None:
        """None while the prefill call runs or if it succeeded; else the client's error."""
        t = self.p_task
        if t is None or not t.done() or t.cancelled():
            return None
        if t.exception() is not None:
            return self.router.down(self.p, t.exception())
        r = t.result()
        if r.status_code != 200:
            self.router.failures.labels(instance=self.p.url, role="prefill").inc()
            return _error_of(self.p, r)
        return None

    def _done(self, inst: Instance) -> None:
        inst.in_flight -= 1

    def decode_done(self) -> None:
        self._done(self.d)

    def cancel_prefill(self) -> None:
        if self.p_task is not None and not self.p_task.done():
            self.p_task.cancel()  # closes the connection: the prefill instance aborts


async def _forward(router: Router, path: str, raw: Request) -> Response:
    try:
        body = json.loads(await raw.body())
    except (ValueError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None
    _validate(path, body)
    pair = _Pair(router, await router.pick(router.prefill), await router.pick(router.decode))
    pair.start_prefill(path, body)
    if body.get("stream"):
        return await _stream(pair, path, body, raw)
    return await _whole(pair, path, body, raw)


async def _whole(pair: _Pair, path: str, body: dict, raw: Request) -> Response:
    router, loop = pair.router, asyncio.get_running_loop()
    d_task = loop.create_task(
        router.client.post(pair.d.url + path, json=body, headers=pair.d_headers)
    )
    watcher = loop.create_task(_watch_disconnect(raw))
    try:
        pending = {d_task, pair.p_task, watcher}
        while not d_task.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                raise APIError(499, "client disconnected")
            err = pair.prefill_error()
            if err is not None:
                raise err
        if d_task.exception() is not None:
            raise router.down(pair.d, d_task.exception())
        r = d_task.result()
        if r.status_code != 200:
            router.failures.labels(instance=pair.d.url, role="decode").inc()
            raise _error_of(pair.d, r)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"))
    finally:
        watcher.cancel()
        if not d_task.done():
            d_task.cancel()  # closes the connection: the decode instance aborts
        pair.cancel_prefill()
        pair.decode_done()


async def _stream(pair: _Pair, path: str, body: dict, raw: Request) -> Response:
    router, loop = pair.router, asyncio.get_running_loop()
    request = router.client.build_request("POST", pair.d.url + path, json=body,
                                          headers=pair.d_headers)
    d_task = loop.create_task(router.client.send(request, stream=True))
    resp: httpx.Response | None = None
    try:
        pending = {d_task, pair.p_task}
        while not d_task.done():
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            err = pair.prefill_error()
            if err is not None:
                raise err
        if d_task.exception() is not None:
            raise router.down(pair.d, d_task.exception())
        resp = d_task.result()
        if resp.status_code != 200:
            await resp.aread()
            router.failures.labels(instance=pair.d.url, role="decode").inc()
            raise _error_of(pair.d, resp)
    except BaseException:
        if not d_task.done():
            d_task.cancel()
        if resp is not None:
            await resp.aclose()
        pair.cancel_prefill()
        pair.decode_done()
        raise
    return StreamingResponse(
        _relay(pair, resp), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


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
        pair.cancel_prefill()
        pair.decode_done()


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="swaserve router", description="OpenAI-compatible PD front door")
    if router.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=router.api_key)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def on_crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    @app.get("/health")
    async def health() -> Response:
        await router.refresh_all()
        down = [f"{i.role} {i.url}: {i.error}" for i in router.instances if i.info is None]
        if down:
            return APIError(503, "instances down: " + "; ".join(down)).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE)

    async def from_decode(path: str) -> Response:
        inst = await router.pick(router.decode)
        try:
            r = await router.client.get(inst.url + path, headers=router.headers(),
                                        timeout=INFO_TIMEOUT_S)
        except httpx.HTTPError as e:
            raise router.down(inst, e) from None
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    @app.get("/v1/models")
    async def models() -> Response:
        return await from_decode("/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await from_decode(f"/v1/models/{model_id}")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _forward(router, "/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await _forward(router, "/v1/chat/completions", raw)

    return app


def serve_router(prefill: list[str], decode: list[str], host: str, port: int,
                 api_key: str | None, log_level: str = "info") -> int:
    """Runs the router until it is stopped. Instances may start after it: each is asked for
    its PD info at start and again whenever it is needed and unknown."""
    import uvicorn

    from swaserve.server.launch import bind_socket

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded call
    if not prefill or not decode:
        raise ValueError("give at least one --prefill URL and one --decode URL")
    sock = bind_socket(host, port)
    router = Router(prefill, decode, api_key)

    async def main() -> None:
        await router.refresh_all()
        for i in router.instances:
            state = "up" if i.info is not None else f"down ({i.error})"
            log.info("%s instance %s: %s", i.role, i.url, state)
        server = uvicorn.Server(uvicorn.Config(build_router_app(router), host=host, port=port,
                                               log_level=log_level,
                                               timeout_graceful_shutdown=2))
        t0 = time.monotonic()
        try:
            await server.serve(sockets=[sock])
        finally:
            await router.client.aclose()
        log.info("router stopped after %.0f s", time.monotonic() - t0)

    try:
        asyncio.run(main())
    finally:
        sock.close()
    return 0
