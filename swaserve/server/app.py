"""The HTTP frontend: OpenAI-compatible routes (docs/serving.md).

A request's path: validate (pydantic, strict) -> SamplingParams -> tokenize (chat template for
chat; on the one tokenizer thread, off the event loop) -> check the context ->
`CoreClient.add` (one core request per sample) -> wait on the request's queue for
`RequestOutput`s -> OpenAI JSON or SSE chunks. The handlers never touch the model; the only
waiting is on asyncio queues fed by the IPC task.

`GET /v1/memory` returns the engine core's latest memory stats (the KV pool, per attention group,
the prefix cache and its tiers) and queue lengths (with `--data-parallel-size` > 1: the totals over
the replicas plus `ranks`, one entry each); `GET /` serves the playground page
(`swaserve/server/static/`, plain files, nothing external) unless `--disable-playground`.

`POST /reset_prefix_cache` (vLLM's name) and `POST|GET /flush_cache` (SGLang's) empty the
prefix cache of every core, device pages and host/disk tiers (`reset_prefix_cache` below says
when it is refused).

Statuses: 400 invalid request (never FastAPI's 422), prompt + max_tokens beyond the context, or
a cache reset while requests run; 401 wrong or missing key (`/v1/*`, the tokenizer routes, the
cache resets); 404 unknown model or path; 503 queue full or core gone.
A client that goes away (stream or not) aborts its requests in the core.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.engine.limits import (
    ContextLimit,
    PromptError,
    check_priority,
    check_prompt,
    check_token_ids,
    check_vocab_ids,
    truncate_prompt,
)
from swaserve.outputs import RequestOutput, merge_deltas
from swaserve.sampling.bad_words import resolve_bad_words
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.structured import check_syntax
from swaserve.server import protocol as P
from swaserve.server.dp_client import DPClient
from swaserve.server.ipc import CoreClient, CoreUnavailable, QueueFull, RequestFailed
from swaserve.server.metrics import CONTENT_TYPE, Metrics
from swaserve.server.metrics_dp import RankedMetrics
from swaserve.server.reasoning import PieceStream, get_reasoning_parser, grammar_markers
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
from swaserve.server.tool_parsers import SPECIAL_MARKERS
from swaserve.server.tools import ToolDeltas, ToolError, ToolPlan, messages_for_template, plan_tools
from swaserve.speculative.metrics import merge_spec

log = logging.getLogger(__name__)
_WIRE_INT_MIN, _WIRE_INT_MAX = -(2**63), 2**64 - 1  # what msgpack and torch seeds accept
_DISCONNECTED = object()
STATIC_DIR = Path(__file__).parent / "static"  # the playground page (docs/serving.md)
_STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
# The page loads nothing from elsewhere; the browser enforces it.
_PLAYGROUND_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


@dataclass
class ServerState:
    client: CoreClient | DPClient  # DPClient: --data-parallel-size > 1
    tokenizer: Any  # None for a model without one: token-id prompts only
    model_name: str
    chat_template: str | None  # --chat-template text; None: the tokenizer's own
    max_model_len: int
    vocab_size: int
    max_n: int
    max_logprobs: int
    api_key: str | None
    metrics: Metrics | RankedMetrics
    created: int
    context_by_kv_pool: bool = False  # max_model_len is what the KV pool holds (error text)
    # --model as given; requests may name it or model_name (--served-model-name).
    model_path: str | None = None
    playground: bool = True  # serve the playground page at / (--disable-playground: off)
    # A PD instance (--disaggregation-mode): its core's mode, bootstrap address and transfer
    # backend, served at /v1/disaggregation for the router; None on a plain instance.
    disaggregation: dict | None = None
    # The tool-call parser of tool_choice "auto" (server/tools.py): --tool-call-parser, or the
    # one the chat template implies; None: "auto" is a 400.
    tool_parser: str | None = None
    # --reasoning-parser (server/reasoning.py): answers split into reasoning_content and content
    reasoning_parser: str | None = None
    # Tokenizing and chat templates run here, not on the event loop: a long prompt would stall
    # every other request's streaming. One thread: requests tokenized in arrival order, and
    # the tokenizer never used from two threads at once.
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="swaserve-tokenize")
    )
    scheduling_policy: str = "fcfs"  # --scheduling-policy: a priority under fcfs is a 400
    # the model's generation_config defaults for fields a request leaves out
    # (sampling/generation_defaults.py: --generation-config)
    sampling_defaults: dict = field(default_factory=dict)
    # /v1/responses stored with store=true (server/responses.py): previous_response_id, GET
    responses: ResponseStore = field(default_factory=ResponseStore)
    cors: CORS | None = None  # None: no CORS headers (browsers then call from this origin only)

    def serves(self, name: str) -> bool:
        """`name` is this server's model: the served name, or --model's value."""
        return name == self.model_name or name == self.model_path

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "swaserve",
            "root": self.model_path or self.model_name,
            "max_model_len": self.max_model_len,
        }

    def check_model(self, name: str | None) -> None:
        """404 unless `name` (when given) is this server's model."""
        if name is not None and not self.serves(name):
            raise self.unknown_model(name)

    def unknown_model(self, name: str) -> APIError:
        return APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{self.model_name}'",
            "model",
            code="model_not_found",
        )


