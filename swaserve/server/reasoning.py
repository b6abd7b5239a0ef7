"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's answer split into
its reasoning, returned as `reasoning_content`, and its content.

- `qwen3` (Qwen3, QwQ): the answer is reasoning when it opens with `<think>` (after
  whitespace), up to `</think>`; the rest is content. An answer that does not open with
  `<think>` (thinking off: `chat_template_kwargs: {"enable_thinking": false}`, whose prompt
  already holds an empty think block) is all content.
- `deepseek_r1` (DeepSeek-R1 and its distills, whose chat template opens `<think>` in the
  prompt): the answer is reasoning from its start (a leading `<think>` dropped) up to
  `</think>`, the rest content; with no `</think>` (cut by max_tokens) all of it is reasoning.
- `openai_gptoss` (gpt-oss; the server's default when the chat template is harmony's): the
  answer is harmony messages (server/harmony.py). An `analysis` message is reasoning (several
  joined by "\\n"); a `final` message, a `commentary` one with no recipient (a preamble to
  calls) and one with no channel are content (their text, no markers; several joined by
  "\\n"). A message to a function (`to=functions.NAME`) is a call: with `calls` (a request
  whose tool_choice "auto" the `openai` tool-call parser reads) it goes to the content whole,
  in the canonical form `<|start|>assistant to=functions.NAME<|channel|>commentary
  <|constrain|>json<|message|>ARGS<|call|>` (harmony.call_head; one line), for that parser
  to read; otherwise (no tools, tool_choice "none") its arguments are reasoning, so no marker
  reaches the content. A message to a built-in tool (`browser.search`, `python`, any
  recipient outside `functions.`) is reasoning: the model calls those in its chain of thought
  and Chat Completions has no way to return them. A header cut by max_tokens is dropped; a
  call cut in its arguments still goes out, closed by `<|call|>`. Output that opens with no
  header (under a grammar from its first token, or with the markers skipped) is content. The
  markers are special tokens: such requests keep them (skip_special_tokens=False unless they
  set it).

Structured outputs (`response_format`, a required or named tool call) hold the content only
(`grammar_markers`, sampling/reasoning_gate.py): the grammar starts after `</think>`, as vLLM's
does with a reasoning parser. (Not with `openai_gptoss`, whose reasoning ends at no single
token: its grammar holds the output from the first token, which is then content.)

Content after `</think>` loses its leading newlines (the templates put "\\n\\n" there). Reasoning
unfinished when generation stops is reasoning. A tool-call parser (server/tools.py) then reads
the content only.

Streaming (`stream()`): `feed(delta)` returns ("reasoning" | "content", text) pieces that are
certain, in order, and `finish()` the rest; text that may be the start of a tag is held back
until it is known. For every split of an answer into deltas, the pieces joined per kind equal
`split()` (None as "").
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from swaserve.server.harmony import CALL, HarmonyStream, Header, call_head
from swaserve.server.tool_parsers import held_prefix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
Piece = tuple[str, str]  # ("reasoning" | "content", text)


class PieceStream(Protocol):
    """One answer's pieces as it streams (the module docstring's invariant)."""

    def feed(self, delta: str) -> list[Piece]: ...

    def finish(self) -> list[Piece]: ...


class ReasoningParser:
    name: ClassVar[str] = ""
    starts_thinking: ClassVar[bool] = False  # deepseek_r1: the prompt opened <think>
    think_tags: ClassVar[bool] = True  # reasoning in <think> ... </think> (grammar_markers)
    special_markers: ClassVar[bool] = False  # its markers are special tokens: keep them

    def __init__(self, calls: bool = False) -> None:
        self.calls = calls  # a tool-call parser reads the content (openai_gptoss writes calls)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer -> (reasoning, content), each None when empty."""
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        content = "".join(t for k, t in pieces if k == "content")
        return reasoning or None, content or None

    def stream(self) -> PieceStream:
        return ReasoningStream(self.starts_thinking)


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_thinking = True


class GptOssParser(ReasoningParser):
    name = "openai_gptoss"
    think_tags = False
    special_markers = True

    def stream(self) -> PieceStream:
        return HarmonyReasoningStream(self.calls)


