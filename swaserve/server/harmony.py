"""gpt-oss's output in OpenAI's harmony format (github.com/openai/harmony, docs/format.md), read
as text: each marker is a special token's text, which the server keeps in the output
(skip_special_tokens=False; the default would erase every marker).

    <|start|>{header}<|message|>{content}<|end|>       (<|return|> / <|call|> end the last one)
    header: {role}[ to={recipient}][<|channel|>{channel}[ to={recipient}][ [<|constrain|>]{type}]]

A completion continues the prompt's `<|start|>assistant`, so it opens inside its first header:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>

`HarmonyStream` turns such text, fed in any pieces, into events in order:

- ("header", Header): a message begins (its header complete: `<|message|>` seen);
- ("text", str): a piece of its content, never empty;
- ("end", str): the message ended, by the marker given (<|end|>, <|return|>, <|call|>,
  <|endoftext|>), "" when a new header began instead or the text ran out (max_tokens);
- ("loose", str): text outside any message, and cut or broken headers, as written.

Content text that may be the start of a marker is held back until it is known; a header is sent
only whole, so its text never reads as content. Joining every event's text (Header.raw for a
header) gives back the input exactly.

Where it starts (`opening`):

- True (a model's output): in the first header, when the text opens (after whitespace) with a
  marker or with `to=` (a recipient in the role part: `<|start|>assistant to=functions.f...`);
  any other opening is a message with no header (no channel) up to the first marker. That is
  what a grammar (response_format, a named or required tool call) makes the model write from
  its first token, and what the output reads as with the markers skipped.
- False (text that holds messages among plain text: the reasoning parser's content, which the
  `openai` tool-call parser reads): outside, the plain text loose.

Broken text is read leniently: in content, `<|start|>`, `<|channel|>`, `<|constrain|>` or
`<|message|>` begins a new header (the message ends); in a header, `<|start|>` begins it again
and an end marker drops it (loose).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
RETURN, CALL, ENDOFTEXT = "<|return|>", "<|call|>", "<|endoftext|>"
ENDS = (END, RETURN, CALL, ENDOFTEXT)  # end a message
HEADS = (START, CHANNEL, CONSTRAIN, MESSAGE)  # begin a header (outside a header)
MARKERS = ENDS + HEADS
FUNCTIONS = "functions."  # the namespace of the request's function tools
_LONGEST = max(map(len, MARKERS))

Event = tuple[str, Any]  # ("header", Header) | ("text" | "end" | "loose", str)


@dataclass(frozen=True)
class Header:
    """A message's header: role ("assistant"; None when the header does not name it), channel
    ("analysis", "commentary", "final"), recipient (`to=`: "functions.get_weather",
    "browser.search", "python") and content type (`<|constrain|>json`), each None when absent;
    `raw` is the header as written, markers included."""

    role: str | None = None
    channel: str | None = None
    recipient: str | None = None
    constrain: str | None = None
    raw: str = field(default="", compare=False)

    @property
    def function(self) -> str | None:
        """The function called (the recipient's name in `functions.`), None otherwise."""
        r = self.recipient or ""
        return r[len(FUNCTIONS):] if r.startswith(FUNCTIONS) and len(r) > len(FUNCTIONS) else None


_WORD = r"\s*([^\s<]+)"
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + _WORD + r"([^<]*)")
_CONSTRAIN = re.compile(re.escape(CONSTRAIN) + _WORD)


def parse_header(raw: str) -> Header:
    """The header whose text (a leading `<|start|>` and the closing `<|message|>` allowed) is
    `raw`. The recipient may sit in the role part or in the channel part; the content type
    after `<|constrain|>`, or as a bare word after the channel (`commentary json`)."""
    text = raw.removeprefix(START).removesuffix(MESSAGE)
    recipient = _RECIPIENT.search(text)
    channel = _CHANNEL.search(text)
    constrain = _CONSTRAIN.search(text)
    ctype = constrain.group(1) if constrain else None
    if ctype is None and channel:
        extra = [w for w in channel.group(2).split() if not w.startswith("to=")]
        ctype = extra[0] if extra else None
    role = [w for w in re.split(r"<\|", text, maxsplit=1)[0].split() if not w.startswith("to=")]
    return Header(role[0] if role else None, channel.group(1) if channel else None,
                  recipient.group(1) if recipient else None, ctype, raw)  # fmt: skip


