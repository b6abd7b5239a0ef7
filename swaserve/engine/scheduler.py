"""Continuous batching on token counts (vLLM v1's rule), FCFS, with chunked prefill and mixed
prefill + decode steps under one token budget (`max_num_batched_tokens`).

Each step: running requests first, in admission order (decodes take 1 token, unfinished
prefills take the next chunk), then waiting requests while the budget, `max_num_seqs` and a
joint fit of pages in every attention group allow. When a running request cannot get pages,
the newest running request is preempted (its pages freed, recomputed later); never a crash.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from swaserve.engine.request import Request, RequestStatus
from swaserve.memory.manager import MemoryManager

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Waiting requests that can never fit, dropped this step (finished as "abort").
    rejected: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, req: Request, n: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(n)


class Scheduler:
    def __init__(self, memory: MemoryManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.memory = memory
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for metrics and tests

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its pages; returns it if found."""
        for i, req in enumerate(self.running):
            if req.request_id == request_id:
                del self.running[i]
                return self._finish(req)
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return self._finish(req)
        return None

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self._finish(req)

    def _finish(self, req: Request) -> Request:
        self.memory.free(req)
        req.status = RequestStatus.FINISHED
        return req

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.budget
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.memory.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                batch.add(req, n)
                budget -= n
        if batch.preempted:
            return batch  # memory is tight: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.memory.can_admit(req, n):
                if not self.running:
                    # The pool is empty and still cannot take one chunk: it never will.
                    self.waiting.popleft()
                    batch.rejected.append(self._finish(req))
                    log.error("request %s cannot fit in the KV pool; aborted", req.request_id)
                    continue
                break
            ok = self.memory.allocate(req, n)
            assert ok, "can_admit promised a joint fit"
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.add(req, n)
            budget -= n
        return batch

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Recompute later: drop every page; the request keeps its tokens and goes first."""
        self.running.remove(req)
        self.memory.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        log.info("preempted %s (recompute)", req.request_id)

    def retire(self) -> None:
        """After a step: drop window-dead SWA pages of every running request (CPU only)."""
        self.memory.retire_out_of_window(self.running)
