"""A thinking model's reasoning kept out of its grammar: structured outputs hold the answer
after `</think>`, not the reasoning before it (vLLM does the same when a reasoning parser is
set). The request's params name the block's two marker tokens (`reasoning_markers`).

States, advanced by every output token in order (`on_token`, from the engine's stop rule):

- "start": the output may open the block. The grammar is live, and the first token's mask
  also allows `open` (`allow_open`). If the first token is `open`, the request is
  "thinking"; any other first token goes to the grammar ("answer").
- "thinking": the grammar is held aside (`Request.grammar` is None: no mask, nothing fed);
  `close` ends it, and the grammar takes the tokens after it ("answer"). A request whose
  prompt opened the block (`reasoning_started`) starts here.
- "answer": the grammar holds as for any structured request.

The markers are single tokens (Qwen3's and DeepSeek-R1's `<think>` / `</think>` are); the
marker tokens themselves never reach the grammar.

Speculation: while thinking, drafts stop short of `close` (`drafts`), so that no verify row
after it samples unmasked; `close` itself is then sampled at a row of its own, and the
grammar's masks start with the next step.
"""

from __future__ import annotations

from typing import Any

import torch


class ReasoningGate:
    def __init__(self, markers: list[int], started: bool) -> None:
        self.open_id, self.close_id = markers
        self.state = "thinking" if started else "start"
        self.held: Any = None  # the matcher while thinking

    def attach(self, req: Any, matcher: Any) -> None:
        """Give a new request its matcher: live, or held when the prompt opened the block."""
        if self.state == "thinking":
            self.held = matcher
        else:
            req.grammar = matcher

    def allow_open(self, req: Any, masks: torch.Tensor) -> None:
        """Before the first token is sampled: its mask (row 0) also allows `open`."""
        if self.state == "start" and not req.output_token_ids:
            word, bit = divmod(self.open_id, 32)
            v = int(masks[0, word]) | (1 << bit)  # int32 words: bit 31 is the sign
            masks[0, word] = v - (1 << 32) if v >= 1 << 31 else v

    def on_token(self, req: Any, token: int, n_out: int) -> bool:
        """Output token number n_out; True when the gate takes it (the grammar must not see
        it)."""
        if self.state == "answer":
            return False
        if self.state == "start":
            if n_out == 1 and token == self.open_id:
                self.state, self.held, req.grammar = "thinking", req.grammar, None
                return True
            self.state = "answer"
            return False
        if token == self.close_id:  # thinking
            self.state, req.grammar, self.held = "answer", self.held, None
        return True

    def drafts(self, drafts: list[int]) -> list[int]:
        """While thinking, the drafts before the first `close`."""
        if self.state == "thinking" and self.close_id in drafts:
            return drafts[: drafts.index(self.close_id)]
        return drafts