def call_head(name: str) -> str:
    """The canonical header of a call to function `name`; the call is
    `call_head(name) + arguments + CALL` (the `openai_gptoss` reasoning parser writes calls so
    into the content, the `openai` tool-call parser reads them)."""
    return f"{START}assistant to={FUNCTIONS}{name}{CHANNEL}commentary{CONSTRAIN}json{MESSAGE}"


def is_harmony_template(template: Any) -> bool:
    """Whether a chat template (a dict of them: any) renders the harmony format (gpt-oss's)."""
    return bool(template) and CHANNEL in str(template)


def _held(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of a marker."""
    i = text.rfind("<", max(0, len(text) - _LONGEST + 1))
    while i >= 0:
        tail = text[i:]
        if any(m.startswith(tail) for m in MARKERS):
            return len(tail)
        i = text.rfind("<", max(0, len(text) - _LONGEST + 1), i)
    return 0


def _first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """The first of `markers` in `text` from `start`: (where, which); (-1, "") when none is."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


class HarmonyStream:
    """One text's events as it comes (module docstring): feed(delta), then finish() once.
    States: "open" (not yet known whether the text opens in a header), "outside", "header"
    (buffered from its first marker, or from the opening `to=`), "body" (a message's
    content)."""

    def __init__(self, opening: bool) -> None:
        self._state = "open" if opening else "outside"
        self._buf = ""
        self._scan = 0  # in a header: where to look for its end next

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out = self.feed("")
        buf, self._buf = self._buf, ""
        if self._state == "body":
            if buf:
                out.append(("text", buf))  # a piece of a marker, never completed: text
            out.append(("end", ""))
        elif buf:  # a cut header, or what may have begun one
            out.append(("loose", buf))
        self._state = "outside"
        return out

    def _step(self, out: list[Event]) -> bool:
        """Reads what the buffer makes certain; True when the state changed (read on)."""
        buf, state = self._buf, self._state
        if state == "open":
            s = buf.lstrip()
            if not s or any(len(s) < len(m) and m.startswith(s) for m in (*MARKERS, "to=")):
                return False  # whitespace, or maybe a marker or a recipient: not yet known
            if s.startswith("to="):
                self._header(buf, 0)
            elif s.startswith(MARKERS):
                self._state = "outside"
            else:
                out.append(("header", Header()))
                self._state = "body"
            return True
        if state == "header":
            i, m = _first(buf, (MESSAGE, START, *ENDS), self._scan)
            if i < 0:
                self._scan = max(self._scan, len(buf) - _LONGEST + 1)
                return False
            if m == MESSAGE:
                out.append(("header", parse_header(buf[:i + len(MESSAGE)])))
                self._buf, self._state = buf[i + len(MESSAGE):], "body"
            elif m == START:  # a header begun again: the one so far is loose
                out.append(("loose", buf[:i]))
                self._header(buf[i:], len(START))
            else:  # ended before its content: loose, marker and all
                out.append(("loose", buf[:i + len(m)]))
                self._buf, self._state = buf[i + len(m):], "outside"
            return True
        i, m = _first(buf, MARKERS)
        kind = "text" if state == "body" else "loose"
        if i < 0:
            keep = len(buf) - _held(buf)
            if keep:
                out.append((kind, buf[:keep]))
            self._buf = buf[keep:]
            return False
        if i:
            out.append((kind, buf[:i]))
        if m in ENDS:
            out.append(("end" if state == "body" else "loose", m))
            self._buf, self._state = buf[i + len(m):], "outside"
        else:
            if state == "body":
                out.append(("end", ""))
            self._header(buf[i:], len(START) if m == START else 0)
        return True

    def _header(self, buf: str, scan: int) -> None:
        self._buf, self._state, self._scan = buf, "header", scan
