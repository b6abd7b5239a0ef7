"""`swaserve chat`: a conversation in the terminal, each answer streamed as it is generated.

Offline it runs an `Engine` (`Engine.chat_stream`); with `--url` it talks to a running
OpenAI-compatible server (swaserve's, or vLLM's: `/v1/models`, then streamed
`/v1/chat/completions`), as `vllm chat --url` does. Each line read is a user turn; the
conversation is kept until `/reset`; `/exit` or end of input leaves; Ctrl-C stops an answer
(offline it aborts the request; through a server it closes the stream, which aborts it there).
Lines piped in work too: one turn each, no prompt printed. A server's `reasoning_content`
(`--reasoning-parser`) is shown on stderr and left out of the conversation sent back.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

# answer(conversation) -> the answer's text pieces; ValueError: this turn cannot be answered
Answer = Callable[[list[dict]], Iterator[str]]


def repl(answer: Answer, title: str, system: str | None) -> None:
    base = [{"role": "system", "content": system}] if system else []
    history = list(base)
    tty = sys.stdin.isatty()
    if tty:
        print(f"swaserve chat with {title}: /reset starts over, /exit or Ctrl-D leaves, "
              "Ctrl-C stops an answer.")  # fmt: skip
    while True:
        try:
            line = input("> " if tty else "").strip()
        except EOFError:
            break
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(base)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        pieces: list[str] = []
        try:
            for piece in answer(history):
                print(piece, end="", flush=True)
                pieces.append(piece)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        except ValueError as e:  # e.g. the conversation outgrew the context
            history.pop()
            print(f"error: {e}; /reset starts over", file=sys.stderr)
            continue
        print()
        history.append({"role": "assistant", "content": "".join(pieces)})


class ServerChat:
    """Answers from an OpenAI-compatible server at `url` (its base, with or without /v1)."""

    def __init__(self, url: str, api_key: str | None, body: dict[str, Any]) -> None:
        import httpx

        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(30.0, read=None))
        self.body = body  # the sampling fields of every request
        try:
            models = self.http.get(self.base + "/models")
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {self.base}: {e}") from None
        if models.status_code != 200:
            raise ValueError(f"{self.base}/models answered {models.status_code}: "
                             f"{_error_text(models)}")  # fmt: skip
        self.model = models.json()["data"][0]["id"]

    def __call__(self, messages: list[dict]) -> Iterator[str]:
        body = {**self.body, "model": self.model, "messages": messages, "stream": True}
        with self.http.stream("POST", self.base + "/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise ValueError(f"the server answered {r.status_code}: {_error_text(r)}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ValueError(chunk["error"].get("message", str(chunk["error"])))
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    thought = delta.get("reasoning_content")
                    if thought:  # a server with --reasoning-parser: shown, not kept
                        _show_reasoning(thought)
                    if delta.get("content"):
                        yield delta["content"]


def _show_reasoning(text: str) -> None:
    """A thinking model's reasoning, on stderr (dim on a terminal): the answers on stdout and
    the conversation sent back hold the content alone."""
    if sys.stderr.isatty():
        text = f"\x1b[2m{text}\x1b[0m"
    sys.stderr.write(text)
    sys.stderr.flush()


def _error_text(r: Any) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:300]