async def _off_loop(state: ServerState, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """`fn(*args, **kw)` on the tokenizer thread; its exceptions (400s included) re-raise here."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.tokenize_pool, functools.partial(fn, *args, **kw))


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: Any = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        return _ErrorResponse(
            P.error_body(self.message, self.type, self.param, self.code), status_code=self.status
        )


class _ErrorResponse(JSONResponse):
    """ASCII JSON: error messages may quote user input, which must never fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# ---- app ------------------------------------------------------------------------------------


# paths the API key guards: the API, the tokenizer's routes, and the cache reset (anyone who
# could call it could slow everyone down)
_KEYED = ("/v1", "/tokenize", "/detokenize", "/reset_prefix_cache", "/flush_cache")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swaserve")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on /v1/*, on /tokenize and /detokenize (work for the
    tokenizer thread) and on the cache resets; health and metrics stay open, as in vLLM."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_KEYED):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                err = APIError(
                    401,
                    "Invalid or missing API key",
                    type_="invalid_request_error",
                    code="invalid_api_key",
                )
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class CORS:
    """Which other origins' pages browsers let call the API (--allowed-origins, ... as vLLM's,
    whose defaults allow any: a key, if set, is still needed)."""

    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool = False

    def add_to(self, app: FastAPI) -> None:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=self.origins,
                           allow_methods=self.methods, allow_headers=self.headers,
                           allow_credentials=self.credentials)  # fmt: skip


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="swaserve", description="OpenAI-compatible LLM server")
    app.state.server = state
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)
    if state.cors is not None:  # added last, so outermost: preflights carry no key
        state.cors.add_to(app)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = P.validation_error(list(exc.errors()))
        return bad(message, param).response()

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RecursionError)
    async def on_too_deep(_: Request, exc: RecursionError) -> JSONResponse:
        # JSON nested past Python's recursion limit (the body's parse, or a field's walk)
        return bad("the request nests JSON too deeply").response()

    @app.exception_handler(Exception)
    async def on_crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    @app.get("/health")
    async def health() -> Response:
        if state.client.dead is not None:
            return APIError(503, f"engine core is not running: {state.client.dead}").response()
        return JSONResponse({"status": "ok"})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # SageMaker's health path, as vLLM serves it
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/memory")
    async def memory() -> Response:
        """The KV pool as the engine core last reported it (after its latest step)."""
        if state.client.dead is not None:
            return APIError(503, f"engine core is not running: {state.client.dead}").response()
        return JSONResponse(memory_view(state.client.stats))

    if state.playground:
        _add_playground(app)

    @app.get("/v1/disaggregation")
    async def disaggregation() -> Response:
        """What `swaserve router` needs of a PD instance (404 on a plain one)."""
        if state.disaggregation is None:
            raise APIError(404, "this server is not a prefill/decode instance")
        if state.client.dead is not None:
            return APIError(503, f"engine core is not running: {state.client.dead}").response()
        return JSONResponse({**state.disaggregation, "model": state.model_name,
                             "max_model_len": state.max_model_len})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return await _reset_prefix_cache(state)

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        return await _reset_prefix_cache(state)

    @app.get("/flush_cache")  # SGLang's route takes GET too (one function each: one OpenAPI id)
    async def flush_cache_get() -> Response:
        return await _reset_prefix_cache(state)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if not state.serves(model_id):
            raise state.unknown_model(model_id)
        return state.model_card()

    @app.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest) -> dict:
        return await _off_loop(state, _tokenize, state, body)

    @app.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest) -> dict:
        return await _off_loop(state, _detokenize, state, body)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, raw: Request) -> Response:
        return await _completions(state, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, raw: Request) -> Response:
        return await _chat(state, body, raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await _responses(state, body, raw)

    add_stored_response_routes(app, state.responses)
    _document_errors(app)
    return app


async def _reset_prefix_cache(state: ServerState) -> Response:
    """Empty every core's prefix cache (EngineCore.reset_prefix_cache: device pages, host and
    disk tiers), e.g. between benchmark runs so the next starts cold: 200 `{"reset": true}`.

    While requests run or wait in a core, that core drops nothing, and the answer is a 400 with
    the OpenAI error body (code `requests_in_flight`). This is SGLang's rule for /flush_cache
    (200 when flushed, 400 when requests run or wait, nothing done). vLLM's core refuses the
    same way (its block pool resets only with no block in use, unless asked with
    `reset_running_requests=true` to preempt the running requests first), but its route answers
    200 whatever the core did ("we currently do not check if the prefix cache is successfully
    reset", an empty body; the route only exists with VLLM_SERVER_DEV_MODE=1): a benchmark would
    then measure a warm cache believing it cold. Saying so is the saner choice; the caller
    retries once its requests are done. (No `reset_running_requests` here: a running request
    would be preempted and recomputed, which a reset meant for a cold start does not need.)
    With `--data-parallel-size` > 1 every replica (or expert-parallel rank) is asked; the
    answer is 200 only if all emptied theirs (on a 400 the idle ones still did). A core that
    is gone: 503."""
    try:
        ok = await state.client.reset_prefix_cache()
    except CoreUnavailable as e:
        raise APIError(503, str(e)) from None
    if not ok:
        raise APIError(
            400,
            "the prefix cache was not reset: requests are running or waiting "
            f"({state.client.num_in_flight} in flight); retry once they are done",
            code="requests_in_flight",
        )
    return JSONResponse({"reset": True})


def memory_view(stats: dict) -> dict:
    """/v1/memory's body: `Engine.memory_stats()` (pages_total, pages_free, per group
    pages_used with kind and window, the prefix cache's counters) plus the queue lengths."""
    mem = dict(stats.get("memory", {}))
    mem["groups"] = [dict(g) for g in mem.get("groups", [])]
    for key in ("num_running", "num_waiting", "num_preemptions", "num_parks"):
        mem[key] = stats.get(key, 0)
    return mem


def _add_playground(app: FastAPI) -> None:
    """`/`: the playground page; `/static/NAME`: its files (a fixed list, read per request)."""
    files = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in _STATIC_TYPES}

    def serve(name: str) -> Response:
        path = files.get(name)
        if path is None:
            raise APIError(404, f"no such file: /static/{name}")
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        if path.suffix == ".html":
            headers["Content-Security-Policy"] = _PLAYGROUND_CSP
        return Response(path.read_bytes(), media_type=_STATIC_TYPES[path.suffix], headers=headers)

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        return serve("playground.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return serve(name)


def _document_errors(app: FastAPI) -> None:
    """The OpenAPI schema lists the statuses we answer with (400, not FastAPI's 422)."""
    base = app.openapi
    errors = {
        "400": "Invalid request",
        "401": "Wrong or missing API key",
        "404": "Unknown model",
        "503": "Queue full or engine core gone",
    }

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = base()
            for path, ops in schema["paths"].items():
                for op in ops.values():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    if path == "/v1/memory":
                        codes = ("401", "503")
                        responses.update({k: {"description": errors[k]} for k in codes})
                    elif path.startswith("/v1/models"):
                        codes = ("401", "404") if "{" in path else ("401",)
                        responses.update({k: {"description": errors[k]} for k in codes})
                    elif path in ("/tokenize", "/detokenize"):
                        codes = ("400", "401", "404")
                        responses.update({k: {"description": errors[k]} for k in codes})
                    elif path in ("/reset_prefix_cache", "/flush_cache"):
                        responses.update({
                            "400": {"description": "Requests running or waiting: not reset"},
                            "401": {"description": errors["401"]},
                            "503": {"description": "Engine core gone"},
                        })
                    elif path.startswith("/v1/"):
                        responses.update({k: {"description": v} for k, v in errors.items()})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# ---- shared request handling ----------------------------------------------------------------


def _params(
    state: ServerState, body: P.CompletionRequest | P.ChatCompletionRequest
) -> SamplingParams:
    if state.client.dead is not None:
        raise APIError(503, f"engine core is not running: {state.client.dead}")
    state.check_model(body.model)
    if body.stream_options is not None and not body.stream:
        raise bad("stream_options is only allowed with stream=true", "stream_options")
    try:
        params = body.sampling_params(state.sampling_defaults)
        params = resolve_bad_words(params, state.tokenizer)
    except ValueError as e:
        raise bad(str(e), P.param_of(str(e))) from None
    if params.n > state.max_n:
        raise bad(f"n={params.n} exceeds this server's cap of {state.max_n} (--max-n)", "n")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if name == "logprobs" and isinstance(body, P.ChatCompletionRequest):
            name = "top_logprobs"  # chat's count of alternatives; its logprobs is a bool
        if k is not None and k > state.max_logprobs:
            raise bad(
                f"{name}={k} exceeds this server's cap of {state.max_logprobs} (--max-logprobs)",
                name,
            )
    for name, value in params.to_dict().items():
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, int) and not _WIRE_INT_MIN <= v <= _WIRE_INT_MAX for v in values):
            raise bad(f"{name} is out of range", name)
    if params.seed is not None and params.seed + params.n - 1 > _WIRE_INT_MAX:
        raise bad("seed + n - 1 must be below 2**64 (sample i uses seed + i)", "seed")
    try:
        check_vocab_ids(params, state.vocab_size)
        check_priority(params, state.scheduling_policy)
    except PromptError as e:
        raise bad(str(e), e.param) from None
    return params


