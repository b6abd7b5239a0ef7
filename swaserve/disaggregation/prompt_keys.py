"""What the PD router keys prefix affinity on: a request's prompt prefix, without tokenizing.

    completions, text        the prompt's first 256 / 1024 / 4096 characters
    completions, token ids   the prompt's first 64 / 256 / 1024 tokens
    chat                     the messages as one text (role and content of each, in order),
                             keyed as a text prompt: requests sharing a system prompt or the
                             first turns share keys, as their templated tokens share a prefix

A batch of prompts is keyed by its first one (the whole batch goes to one pair). The keys are
router_dp's (length, hash) pairs, so its `PrefixAffinity` LRU holds them.
"""

from __future__ import annotations

from swaserve.server import protocol as P
from swaserve.server.router_dp import prefix_keys, text_prefix_keys

# Between messages: a message boundary never reads as text inside one (no shared prefix
# between [a, bc] and [ab, c]).
_SEP = "\x1e"


def chat_text(messages: list[P.ChatMessage]) -> str:
    """The messages as one text whose prefixes follow the conversation's."""
    parts = []
    for m in messages:
        msg = m.to_template()
        parts.append(f"{msg['role']}\x1f{msg['content']}{_SEP}")
    return "".join(parts)


def prompt_keys(req: P.CompletionRequest | P.ChatCompletionRequest) -> list[tuple]:
    """The affinity keys of a validated request (empty for a prompt shorter than the shortest
    prefix length: it goes by load alone)."""
    if isinstance(req, P.ChatCompletionRequest):
        return text_prefix_keys(chat_text(req.messages))
    prompts = req.prompts()
    if not prompts:
        return []
    first = prompts[0]
    return text_prefix_keys(first) if isinstance(first, str) else prefix_keys(first)


def num_sequences(req: P.CompletionRequest | P.ChatCompletionRequest) -> int:
    """Sequences the request puts in flight: its samples for each of its prompts."""
    prompts = len(req.prompts()) if isinstance(req, P.CompletionRequest) else 1
    return max(1, prompts) * (req.n or 1)
