"""Reasoning parsers (`--reasoning-parser`, vLLM's names): a thinking model's answer split into
its reasoning, returned as `reasoning_content`, and its content.

- `qwen3` (Qwen3, QwQ): the answer is reasoning when it opens with `<think>` (after
  whitespace), up to `</think>`; the rest is content. An answer that does not open with
  `<think>` (thinking off: `chat_template_kwargs: {"enable_thinking": false}`, whose prompt
  already holds an empty think block) is all content.
- `deepseek_r1` (DeepSeek-R1 and its distills, whose chat template opens `<think>` in the
  prompt): the answer is reasoning from its start (a leading `<think>` dropped) up to
  `</think>`, the rest content; with no `</think>` (cut by max_tokens) all of it is reasoning.

Structured outputs (`response_format`, a required or named tool call) hold the content only
(`grammar_markers`, sampling/reasoning_gate.py): the grammar starts after `</think>`, as vLLM's
does with a reasoning parser.

Content after `</think>` loses its leading newlines (the templates put "\\n\\n" there). Reasoning
unfinished when generation stops is reasoning. A tool-call parser (server/tools.py) then reads
the content only.

Streaming (`stream()`): `feed(delta)` returns ("reasoning" | "content", text) pieces that are
certain, in order, and `finish()` the rest; text that may be the start of a tag is held back
until it is known. For every split of an answer into deltas, the pieces joined per kind equal
`split()` (None as "").
"""

from __future__ import annotations

from typing import Any, ClassVar

from swaserve.server.tool_parsers import held_prefix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
Piece = tuple[str, str]  # ("reasoning" | "content", text)


class ReasoningParser:
    name: ClassVar[str] = ""
    starts_thinking: ClassVar[bool] = False  # deepseek_r1: the prompt opened <think>

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer -> (reasoning, content), each None when empty."""
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        content = "".join(t for k, t in pieces if k == "content")
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_thinking)


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_thinking = True


def grammar_markers(
    parser: ReasoningParser, prompt: str, tokenizer: Any
) -> tuple[list[int] | None, bool]:
    """A structured request's (`reasoning_markers`, `reasoning_started`) (SamplingParams): the
    token ids of `<think>` and `</think>`, and whether the prompt opened the block. None (the
    grammar from the first token) when the tokenizer has no single token for each marker (not
    a thinking model) or when the prompt ends with a closed block (Qwen3 with
    `enable_thinking: false`: the answer comes at once)."""
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in (THINK_OPEN, THINK_CLOSE)]
    if any(len(i) != 1 for i in ids):
        return None, False
    tail = prompt.rstrip()  # only a marker at the very end counts: earlier turns may hold both
    if tail.endswith(THINK_CLOSE):
        return None, False
    return [ids[0][0], ids[1][0]], tail.endswith(THINK_OPEN) or parser.starts_thinking


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (Qwen3Parser, DeepSeekR1Parser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{sorted(REASONING_PARSERS)}")  # fmt: skip
    return cls()


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