async def _check_grammar(state: ServerState, params: SamplingParams, field: str) -> None:
    """A bad grammar is a 400 here, not a core reject. xgrammar parses it on the tokenizer
    thread: a large schema never stalls the event loop (other streams, /health)."""
    if params.structured_outputs is None:
        return
    try:
        await _off_loop(state, check_syntax, params.structured_outputs)
    except ValueError as e:
        raise bad(f"tools: {e}" if field == "tools" else str(e), field) from None


def _grammar_field(body: P.CompletionRequest | P.ChatCompletionRequest) -> str:
    return "response_format" if body.response_format is not None else "structured_outputs"


def _truncated(
    state: ServerState, text: str | None, ids: list[int], params: SamplingParams
) -> tuple[str | None, list[int]]:
    """(text, ids) as truncate_prompt_tokens keeps the prompt; the text is dropped (decoded
    again from the ids where needed, e.g. for echo) when the ids lost their beginning."""
    kept = truncate_prompt(ids, params, state.max_model_len)
    return (text, ids) if kept is ids else (None, kept)


def _check_prompt(state: ServerState, ids: list[int], params: SamplingParams) -> None:
    """The engine's context rule, checked before anything starts (400 naming the limit)."""
    try:
        check_token_ids(ids, state.vocab_size)
        limit = ContextLimit(state.max_model_len, state.context_by_kv_pool)
        check_prompt(limit, len(ids), params)
    except PromptError as e:
        raise bad(str(e), e.param) from None