def grammar_markers(
    parser: ReasoningParser, prompt: str, tokenizer: Any
) -> tuple[list[int] | None, bool]:
    """A structured request's (`reasoning_markers`, `reasoning_started`) (SamplingParams): the
    token ids of `<think>` and `</think>`, and whether the prompt opened the block. None (the
    grammar from the first token) when the tokenizer has no single token for each marker (not
    a thinking model) or when the prompt ends with a closed block (Qwen3 with
    `enable_thinking: false`: the answer comes at once)."""
    if not parser.think_tags:
        return None, False
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in (THINK_OPEN, THINK_CLOSE)]
    if any(len(i) != 1 for i in ids):
        return None, False
    tail = prompt.rstrip()  # only a marker at the very end counts: earlier turns may hold both
    if tail.endswith(THINK_CLOSE):
        return None, False
    return [ids[0][0], ids[1][0]], tail.endswith(THINK_OPEN) or parser.starts_thinking


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3Parser, DeepSeekR1Parser, GptOssParser)
}


def get_reasoning_parser(name: str, calls: bool = False) -> ReasoningParser:
    """The parser called `name`; `calls`: a tool-call parser reads its content's calls."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{sorted(REASONING_PARSERS)}")  # fmt: skip
    return cls(calls)


class ReasoningStream:
    """One answer's pieces as it streams. States: "start" (nothing certain yet), "reasoning",
    "after" (just past </think>: newlines dropped), "content"."""

    def __init__(self, starts_thinking: bool) -> None:
        self._starts_thinking = starts_thinking
        self._state = "start"
        self._buf = ""

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        out: list[Piece] = []
        while True:
            state, buf = self._state, self._buf
            if state == "start":
                s = buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self._state, self._buf = "reasoning", s[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(s):  # whitespace, or maybe the tag: not known yet
                    return out
                elif self._starts_thinking:
                    self._state = "reasoning"
                else:
                    self._state = "content"
            elif state == "reasoning":
                i = buf.find(THINK_CLOSE)
                if i < 0:
                    keep = len(buf) - held_prefix(buf, THINK_CLOSE)
                    if keep:
                        out.append(("reasoning", buf[:keep]))
                    self._buf = buf[keep:]
                    return out
                if i:
                    out.append(("reasoning", buf[:i]))
                self._state, self._buf = "after", buf[i + len(THINK_CLOSE):]
            elif state == "after":
                s = buf.lstrip("\n")
                if not s:
                    self._buf = ""
                    return out
                self._state, self._buf = "content", s
            else:
                if buf:
                    out.append(("content", buf))
                self._buf = ""
                return out

    def finish(self) -> list[Piece]:
        buf, state = self._buf, self._state
        self._buf = ""
        if not buf:
            return []
        if state == "start":  # only whitespace or a piece of "<think>": as if it went on
            kind = "reasoning" if self._starts_thinking else "content"
            return [(kind, buf)]
        return [("reasoning" if state == "reasoning" else "content", buf)]


class HarmonyReasoningStream:
    """gpt-oss's answer as pieces (openai_gptoss, module docstring): each harmony message's text
    goes where its header says (`_kind`); a call, with `calls`, to the content in the canonical
    form, its header as soon as it is known and its arguments as they come."""

    def __init__(self, calls: bool) -> None:
        self._calls = calls
        self._messages = HarmonyStream(opening=True)  # the prompt ended `<|start|>assistant`
        self._kind = ""  # the current message's: "reasoning", "content", "call"; "" outside one
        self._fresh = False  # the current message has sent no text yet
        self._sent: set[str] = set()  # kinds that sent text: the next message's starts "\n"

    def feed(self, delta: str) -> list[Piece]:
        return self._pieces(self._messages.feed(delta))

    def finish(self) -> list[Piece]:
        return self._pieces(self._messages.finish())

    def _pieces(self, events: list[tuple[str, Any]]) -> list[Piece]:
        out: list[Piece] = []
        for event, value in events:
            if event == "header":
                self._kind, self._fresh = self._kind_of(value), True
                if self._kind == "call":
                    out.append(("content", call_head(value.function)))
            elif event == "text" and self._kind == "call":
                out.append(("content", value))
            elif event == "text":
                if self._fresh and self._kind in self._sent:
                    value = "\n" + value
                self._fresh = False
                self._sent.add(self._kind)
                out.append((self._kind, value))
            elif event == "end":
                if self._kind == "call":
                    out.append(("content", CALL))
                self._kind = ""
            # "loose": text outside messages, and cut headers: dropped
        return out

    def _kind_of(self, header: Header) -> str:
        if header.function is not None and self._calls:
            return "call"
        if header.recipient is not None or header.channel == "analysis":
            return "reasoning"  # a built-in tool's call, or a function's no parser reads
        return "content"
