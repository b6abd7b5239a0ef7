"""`swaserve router --prefill URL... --decode URL...`: the OpenAI-compatible front door of
prefill/decode pairs (DESIGN §9.3).

    router.py          the instances' state (up, down, probes) and the HTTP app
    instance_pool.py   which instance of a role takes a request (prefix affinity, then load)
    prompt_keys.py     the prompt prefix that affinity keys on
    forward.py         one request through a pair: the two calls, retries, the relay
    responses_route.py /v1/responses over the pairs' chat endpoint, stored responses kept here

An instance that cannot be reached is marked down and probed again after a back-off (its
/v1/disaggregation answering brings it back); a request that could not reach an instance goes
to another pair before anything reached the client; with no pair up the client gets a 503
with the OpenAI error body, naming the instances and why. `--api-key` is checked here and
sent on to the instances (they share it). `/reset_prefix_cache` and `/flush_cache` go to every
instance (`reset_everywhere`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from swaserve.disaggregation.forward import forward
from swaserve.disaggregation.instance_pool import Instance, InstancePool
from swaserve.disaggregation.responses_route import respond
from swaserve.server.app import APIError, APIKeyMiddleware, add_stored_response_routes
from swaserve.server.metrics import CONTENT_TYPE
from swaserve.server.responses import ResponseStore

log = logging.getLogger("swaserve.router")
INFO_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0


class Router:
    def __init__(self, prefill: list[str], decode: list[str], api_key: str | None) -> None:
        self.prefill = InstancePool(prefill, "prefill")
        self.decode = InstancePool(decode, "decode")
        self.api_key = api_key
        self.responses = ResponseStore()  # /v1/responses stored here, whichever pair served
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._probes: dict[Instance, asyncio.Task] = {}  # running probes, one per instance
        r = self.registry = CollectorRegistry()
        self.requests = Counter("swaserve:router_requests", "Requests routed",
                                ["prefill", "decode"], registry=r)
        self.failures = Counter("swaserve:router_failures", "Requests failed by an instance",
                                ["instance", "role"], registry=r)
        self.retries = Counter("swaserve:router_retries",
                               "Calls that never reached the instance (then another pair, if any)",
                               ["instance", "role"], registry=r)
        self.up = Gauge("swaserve:router_instance_up", "1 while the instance answers",
                        ["instance", "role"], registry=r)

    @property
    def instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def refresh(self, inst: Instance) -> None:
        """Ask the instance for its PD info: up if it can say, else down (with the reason)."""
        try:
            r = await self.client.get(inst.url + "/v1/disaggregation", headers=self.headers(),
                                      timeout=INFO_TIMEOUT_S)
            if r.status_code != 200:
                raise ValueError(f"/v1/disaggregation answered {r.status_code}: {r.text[:200]}")
            info = r.json()
            if info.get("mode") != inst.role:
                raise ValueError(f"it is a {info.get('mode')!r} instance, not {inst.role}")
            if inst.info is None and inst.failures:
                log.info("%s instance %s is back", inst.role, inst.url)
            inst.mark_up(info)
        except (httpx.HTTPError, ValueError) as e:
            inst.mark_down(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        self.up.labels(instance=inst.url, role=inst.role).set(inst.up)

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(i) for i in self.instances))

    def _probe(self, inst: Instance) -> asyncio.Task:
        """A probe of `inst` (the running one, if any)."""
        task = self._probes.get(inst)
        if task is None:
            task = self._probes[inst] = asyncio.get_running_loop().create_task(self.refresh(inst))
            task.add_done_callback(lambda _: self._probes.pop(inst, None))
        return task

    async def probe_due(self, pool: InstancePool, exclude: Collection[Instance] = ()) -> None:
        """While another instance of the pool can serve, probe (in the background) the down
        ones whose back-off has passed. When none can, probe every down one not in `exclude`
        now, back-off or not, and wait for the answers: the request has no other chance."""
        if any(i.up and i not in exclude for i in pool.instances):
            for inst in pool.due():
                self._probe(inst)
            return
        waits = [self._probe(i) for i in pool.instances if not i.up and i not in exclude]
        if waits:
            await asyncio.wait(waits)  # never cancels the probes if this request is cancelled

    async def pick(self, pool: InstancePool, keys: list[tuple],
                   exclude: Collection[Instance] = ()) -> Instance:
        """The pool's instance for a request with prompt-prefix `keys`, not one of `exclude`;
        503 (OpenAI error body) when none is up."""
        await self.probe_due(pool, exclude)
        inst = pool.choose(keys, exclude)
        if inst is None:
            raise APIError(503, f"no {pool.role} instance is available ({pool.describe(exclude)})",
                           code="instance_unavailable")
        return inst

    def down(self, inst: Instance, error: BaseException) -> APIError:
        """A call to `inst` failed at the transport level: mark it down, the client's 503."""
        inst.mark_down(f"{type(error).__name__}: {error}")
        self.up.labels(instance=inst.url, role=inst.role).set(0)
        self.failures.labels(instance=inst.url, role=inst.role).inc()
        return APIError(503, f"{inst.role} instance {inst.url} is unavailable: {inst.error}",
                        code="instance_unavailable")


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="swaserve router", description="OpenAI-compatible PD front door")
    if router.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=router.api_key)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RecursionError)
    async def on_too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        return APIError(400, "the request nests JSON too deeply").response()

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

    async def from_decode(path: str, body: bytes | None = None) -> Response:
        """A GET (a POST of `body`) answered by a decode instance (another one if the first
        cannot answer)."""
        tried: set[Instance] = set()
        while True:
            inst = await router.pick(router.decode, [], tried)
            try:
                if body is None:
                    r = await router.client.get(inst.url + path, headers=router.headers(),
                                                timeout=INFO_TIMEOUT_S)
                else:
                    r = await router.client.post(
                        inst.url + path, content=body, timeout=INFO_TIMEOUT_S,
                        headers={**router.headers(), "Content-Type": "application/json"})
            except httpx.HTTPError as e:
                router.down(inst, e)
                tried.add(inst)
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return await reset_everywhere(router)

    @app.post("/flush_cache")  # SGLang's name
    async def flush_cache() -> Response:
        return await reset_everywhere(router)

    @app.get("/flush_cache")
    async def flush_cache_get() -> Response:
        return await reset_everywhere(router)

    @app.get("/v1/models")
    async def models() -> Response:
        return await from_decode("/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        return await from_decode(f"/v1/models/{model_id}")

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await from_decode("/tokenize", await raw.body())

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await from_decode("/detokenize", await raw.body())

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await forward(router, "/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await forward(router, "/v1/chat/completions", raw)

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        return await respond(router, router.responses, raw)

    add_stored_response_routes(app, router.responses)

    return app


async def reset_everywhere(router: Router) -> Response:
    """`/reset_prefix_cache` on every instance, prefill and decode, at once (server/app.py's
    route: each empties its own cache unless it has requests): 200 `{"reset": true}` when all
    did; else the OpenAI error body naming each that did not, with 503 if one could not be
    reached or answered 5xx, or else the instances' own status (400: requests running). An
    instance that emptied its cache is forgotten by its pool's prefix affinity."""

    async def one(inst: Instance) -> tuple[int, str]:
        try:
            r = await router.client.post(inst.url + "/reset_prefix_cache",
                                         headers=router.headers(), timeout=INFO_TIMEOUT_S)
        except httpx.HTTPError as e:
            return 503, router.down(inst, e).message
        if r.status_code == 200:
            (router.prefill if inst.role == "prefill" else router.decode).affinity.forget(
                inst.index)
            return 200, ""
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:200]
        return r.status_code, f"{inst.role} instance {inst.url}: {why}"

    answers = await asyncio.gather(*(one(i) for i in router.instances))
    failed = [(status, why) for status, why in answers if status != 200]
    if not failed:
        return JSONResponse({"reset": True})
    status = 503 if any(s >= 500 for s, _ in failed) else failed[0][0]
    raise APIError(status, "the prefix cache was not reset everywhere: "
                   + "; ".join(why for _, why in failed))


def serve_router(prefill: list[str], decode: list[str], host: str, port: int,
                 api_key: str | None, log_level: str = "info") -> int:
    """Runs the router until it is stopped. Instances may start after it: each is asked for
    its PD info at start, and while down again once its back-off has passed (at once when no
    instance of its role is up)."""
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