def _start(
    state: ServerState,
    rid_base: str,
    prompts: list[tuple[str | None, list[int]]],
    params: SamplingParams,
    stream: bool,
    disagg: dict | None = None,
) -> tuple[asyncio.Queue, list[str]]:
    """Adds one core request group per prompt; all share one queue. `disagg`: the router's
    bootstrap fields on a PD instance (prompt k's bootstrap id gets `.k`)."""
    client = state.client
    total = len(prompts) * params.n
    if total > client.max_in_flight:
        raise bad(
            f"{total} sequences in one request exceed the server's capacity of "
            f"{client.max_in_flight} (--max-num-seqs + --max-queue)"
        )
    if client.num_in_flight + total > client.max_in_flight:
        raise APIError(
            503,
            f"the server is at capacity ({client.max_in_flight} sequences in "
            "flight, --max-num-seqs + --max-queue); retry later",
            code="queue_full",
        )
    queue: asyncio.Queue = asyncio.Queue()
    rids = [rid_base] if len(prompts) == 1 else [f"{rid_base}-p{i}" for i in range(len(prompts))]
    started: list[str] = []
    try:
        for k, (rid, (text, ids)) in enumerate(zip(rids, prompts)):
            extra = {}
            if disagg is not None:
                extra["disagg"] = {**disagg, "bootstrap": f"{disagg['bootstrap']}.{k}"}
            client.add(rid, text, ids, params, queue, stream, **extra)
            started.append(rid)
    except (CoreUnavailable, QueueFull, ValueError) as e:
        for rid in started:
            client.abort(rid)
        raise APIError(400 if isinstance(e, ValueError) else 503, str(e)) from None
    return queue, rids


def _disagg(state: ServerState, raw: Request) -> dict | None:
    """The router's bootstrap headers on a PD instance (swaserve/disaggregation/bootstrap.py);
    None for a request that came without them (served here alone) or on a plain instance."""
    if state.disaggregation is None:
        return None
    from swaserve.disaggregation.bootstrap import BOOTSTRAP_HEADER, PEER_HEADER

    bootstrap = raw.headers.get(BOOTSTRAP_HEADER)
    if not bootstrap:
        return None
    return {"bootstrap": bootstrap, "peer": raw.headers.get(PEER_HEADER)}


async def _watch_disconnect(raw: Request, queue: asyncio.Queue) -> None:
    """Puts a marker on the queue when the client goes away (the body is already read)."""
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            queue.put_nowait((None, _DISCONNECTED))
            return


