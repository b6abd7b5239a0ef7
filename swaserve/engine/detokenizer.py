"""Incremental detokenization: token ids in, stable text deltas out, O(1) work per token.

vLLM's prefix/read-offset scheme, on token ids. Over the ids seen so far (a few prompt
tokens for context, then the output tokens):

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 |<-- already emitted -->|<-- not yet emitted -->|
                 prefix_text = decode(ids[prefix_offset:read_offset])
                 full_text   = decode(ids[prefix_offset:])
                 delta       = full_text[len(prefix_text):]

Decoding a window that starts a few tokens back (rather than the new tokens alone) keeps
context-dependent decoding right: SentencePiece "▁" word starts, byte-fallback bytes
fused into characters, BPE byte-level pieces. Invariants:

- `ids[prefix_offset:read_offset]` decodes to text already emitted (its tail); when a
  delta is emitted the window slides: prefix_offset <- read_offset, read_offset <- len(ids).
- A delta is held back (offsets stay, the window grows) while `full_text` ends with
  U+FFFD, i.e. the newest tokens are bytes of a character not yet complete, or while the
  new tokens add no text. `flush()` releases whatever is held back (at finish).
- read_offset only advances to a point where the decoded text was complete, so the next
  window never starts mid-character (which would garble a byte-fallback group).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token (vLLM uses 5).
INITIAL_CONTEXT_TOKENS = 5
# Look this far back in the prompt for a context window that starts on a character boundary.
MAX_CONTEXT_TOKENS = 24


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas that never split a character.

    `tokenizer` is a Hugging Face fast tokenizer (`PreTrainedTokenizerFast`) or a raw
    `tokenizers.Tokenizer`; decoding goes straight to the Rust backend (no
    `clean_up_tokenization_spaces`), as vLLM does.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # all output text emitted so far (the concatenation of the deltas)

        # spaces_between_special_tokens=False: two adjacent special tokens are joined with
        # nothing between them (the decoder may put a space there). As in vLLM's fast
        # detokenizer, it only matters when special tokens are kept in the text.
        self._added: dict[int, str] = {}
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._added = {
                tid: tok.content for tid, tok in self._backend.get_added_tokens_decoder().items()
            }
        self._last_was_added = False

        self._ids = self._context(list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _context(self, prompt: list[int]) -> list[int]:
        """The last few prompt tokens, starting where they decode without U+FFFD if we can."""
        if len(prompt) <= INITIAL_CONTEXT_TOKENS:
            return prompt
        for k in range(INITIAL_CONTEXT_TOKENS, min(len(prompt), MAX_CONTEXT_TOKENS) + 1):
            if REPLACEMENT_CHAR not in self._decode(prompt[-k:]):
                return prompt[-k:]
        return prompt[-INITIAL_CONTEXT_TOKENS:]  # the prompt itself holds invalid bytes

    def add(self, token_ids: list[int]) -> str:
        """Appends output token ids; returns the newly stable text (possibly "")."""
        delta = "".join(self._add_one(t) for t in token_ids)
        self.text += delta
        return delta

    def _add_one(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._added:
            content = self._added.get(token_id)
            if content is not None and self._last_was_added:
                # Emit the raw special token (nothing the decoder would put before it).
                held = self._delta(final=True, upto=len(self._ids) - 1)
                self._slide()
                self._last_was_added = True
                return held + content
            self._last_was_added = content is not None
        delta = self._delta(final=False)
        if delta:
            self._slide()
        return delta

    def _delta(self, final: bool, upto: int | None = None) -> str:
        ids = self._ids if upto is None else self._ids[:upto]
        if len(ids) <= self._read_offset:
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if not final and full_text.endswith(REPLACEMENT_CHAR):
            return ""  # the newest bytes may be an unfinished character: wait for more
        return full_text[len(prefix_text) :]

    def _slide(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)

    def flush(self) -> str:
        """Releases held-back text (e.g. bytes that never formed a character); call at finish."""
        delta = self._delta(final=True)
        if delta:
            self._slide()
        self.text += delta
        return delta
