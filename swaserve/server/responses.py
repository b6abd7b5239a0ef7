"""OpenAI's Responses API (`POST /v1/responses`; `GET` and `DELETE /v1/responses/{id}`), served
through the chat path: a request becomes a chat completion request (`to_chat`), and its answer,
whole or streamed, becomes a Response object or its events. vLLM serves the same endpoint.

- `input`: a string (one user message) or a list of items: messages (roles user, system,
  developer, assistant; text parts `input_text` / `output_text`), `function_call` and
  `function_call_output` items (earlier tool calls and their results). `reasoning` items are
  skipped (earlier reasoning is not fed back, as in chat). Images, files and audio: a 400.
- `instructions`: a system message in front. `max_output_tokens`, `temperature`, `top_p`,
  `top_logprobs` (or `include: ["message.output_text.logprobs"]`), and vLLM's `seed`, `top_k`,
  `min_p`, `repetition_penalty` and `priority`, as in chat.
- `tools`: function tools only (`{"type": "function", "name", "parameters", "strict"}`), with
  `tool_choice` and `parallel_tool_calls`, served as chat's (server/tools.py); calls come back
  as `function_call` output items.
- `text.format`: `text`, `json_object` or `json_schema` (a grammar, as `response_format`).
- `reasoning.effort` reaches the chat template as `reasoning_effort`; with a
  `--reasoning-parser` the reasoning comes back as a `reasoning` item (`reasoning_text`).
- `store` (default true) keeps the response and its conversation in this process (the last
  MAX_STORED_RESPONSES), for `previous_response_id` and `GET /v1/responses/{id}`. The
  previous response's `instructions` are not carried over (OpenAI's rule).
- Not served: `background` true (400), hosted tools (400), `truncation: "auto"` (a prompt past
  the context is a 400, as with `disabled`).

Streaming sends OpenAI's event sequence: `response.created`, `response.in_progress`, then per
output item `response.output_item.added`, its deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`) and their `.done`
events, `response.output_item.done`, and last `response.completed` (or
`response.incomplete` when max_output_tokens cut it, `response.failed` after an `error` event).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from swaserve.server.protocol import _TextRequest

# Responses (and their conversations) one server keeps for previous_response_id, LRU.
MAX_STORED_RESPONSES = 512
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesError(ValueError):
    """A bad Responses request: the message and the field it names (a 400)."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class ResponsesRequest(_TextRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # OpenAI's names; only the logprobs one changes anything here (the others concern hosted
    # tools, images and encrypted reasoning, which this server does not produce)
    include: list[Literal[
        "message.output_text.logprobs", "reasoning.encrypted_content",
        "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
        "message.input_image.image_url", "computer_call_output.output.image_url",
        "code_interpreter_call.outputs"]] | None = None  # fmt: skip
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extensions, as on the chat endpoint
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    priority: int | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request as a chat request -----------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise ResponsesError(f"{where}.content[{j}]: {kind} is not supported: this server's "
                                 "model takes text only", "input")  # fmt: skip
        else:
            raise ResponsesError(f"{where}.content[{j}] must be an input_text or output_text "
                                 f"part, got {kind!r}", "input")  # fmt: skip
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages (ChatMessage's fields); ResponsesError naming the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesError(f"{where}.role must be user, system, developer or "
                                     f"assistant, got {role!r}", "input")  # fmt: skip
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(x, str) for x in (name, args, cid)):
                raise ResponsesError(f"{where}: a function_call needs string call_id, name and "
                                     "arguments", "input")  # fmt: skip
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # one turn: text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str):
                raise ResponsesError(f"{where}: a function_call_output needs a string call_id",
                                     "input")  # fmt: skip
            out.append({"role": "tool", "tool_call_id": cid,
                        "content": _text_of(output, where)})  # fmt: skip
        elif kind == "reasoning":
            continue  # earlier reasoning is not fed back
        else:
            raise ResponsesError(f"{where}: items of type {kind!r} are not supported (message, "
                                 "function_call, function_call_output, reasoning)", "input")
    return out


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise ResponsesError(f"tools[{i}]: only function tools are served, got "
                                 f"{t.get('type')!r}", "tools")  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        unknown = set(t) - {"type", *fn}
        if unknown:
            raise ResponsesError(f"tools[{i}]: unsupported field(s) {sorted(unknown)}", "tools")
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                         "\"name\": ...}", "tool_choice")  # fmt: skip


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ResponsesError(f"text.format must be an object, got {fmt!r}", "text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        missing = [k for k in ("name", "schema") if k not in fmt]
        if missing:
            raise ResponsesError(f"text.format of type json_schema needs {' and '.join(missing)}",
                                 "text")  # fmt: skip
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ResponsesError(f"text.format.type must be text, json_object or json_schema, got "
                         f"{kind!r}", "text")  # fmt: skip


def to_chat(
    body: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the chat completion request's fields, the conversation without the instructions: the
    history and this input, what a later previous_response_id continues)."""
    if body.background:
        raise ResponsesError("background responses are not supported", "background")
    conversation = history + input_messages(body.input)
    messages = list(conversation)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "priority": body.priority,
        "user": body.user,
        "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": _chat_tool_choice(body.tool_choice),
        "response_format": _response_format(body.text),
    }
    if body.tools:
        chat["tools"] = _chat_tools(body.tools)
    if body.top_logprobs is not None or LOGPROBS_INCLUDE in (body.include or ()):
        chat["logprobs"], chat["top_logprobs"] = True, body.top_logprobs or 0
    chat["reasoning_effort"] = (body.reasoning or {}).get("effort")
    if body.stream:
        chat["stream"], chat["stream_options"] = True, {"include_usage": True}
    return {k: v for k, v in chat.items() if v is not None}, conversation


# Chat request fields -> the Responses field a 400 should name.
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "max_tokens": "max_output_tokens",
                     "response_format": "text", "top_logprobs": "top_logprobs",
                     "structured_outputs": "text", "reasoning_effort": "reasoning"}  # fmt: skip


def responses_param(param: str | None) -> str | None:
    return CHAT_TO_RESPONSES.get(param or "", param)


# ---- the answer as a Response ----------------------------------------------------------------


def response_object(
    body: ResponsesRequest, rid: str, created: int, model: str, status: str,
    output: list[dict[str, Any]], usage: dict[str, Any] | None, error: dict | None = None,
) -> dict[str, Any]:
    """A Response object; `usage` is chat's (prompt/completion tokens)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
        "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_logprobs": body.top_logprobs,
        "truncation": body.truncation or "disabled",
        "usage": None if usage is None else responses_usage(usage),
        "user": body.user,
        "metadata": body.metadata or {},
        "background": False,
    }


