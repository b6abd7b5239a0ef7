"""CPU-side request state for the scheduler: token counts, not phases (docs/architecture.md §2).

`num_computed_tokens` tokens have K/V in the pool; `num_tokens` are known (prompt + outputs).
A step computes some of the difference; when it reaches `num_tokens` the request samples one
more token. Chunked prefill, decode and recompute after preemption all follow from that.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from swaserve.outputs import Logprob
from swaserve.sampling.params import SamplingParams
from swaserve.speculative.metrics import SpecStats

# An output token sampled by a step still in flight: its value is only on the device yet
# (see the overlap schedule in swaserve/engine/core.py). Never a valid token id.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never past the context
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit of the first admission
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Prefill ahead (engine/scheduler.py): admitted only to prefill its prompt while the pool
    # is full of decodes (`ahead`), then parked: waiting, its prompt's K/V in the prefix cache
    # (`parked`), until admitted again with room to decode
    ahead: bool = False
    parked: bool = False
    prompt_logprobs: list[Logprob | None] | None = None  # built chunk by chunk
    prompt_logprobs_sent: bool = False
    # Speculative decoding: drafts to verify in the next step, after the known tokens (their
    # K/V, once computed, is dead unless accepted), and the request's counters.
    draft_token_ids: list[int] = field(default_factory=list)
    spec: SpecStats | None = None
    # Structured outputs (sampling/structured.py): the request's xgrammar matcher, advanced by
    # every token output, and the bitmasks of its sampled rows ([1 + drafts, W]: the next
    # token, then after each draft), filled before each sampling step.
    grammar: Any = None
    token_bitmask: torch.Tensor | None = None
    # params.reasoning_markers: the reasoning block kept out of the grammar (None without);
    # while the block runs `grammar` is None and the gate holds the matcher
    reasoning_gate: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_drafts(self) -> int:
        return self.num_tokens + len(self.draft_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end): known tokens, then drafts past num_tokens."""
        n = self.num_tokens
        if end > n:
            drafts = self.draft_token_ids[max(0, start - n) : end - n]
            return (self.tokens(start, n) if start < n else []) + drafts
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