async def _collect(
    state: ServerState, raw: Request, queue: asyncio.Queue, rids: list[str]
) -> dict[str, RequestOutput]:
    """Waits for every request's final output (non-stream); aborts all if the client leaves."""
    finals: dict[str, RequestOutput] = {}
    watcher = asyncio.get_running_loop().create_task(_watch_disconnect(raw, queue))
    try:
        while len(finals) < len(rids):
            rid, item = await queue.get()
            if item is _DISCONNECTED:
                raise APIError(499, "client disconnected")
            if isinstance(item, RequestFailed):
                raise APIError(item.status, item.message)
            if item.finished:
                finals[rid] = item
        return finals
    finally:
        watcher.cancel()
        for rid in rids:
            state.client.abort(rid)  # no-op for finished ones


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream_response(gen: AsyncIterator[str], state: ServerState, rids: list[str]) -> Response:
    def cleanup() -> None:  # runs even when the client left before the stream started
        for rid in rids:
            state.client.abort(rid)

    return StreamingResponse(
        gen,
        media_type="text/event-stream",
        background=BackgroundTask(cleanup),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(
    state: ServerState, queue: asyncio.Queue, rids: list[str]
) -> AsyncIterator[tuple[str, RequestOutput] | dict]:
    """Yields (request id, delta RequestOutput) until every request finished; an error dict
    (SSE error event) when one fails. Aborts the unfinished ones when closed early.

    A stream that fell behind (its queue holds several deltas when it is resumed) sends what
    waits as one delta per request (`_coalesce`): one SSE chunk and one socket write for
    several tokens, so the frontend's work per token shrinks as its load grows, where one
    chunk per token would fall further behind and deliver them in bursts anyway."""
    done: set[str] = set()
    try:
        while len(done) < len(rids):
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            for rid, item in _coalesce(items):
                if isinstance(item, RequestFailed):
                    yield P.error_body(
                        item.message,
                        "server_error" if item.status >= 500 else "invalid_request_error",
                        code=item.status,
                    )
                    return
                if item.finished:
                    done.add(rid)
                yield rid, item
    finally:
        for rid in rids:
            state.client.abort(rid)


def _coalesce(items: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Queued (request id, delta) items as one merged delta per request, in order of first
    appearance; a failure ends them (what follows it is not sent)."""
    merged: dict[str, RequestOutput] = {}
    for rid, item in items:
        if isinstance(item, RequestFailed):
            yield from merged.items()
            yield rid, item
            return
        prev = merged.get(rid)
        merged[rid] = item if prev is None else merge_deltas(prev, item)
    yield from merged.items()


# ---- /v1/completions ------------------------------------------------------------------------


def _encode(state: ServerState, text: str, add_special_tokens: bool = True) -> list[int]:
    if state.tokenizer is None:
        raise bad(
            f"model {state.model_name} has no tokenizer: send the prompt as token ids", "prompt"
        )
    return list(state.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _decode(state: ServerState, ids: list[int]) -> str:
    return "" if state.tokenizer is None else state.tokenizer.decode(ids)


async def _completions(state: ServerState, body: P.CompletionRequest, raw: Request) -> Response:
    params = _params(state, body)
    await _check_grammar(state, params, _grammar_field(body))
    raw_prompts = body.prompts()
    if not raw_prompts:
        raise bad("the prompt is empty", "prompt")
    prompts: list[tuple[str | None, list[int]]] = []
    for p in raw_prompts:
        if isinstance(p, str):
            if not p:
                raise bad("the prompt is empty", "prompt")
            prompts.append((p, await _off_loop(state, _encode, state, p)))
        else:
            prompts.append((None, list(p)))
    prompts = [_truncated(state, text, ids, params) for text, ids in prompts]
    for _, ids in prompts:
        _check_prompt(state, ids, params)
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    queue, rids = _start(state, rid, prompts, params, bool(body.stream), _disagg(state, raw))
    view = _CompletionView(state, body, params, prompts, rids, rid, created)
    if body.stream:
        return _stream_response(view.stream(_events(state, queue, rids)), state, rids)
    finals = await _collect(state, raw, queue, rids)
    return JSONResponse(view.response(finals))


class _CompletionView:
    """Builds /v1/completions responses and stream chunks for one HTTP request."""

    def __init__(
        self,
        state: ServerState,
        body: P.CompletionRequest,
        params: SamplingParams,
        prompts: list[tuple[str | None, list[int]]],
        rids: list[str],
        rid: str,
        created: int,
    ) -> None:
        self.state, self.body, self.params = state, body, params
        self.prompts, self.rids, self.id, self.created = prompts, rids, rid, created
        self.index = {r: i for i, r in enumerate(rids)}
        self.text = P.TokenText(state.tokenizer)
        self.echo = bool(body.echo)
        self.token_ids = bool(body.return_token_ids)

    def _prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        return text if text is not None else _decode(self.state, ids)

    def _choice(self, i: int, ro: RequestOutput, co: Any, first: bool, offset: int) -> dict:
        text, lps = co.text, None
        if self.params.logprobs is not None:
            lps = P.completion_logprobs(co.logprobs or [], self.text, offset)
        if self.echo and first:
            text = self._prompt_text(i) + text
            if lps is not None:
                plp = P.prompt_completion_logprobs(
                    self.prompts[i][1], ro.prompt_logprobs, self.text
                )
                lps = P.merge_completion_logprobs(plp, lps)
        choice: dict[str, Any] = {
            "index": i * self.params.n + co.index,
            "text": text,
            "logprobs": lps,
            "finish_reason": co.finish_reason,
            "stop_reason": co.stop_reason,
        }
        if self.body.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = P.vllm_prompt_logprobs(
                ro.prompt_logprobs or [None], self.text
            )
        if self.token_ids:
            if first:
                choice["prompt_token_ids"] = self.prompts[i][1]
            choice["token_ids"] = list(co.token_ids)
        return choice

    def _usage(self, completion_tokens: int, cached: int) -> dict:
        return P.usage(sum(len(ids) for _, ids in self.prompts), completion_tokens, cached)

    def response(self, finals: dict[str, RequestOutput]) -> dict:
        choices, completion_tokens, cached = [], 0, 0
        for rid in self.rids:
            ro, i = finals[rid], self.index[rid]
            cached += ro.num_cached_tokens
            for co in ro.outputs:
                choices.append(self._choice(i, ro, co, True, 0))
                completion_tokens += len(co.token_ids)
        choices.sort(key=lambda c: c["index"])
        out = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": self._usage(completion_tokens, cached),
        }
        spec = merge_spec(finals[rid].spec_decoding for rid in self.rids)
        if spec is not None:
            out["spec_decoding"] = spec
        if self.token_ids and len(self.prompts) == 1:
            out["prompt_token_ids"] = self.prompts[0][1]
        return out

    async def stream(self, events: AsyncIterator) -> AsyncIterator[str]:
        seen: set[int] = set()
        offsets: dict[int, int] = {}
        plps: dict[str, Any] = {}
        completion_tokens, cached = 0, {}
        specs: dict[str, dict] = {}
        head = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.state.model_name,
        }
        usage_field = {"usage": None} if self.body.include_usage else {}
        async for ev in events:
            if isinstance(ev, dict):
                yield _sse(ev)
                break
            rid, ro = ev
            if ro.spec_decoding is not None:
                specs[rid] = ro.spec_decoding
            i = self.index[rid]
            if ro.prompt_logprobs is not None:
                plps[rid] = ro.prompt_logprobs
            ro.prompt_logprobs = plps.get(rid)
            cached[rid] = max(cached.get(rid, 0), ro.num_cached_tokens)
            choices = []
            for co in ro.outputs:
                idx = i * self.params.n + co.index
                first = idx not in seen
                seen.add(idx)
                choice = self._choice(i, ro, co, first, offsets.get(idx, 0))
                if choice["logprobs"] is not None and choice["logprobs"]["tokens"]:
                    lp = choice["logprobs"]
                    offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                completion_tokens += len(co.token_ids)
                choices.append(choice)
            if choices:
                if self.body.continuous_usage:
                    usage_field = {"usage": self._usage(completion_tokens, sum(cached.values()))}
                yield _sse({**head, "choices": choices, **usage_field})
        else:
            usage = self._usage(completion_tokens, sum(cached.values()))
            final = _final_chunk(head, self.body.include_usage, usage, specs.values())
            if final is not None:
                yield _sse(final)
        yield "data: [DONE]\n\n"


# ---- /tokenize, /detokenize (vLLM's) ---------------------------------------------------------


def _tokenize(state: ServerState, body: P.TokenizeRequest) -> dict:
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad("give one of prompt and messages", "prompt")
    if body.messages is not None:
        try:  # the tools as an "auto" request renders them ("none" without a parser)
            plan = plan_tools(body.tools, None if state.tool_parser else "none", None,
                              state.tool_parser)  # fmt: skip
        except ToolError as e:
            raise bad(str(e), e.param) from None
        text, add = _render_chat(state, body, plan), bool(body.add_special_tokens)
    else:
        text, add = body.prompt, body.add_special_tokens is not False
    ids = _encode(state, text, add_special_tokens=add)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len,
                           "tokens": ids}  # fmt: skip
    if body.return_token_strs:
        out["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return out


def _detokenize(state: ServerState, body: P.DetokenizeRequest) -> dict:
    state.check_model(body.model)
    if state.tokenizer is None:
        raise bad(f"model {state.model_name} has no tokenizer", "tokens")
    if any(not 0 <= t < state.vocab_size for t in body.tokens):
        raise bad(f"tokens must be in [0, {state.vocab_size})", "tokens")
    return {"prompt": _decode(state, body.tokens)}


# ---- /v1/chat/completions -------------------------------------------------------------------


def _render_chat(
    state: ServerState,
    body: P.ChatCompletionRequest | P.TokenizeRequest,
    plan: ToolPlan | None = None,
) -> str:
    """The prompt text; `plan`: the request's tools (server/tools.py)."""
    tok = state.tokenizer
    if tok is None:
        raise bad(f"model {state.model_name} has no tokenizer, so no chat template")
    template = state.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise bad(
            f"model {state.model_name} has no chat template; start the server with "
            "--chat-template FILE",
            "messages",
        )
    if not body.messages:
        raise bad("messages must not be empty", "messages")
    cont = bool(body.continue_final_message)
    add_gen = not cont if body.add_generation_prompt is None else body.add_generation_prompt
    if cont and add_gen:
        raise bad("continue_final_message and add_generation_prompt cannot both be true: the "
                  "answer either continues the last message or opens a new turn",
                  "continue_final_message")  # fmt: skip
    messages = messages_for_template([m.to_template() for m in body.messages], plan, template)
    extra = dict(body.chat_template_kwargs or {})
    effort = getattr(body, "reasoning_effort", None)  # OpenAI's; gpt-oss's template reads it
    if effort is not None:
        extra.setdefault("reasoning_effort", effort)
    own = set(inspect.signature(tok.apply_chat_template).parameters) | {"messages"}
    clash = sorted(own & set(extra))
    if clash:
        raise bad(f"chat_template_kwargs must not set {clash}: the request's own fields do",
                  "chat_template_kwargs")  # fmt: skip
    try:
        return tok.apply_chat_template(
            messages,
            tools=plan.tools if plan is not None else None,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_gen,
            continue_final_message=cont,
            documents=body.documents,
            **extra,
        )
    except Exception as e:  # template errors depend on the user's messages: a 400
        raise bad(f"the chat template failed on these messages: {e}", "messages") from None


def _chat_prompt(
    state: ServerState, body: P.ChatCompletionRequest, plan: ToolPlan | None
) -> tuple[str, list[int]]:
    prompt = _render_chat(state, body, plan)
    # The template already holds the special tokens: no BOS added again (as Engine.chat).
    return prompt, _encode(state, prompt, add_special_tokens=False)


def _tool_plan(
    state: ServerState, body: P.ChatCompletionRequest, params: SamplingParams
) -> tuple[ToolPlan | None, SamplingParams]:
    """The request's tools (server/tools.py) and the params they change: the grammar of a
    required or named call, or of "auto" calls with strict tools."""
    try:
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.tool_parser)
    except ToolError as e:
        raise bad(str(e), e.param) from None
    if plan is None:
        return None, params
    grammar = plan.structured_outputs()
    if grammar is not None:
        if params.structured_outputs is not None and plan.mode == "auto":
            raise bad(
                "strict tools under tool_choice 'auto' hold the calls to the tools' schemas by "
                "a grammar: give no response_format or structured_outputs with them",
                "tools",
            )
        if params.structured_outputs is not None:
            raise bad(
                "tool_choice 'required' or a named function holds the output to the tools' "
                "schemas: give no response_format or structured_outputs with it",
                "tool_choice",
            )
        try:
            params = replace(params, structured_outputs=grammar)  # normalised there
        except ValueError as e:
            raise bad(f"tools: {e}", "tools") from None
    return plan, params


def _keep_markers(
    state: ServerState, body: P.ChatCompletionRequest, plan: ToolPlan | None, params: SamplingParams
) -> SamplingParams:
    """skip_special_tokens off, unless the request set it, where a parser reads markers that
    are special tokens (the default would erase them): mistral's [TOOL_CALLS] for "auto" calls,
    harmony's (openai_gptoss, and the openai tool-call parser) in every answer."""
    if body.skip_special_tokens is not None:
        return params
    tools = plan is not None and plan.mode == "auto" and plan.parser in SPECIAL_MARKERS
    name = state.reasoning_parser
    reasoning = bool(name) and get_reasoning_parser(name).special_markers
    return replace(params, skip_special_tokens=False) if tools or reasoning else params


async def _chat(state: ServerState, body: P.ChatCompletionRequest, raw: Request) -> Response:
    view, queue, rids = await _chat_begin(state, body, raw)
    if body.stream:
        return _stream_response(view.stream(_events(state, queue, rids)), state, rids)
    finals = await _collect(state, raw, queue, rids)
    return JSONResponse(view.response(finals[view.id]))


async def _chat_begin(
    state: ServerState, body: P.ChatCompletionRequest, raw: Request
) -> tuple[_ChatView, asyncio.Queue, list[str]]:
    """A chat request checked, rendered and started: its view, its queue and request ids."""
    params = _params(state, body)
    asked = params.structured_outputs
    plan, params = _tool_plan(state, body, params)
    # a grammar the tools brought holds their calls: its errors name `tools`
    tools_grammar = params.structured_outputs is not asked
    await _check_grammar(state, params, "tools" if tools_grammar else _grammar_field(body))
    params = _keep_markers(state, body, plan, params)
    prompt, ids = await _off_loop(state, _chat_prompt, state, body, plan)
    if state.reasoning_parser and params.structured_outputs is not None:
        # the grammar holds the content, after the reasoning (server/reasoning.py)
        markers, started = grammar_markers(get_reasoning_parser(state.reasoning_parser),
                                           prompt, state.tokenizer)  # fmt: skip
        params = replace(params, reasoning_markers=markers, reasoning_started=started)
    _, ids = _truncated(state, prompt, ids, params)  # the text stays: it names the markers
    _check_prompt(state, ids, params)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    queue, rids = _start(
        state, rid, [(prompt, ids)], params, bool(body.stream), _disagg(state, raw)
    )
    return _ChatView(state, body, params, ids, rid, created, plan), queue, rids


async def _responses(state: ServerState, body: ResponsesRequest, raw: Request) -> Response:
    """/v1/responses through the chat path (server/responses.py)."""
    try:
        history = state.responses.history(body.previous_response_id)
        fields, conversation = to_chat(body, history)
        chat = P.ChatCompletionRequest.model_validate(fields)
    except ResponsesError as e:
        raise APIError(400, str(e), e.param, code=e.code) from None
    except ValidationError as e:
        message, param = P.validation_error(list(e.errors()))
        raise bad(message, responses_param(param)) from None
    try:
        view, queue, rids = await _chat_begin(state, chat, raw)
    except APIError as e:  # named by the chat field: name the Responses one
        e.param = responses_param(e.param)
        raise
    rid, created = new_id("resp"), int(time.time())

    def start(status: str, output: list, usage: dict | None) -> dict:
        return response_object(body, rid, created, state.model_name, status, output, usage)

    def done(response: dict) -> None:
        if body.store is not False:
            state.responses.put(response, conversation + assistant_turn(response["output"]))

    if body.stream:
        events = ResponseEvents(start, done).stream(view.chunks(_events(state, queue, rids)))
        return _stream_response(events, state, rids)
    finals = await _collect(state, raw, queue, rids)
    response = from_completion(view.response(finals[view.id]), start)
    done(response)
    return JSONResponse(response)


def add_stored_response_routes(app: FastAPI, store: ResponseStore) -> None:
    """`GET` and `DELETE /v1/responses/{id}` on the responses kept in `store`."""

    def missing(response_id: str) -> APIError:
        return APIError(404, f"Response with id {response_id!r} not found.", "response_id")

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        hit = store.get(response_id)
        if hit is None:
            raise missing(response_id)
        return hit[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        if not store.delete(response_id):
            raise missing(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


class _ChatView:
    def __init__(
        self,
        state: ServerState,
        body: P.ChatCompletionRequest,
        params: SamplingParams,
        prompt_ids: list[int],
        rid: str,
        created: int,
        plan: ToolPlan | None = None,
    ) -> None:
        self.state, self.body, self.params = state, body, params
        self.prompt_ids, self.id, self.created = prompt_ids, rid, created
        self.plan = plan  # the request's tools: the output's calls are read by it
        # --reasoning-parser: each answer's reasoning goes to reasoning_content; harmony's
        # function calls go to the content only for the parser that reads them there
        calls = plan is not None and plan.mode == "auto" and plan.parser == "openai"
        self.reasoning = (get_reasoning_parser(state.reasoning_parser, calls)
                          if state.reasoning_parser else None)  # fmt: skip
        self.text = P.TokenText(state.tokenizer)
        self.token_ids = bool(body.return_token_ids)
        # chat echo (vLLM's): the answer's content starts with the last message's when that
        # is the assistant's own turn (the prefill continue_final_message continues)
        last = body.messages[-1]
        self.echo = ""
        if body.echo and last.role == "assistant":
            self.echo = last.to_template()["content"]

    def _lps(self, co: Any) -> dict | None:
        if self.params.logprobs is None:
            return None
        return P.chat_logprobs(co.logprobs or [], self.text)

    def response(self, ro: RequestOutput) -> dict:
        choices = []
        for co in ro.outputs:
            message: dict[str, Any] = {"role": "assistant", "content": co.text}
            reason, text = co.finish_reason, co.text
            if self.reasoning is not None:  # the content is what follows the reasoning
                message["reasoning_content"], message["content"] = self.reasoning.split(text)
                text = message["content"] or ""
            if self.plan is not None:
                message["content"], calls = self.plan.output(text)
                if calls:
                    message["tool_calls"] = calls
                reason = self.plan.finish_reason(reason, bool(calls))
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            c: dict[str, Any] = {
                "index": co.index,
                "message": message,
                "logprobs": self._lps(co),
                "finish_reason": reason,
                "stop_reason": co.stop_reason,
            }
            if self.token_ids:
                c["token_ids"] = list(co.token_ids)
            choices.append(c)
        completion = sum(len(co.token_ids) for co in ro.outputs)
        out = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
            "usage": P.usage(len(self.prompt_ids), completion, ro.num_cached_tokens),
        }
        if ro.spec_decoding is not None:
            out["spec_decoding"] = ro.spec_decoding
        if self.token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        if self.body.prompt_logprobs is not None:
            out["prompt_logprobs"] = P.vllm_prompt_logprobs(ro.prompt_logprobs or [None],
                                                            self.text)  # fmt: skip
        return out

    async def stream(self, events: AsyncIterator) -> AsyncIterator[str]:
        """The chunks as SSE, then [DONE]."""
        async for chunk in self.chunks(events):
            yield _sse(chunk)
        yield "data: [DONE]\n\n"

    async def chunks(self, events: AsyncIterator) -> AsyncIterator[dict]:
        """The stream's chunks; an error body ends it."""
        head = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.state.model_name,
        }
        usage_field = {"usage": None} if self.body.include_usage else {}
        if self.body.continuous_usage:
            usage_field = {"usage": P.usage(len(self.prompt_ids), 0, 0)}
        first = {
            **head,
            "choices": [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for i in range(self.params.n)
            ],
            **usage_field,
        }
        if self.token_ids:
            first["prompt_token_ids"] = self.prompt_ids
        yield first
        if self.echo:
            yield {**head, "choices": [{"index": i, "delta": {"content": self.echo},
                                        "logprobs": None, "finish_reason": None}
                                       for i in range(self.params.n)], **usage_field}  # fmt: skip
        completion_tokens, cached = 0, 0
        spec: list[dict] = []
        tools: dict[int, ToolDeltas] = {}  # per choice, with a ToolPlan
        thinking: dict[int, PieceStream] = {}  # per choice, with a reasoning parser
        async for ev in events:
            if isinstance(ev, dict):
                yield ev
                return
            _, ro = ev
            if ro.spec_decoding is not None:
                spec = [ro.spec_decoding]
            cached = max(cached, ro.num_cached_tokens)
            extra: dict[str, Any] = {}  # top-level fields of this chunk
            if ro.prompt_logprobs is not None and self.body.prompt_logprobs is not None:
                extra["prompt_logprobs"] = P.vllm_prompt_logprobs(ro.prompt_logprobs, self.text)
            choices = []
            for co in ro.outputs:
                completion_tokens += len(co.token_ids)
                delta: dict[str, Any] = {}
                reason, text = co.finish_reason, co.text
                if self.reasoning is not None:
                    rs = thinking.setdefault(co.index, self.reasoning.stream())
                    pieces = rs.feed(text) + (rs.finish() if reason else [])
                    thought = "".join(t for kind, t in pieces if kind == "reasoning")
                    if thought:
                        delta["reasoning_content"] = thought
                    text = "".join(t for kind, t in pieces if kind == "content")
                if self.plan is not None:
                    td = tools.setdefault(co.index, self.plan.stream())
                    delta.update(_merged(td.feed(text) + (td.finish() if reason else [])))
                    reason = self.plan.finish_reason(reason, td.called)
                elif text:
                    delta["content"] = text
                if not (delta or reason or co.logprobs or (self.token_ids and co.token_ids)):
                    continue  # tokens whose text is held back (a stop string may start there)
                c: dict[str, Any] = {
                    "index": co.index,
                    "delta": delta,
                    "logprobs": self._lps(co),
                    "finish_reason": reason,
                }
                if co.finish_reason is not None:
                    c["stop_reason"] = co.stop_reason
                if self.token_ids:
                    c["token_ids"] = list(co.token_ids)
                choices.append(c)
            if choices or extra:
                if self.body.continuous_usage:
                    usage_field = {"usage": P.usage(len(self.prompt_ids), completion_tokens,
                                                    cached)}  # fmt: skip
                yield {**head, "choices": choices, **usage_field, **extra}
        usage = P.usage(len(self.prompt_ids), completion_tokens, cached)
        final = _final_chunk(head, self.body.include_usage, usage, spec)
        if final is not None:
            yield final


def _merged(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """One chunk's delta from a choice's tool deltas: content joined, calls listed."""
    out: dict[str, Any] = {}
    for d in deltas:
        if "content" in d:
            out["content"] = out.get("content", "") + d["content"]
        if "tool_calls" in d:
            out.setdefault("tool_calls", []).extend(d["tool_calls"])
    return out


def _final_chunk(
    head: dict, include_usage: bool, usage: dict, specs: Iterable[dict]
) -> dict | None:
    """The stream's last chunk before [DONE], with no choices: usage when asked for, and the
    speculative decoding counters when speculation is on."""
    chunk: dict[str, Any] = {**head, "choices": []}
    if include_usage:
        chunk["usage"] = usage
    spec = merge_spec(specs)
    if spec is not None:
        chunk["spec_decoding"] = spec
    return chunk if len(chunk) > len(head) + 1 else None