def responses_usage(u: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _text_part(text: str, logprobs: list[dict]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message_item(parts: list[dict], status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status,
            "content": parts}  # fmt: skip


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn.get("arguments", ""), "status": status}  # fmt: skip


def _logprobs(choice: dict[str, Any]) -> list[dict]:
    """Chat's logprobs content (token, logprob, bytes, top_logprobs): the same entries."""
    lps = choice.get("logprobs") or {}
    return list(lps.get("content") or [])


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's message as output items: its reasoning, its text, its calls."""
    msg = choice["message"]
    items = []
    if msg.get("reasoning_content"):
        items.append(_reasoning_item(msg["reasoning_content"]))
    if msg.get("content") or not msg.get("tool_calls"):
        items.append(_message_item([_text_part(msg.get("content") or "", _logprobs(choice))]))
    items.extend(_call_item(c) for c in msg.get("tool_calls") or [])
    return items


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_completion(completion: dict[str, Any], start: Callable[[str, list, dict | None], dict]
                    ) -> dict[str, Any]:
    """A chat completion (n = 1) as the Response `start(status, output, usage)` builds."""
    choice = completion["choices"][0]
    return start(status_of(choice["finish_reason"]), output_items(choice), completion["usage"])


def assistant_turn(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output as the chat messages a later turn sends back (reasoning left out)."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]  # fmt: skip
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


class ResponseStore:
    """Stored responses and their conversations, the last MAX_STORED_RESPONSES (LRU)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        with self._lock:
            hit = self._items.get(rid)
            if hit is not None:
                self._items.move_to_end(rid)
            return hit

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def history(self, previous_id: str | None) -> list[dict]:
        """The conversation a previous_response_id continues; ResponsesError when unknown."""
        if previous_id is None:
            return []
        hit = self.get(previous_id)
        if hit is None:
            raise ResponsesError(f"Previous response with id {previous_id!r} not found.",
                                 "previous_response_id", "previous_response_not_found")
        return list(hit[1])


# ---- the answer as events ----------------------------------------------------------------------


class ResponseEvents:
    """A chat stream's chunks (dicts; an error dict ends it) as a Response's events (SSE).
    `done(response)` runs with the final Response (to store it) unless the stream failed."""

    def __init__(self, start: Callable[[str, list, dict | None], dict],
                 done: Callable[[dict], None]) -> None:
        self._start, self._done = start, done  # start(status, output, usage) -> Response
        self._seq = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item receiving deltas
        self._calls: dict[int, int] = {}  # chat call index -> output index

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _add(self, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.output.append(item)
        self._open = item
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item=item))  # fmt: skip
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", **self._where(),
                                   part=_text_part("", [])))  # fmt: skip
        return out

    def _where(self, content: bool = True) -> dict[str, Any]:
        """The open item's place (it is always the last output item)."""
        where = {"item_id": self._open["id"], "output_index": len(self.output) - 1}
        return {**where, "content_index": 0} if content else where

    def _close(self) -> list[str]:
        """The open item's .done events; no item is open after."""
        item = self._open
        if item is None:
            return []
        out, kind = [], item["type"]
        if kind == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", **self._where(),
                                   text=part["text"], logprobs=part["logprobs"]))  # fmt: skip
            out.append(self._event("response.content_part.done", **self._where(), part=part))
        elif kind == "reasoning":
            out.append(self._event("response.reasoning_text.done", **self._where(),
                                   text=item["content"][0]["text"]))  # fmt: skip
        else:
            out.append(self._event("response.function_call_arguments.done",
                                   **self._where(content=False), name=item["name"],
                                   arguments=item["arguments"]))  # fmt: skip
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=len(self.output) - 1,
                               item=item))  # fmt: skip
        self._open = None
        return out

    def _reasoning(self, text: str) -> list[str]:
        out = []
        if self._open is None or self._open["type"] != "reasoning":
            item = _reasoning_item("", "in_progress")
            out += self._add(item)
        self._open["content"][0]["text"] += text
        return out + [self._event("response.reasoning_text.delta", **self._where(), delta=text)]

    def _text(self, text: str, logprobs: list[dict]) -> list[str]:
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self._add(_message_item([_text_part("", [])], "in_progress"))
        part = self._open["content"][0]
        part["text"] += text
        part["logprobs"].extend(logprobs)
        return out + [self._event("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=logprobs)]  # fmt: skip

    def _call(self, delta: dict[str, Any]) -> list[str]:
        out = []
        index = delta.get("index", 0)
        if index not in self._calls:
            call = {"id": delta.get("id") or new_id("call"),
                    "function": {"name": delta["function"]["name"], "arguments": ""}}
            out += self._add(_call_item(call, "in_progress"))
            self._calls[index] = len(self.output) - 1
        piece = delta.get("function", {}).get("arguments") or ""
        if piece:
            item = self.output[self._calls[index]]
            item["arguments"] += piece
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=self._calls[index],
                                   delta=piece))  # fmt: skip
        return out

    async def stream(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._start("in_progress", [], None))
        yield self._event("response.in_progress", response=self._start("in_progress", [], None))
        usage, reason = None, None
        async for chunk in chunks:
            if "error" in chunk:
                err = chunk["error"]
                yield self._event("error", code=err.get("code"), message=err.get("message"),
                                  param=err.get("param"))  # fmt: skip
                failed = {"code": "server_error", "message": err.get("message")}
                yield self._event("response.failed",
                                  response=self._start("failed", self.output, None) | {
                                      "error": failed})  # fmt: skip
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                delta = choice.get("delta") or {}
                for piece in self._pieces(delta, choice):
                    yield piece
                reason = choice.get("finish_reason") or reason
        for piece in self._close():
            yield piece
        status = status_of(reason)
        final = self._start(status, self.output, usage)
        self._done(final)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(kind, response=final)

    def _pieces(self, delta: dict[str, Any], choice: dict[str, Any]) -> list[str]:
        out = []
        if delta.get("reasoning_content"):
            out += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            out += self._text(delta["content"], _logprobs(choice))
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        return out

