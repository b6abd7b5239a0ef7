"""Continuous batching on token counts (vLLM v1's rule), FCFS, with chunked prefill and mixed
prefill + decode steps under one token budget (`max_num_batched_tokens`).

Policy `priority` (--scheduling-policy priority, vLLM's): each request's `priority` (lower
first; SamplingParams) then its arrival orders both queues, where FCFS orders by arrival
alone: the waiting queue (admission), the running list (who takes the budget first), and so
the victim of a preemption, which is the last running request, now the lowest priority's
newest. A preempted request goes back to its place in the waiting queue. As in vLLM, a waiting
request never preempts a running one: a high-priority arrival waits for room like any other,
but is admitted before everything queued below it.

Each step: running requests first, in admission order (decodes take 1 token, unfinished
prefills take the next chunk), then waiting requests while the budget, `max_num_seqs` and a
joint fit of pages in every attention group allow. When a running request cannot get pages,
the prefix cache gives back unlocked pages first (bounded reclaim); only then is the newest
running request preempted (its pages freed, recomputed later); never a crash.

With the prefix cache, a waiting request starts from its longest valid cached prefix: its
page tables take the cached pages, `num_computed_tokens` jumps to the hit, and only the rest
is computed. After each step every running request's computed pages enter the cache, and a
request that finishes, aborts or is preempted hands its pages to the cache before freeing.

Decode cap (`decode_cap`, expert parallelism only: --moe-decode-max-tokens-per-rank N): the
decoding requests of a step (chunk = the last token, plus the drafts of a verify: 1 + K tokens)
carry at most N tokens together, so a decode-only step always fits the fixed-shape MoE workspace
(swaserve/distributed/decode_workspace.py). Those past the cap wait for the next step, which
starts with the first of them (round robin over the decoding requests: none waits for more than
a few steps). The cap holds for the decodes of a mixed step too; prefill chunks (admissions
included) are not capped, and a step with one takes the variable-size path.

Prefill beside decodes under KV pressure (`kv_bound_step_tokens` R, Sarathi-Serve's stall-free
batching, meant for pools that hold few requests): when the pool holds fewer than R requests
like the next waiting one (at its prompt plus expected output, `settled_pages`), requests are
queued for room, and some running requests decode, a step carries at most max(page, R - decode
tokens) prefill tokens. Such a pool decodes a small batch, whose steps are bound by reading the
weights: a few hundred prefill tokens ride along for little more than the GEMMs' compute (a
graphed mixed step: engine/mixed_graph.py), where an uncapped scheduler runs the batch in waves
(prefill steps of thousands of tokens while nothing decodes, then a long decode phase at the
batch the pool allows). A pool that holds hundreds of requests is never capped: its decodes
already fill the GEMMs, and a cap would slow the ramp to that batch. Opt-in (default 0):
measured only where it loses, a Llama-8B run of 16k prompts on an H100 (-7%: there a prompt
token's attention over 16k keys is a third of its work, and small chunks run it less
efficiently than big ones); see docs/architecture.md §2.

Prefill ahead (`prefill_ahead_tokens` R, opt-in; needs the prefix cache with a host tier):
where the cap above breaks a KV-bound run's waves (requests admitted one by one, each after
its own capped prefill, so the decode batch ramps up and winds down for hundreds of steps),
this keeps them and still hides the prompts under the decodes. When the next waiting request
finds no room, one request that has not run yet is admitted *ahead*: its prompt alone is
prefilled, at most max(page, R - decode tokens) a step, beside the decodes, provided it fits
beside every running request grown to its last token (so it never preempts anyone; with it on,
admission plans every running request's remaining tokens, not the decaying ratio below). Once
its prompt is computed (and its first token read back) it *parks*: it leaves the pool like a
preempted request, but the cache keeps its pages (evicted to the host tier when room is
needed) and it waits before the requests that never ran. When a wave ends it comes back as a
prefix hit (its pages loaded from the host) with only its first token's position to compute.
Admission keeps a prompt's worth of pages free for the next prefill ahead, and prefills ahead
only while the host tier can hold the parked prompts. Measured on an H100 (Gemma-3-27B, 48 x
(7,936 + 1,024) in 20 GiB, R = 128) it does not pay: a graphed step of 16 decodes and a
112-token chunk costs 33.4 ms against 27.2 for the decodes alone, 0.055 ms a hidden prompt token
against 0.087 in a big prefill step, and the run came out even (24 GiB host tier) or 12% slower
(40 GiB) against 122.4 s without. It loses more on a pool of ~7 Llama-8B requests of 16k-token
prompts (the prompt ahead takes one of the few decode slots, and its attention over 16k keys
runs slowly in small chunks). Opt-in; docs/architecture.md §2.

A hit on pages offloaded to host or disk is admitted (pages allocated, loads queued) but held
out of the forward while `cache.loads_pending` (on CUDA the loads land on a side stream while
other requests compute): a held running request is skipped (no budget used; it keeps its
pages and its chunk's allocation, which `allocate` extends idempotently later). When every
runnable request is held, the step is empty and the scheduler waits for the loads.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from swaserve.engine.request import PLACEHOLDER, Request, RequestStatus
from swaserve.memory.manager import MemoryManager
from swaserve.memory.radix_cache import PrefixHit, RadixCache

log = logging.getLogger(__name__)

# Admission keeps free the pages running requests are expected to fill while decoding (SGLang's
# "new token ratio"): each is expected to produce its min_tokens still due plus
# `new_token_ratio` of the rest, at most CLIP_MAX_NEW_TOKENS (a request asking for the whole
# context does not hold the pool). The ratio decays step by step while nothing is preempted and
# rises again on a preemption. Without it, long prompts are admitted while the running
# requests' growth is still to come, then preempted and recomputed: on a decode-heavy
# Gemma-3-27B run (48 x (7,936 + 1,024) in 20 GiB) 24 of 48 requests were (2,997 total tok/s;
# 3,844 with this reserve). Requests that ignore EOS get the ratio too: counting all their
# remaining tokens (3,950 there) cost the 1,000-request offline run 13% of its throughput
# (9,754 output tok/s, 10,699 with the ratio, 11,218 with no reserve; H200, benchmarks/RESULTS.md).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # per step
CLIP_MAX_NEW_TOKENS = 4096


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
    def __init__(
        self,
        memory: MemoryManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cache: RadixCache | None = None,
        conservativeness: float = 1.0,
        policy: str = "fcfs",
        kv_bound_step_tokens: int = 0,
        prefill_ahead_tokens: int = 0,
    ) -> None:
        self.memory = memory
        # "priority": the queues ordered by (priority, arrival) (module docstring)
        self.by_priority = policy == "priority"
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        # Scales the decode-growth reserve: 0 reserves only each request's next page (admit
        # eagerly, preempt when short), 1 the estimate above (--schedule-conservativeness).
        self.conservativeness = conservativeness
        # R of the prefill cap under KV pressure (module docstring); 0: never capped
        self.kv_bound_step_tokens = kv_bound_step_tokens
        # Prefill ahead (module docstring): the ahead request's chunks carry at most this many
        # tokens less the step's decodes; 0: off. Its prompts park in the cache's host tier.
        self.prefill_ahead_tokens = prefill_ahead_tokens
        if prefill_ahead_tokens and (cache is None or not cache.tiers):
            raise ValueError("prefill ahead parks prompts in the prefix cache's host tier: it "
                             "needs the prefix cache with --host-cache-gb")  # fmt: skip
        self.num_parks = 0  # prompts prefilled ahead and parked, for metrics and tests
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total, for metrics and tests
        # Most decode/verify tokens per step (module docstring); None: no cap. Set by the
        # engine under expert parallelism.
        self.decode_cap: int | None = None
        self._decode_next: Request | None = None  # the first request the cap held back
        # Speculative decoding is on (set by the engine): seeded sampling requests' chunks
        # follow `_chunk_end` and the whole-verify rule in `schedule`.
        self.speculative = False

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        if self.by_priority:
            _insert(self.waiting, req)
        else:
            self.waiting.append(req)

    def run(self, req: Request) -> None:
        """A request joins the running ones (admitted here, or its pages came from a prefill
        instance: disaggregation/decode_side.py)."""
        req.status = RequestStatus.RUNNING
        if self.by_priority:
            _insert(self.running, req)  # the budget and preemption follow the order
        else:
            self.running.append(req)

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
        req.draft_token_ids.clear()
        self._release(req)
        req.status = RequestStatus.FINISHED
        return req

    def _release(self, req: Request) -> None:
        """Drop the request's pages, after the cache took the ones it computed."""
        if self.cache is not None:
            self.cache.insert(req)
        self.memory.free(req)
        if self.cache is not None:
            self.cache.release(req.request_id)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.budget
        held = False  # a request waits for its prefix's loads
        waiting_for = 0  # pages the seeded verifies that wait for room lack (kept free below)
        decoding = self._decode_picks()
        prefill_left = self._prefill_allowance()  # None: no cap
        ahead_left = 0
        if self.prefill_ahead_tokens:
            self._park_prefilled()
            ahead_left = max(self.memory.page_size, self.prefill_ahead_tokens - self._decodes())
        # Asked per request only while some hit's loads are pending (none: most steps)
        loads = self.cache is not None and self.cache.has_pending_loads()
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if len(req.output_token_ids) >= req.max_tokens:
                # Its last token is in flight (a placeholder, overlap schedule): it finishes
                # when that is read back. Scheduling it would compute one more token, thrown
                # away: a whole wasted step when a batch ends together.
                continue
            if loads and self._loading(req):
                held = True
                continue
            if req.ahead and req.num_computed_tokens >= req.num_prompt_tokens:
                continue  # prefilled ahead, its first token in flight: it parks next step
            if decoding is not None and _decoding(req) and id(req) not in decoding:
                continue  # past the decode cap: the next step
            end = self._chunk_end(req) if self.speculative else req.num_tokens_with_drafts
            n = min(end - req.num_computed_tokens, budget)
            prefilling = prefill_left is not None and not _decoding(req)
            if prefilling:
                n = min(n, prefill_left)
                if n <= 0:
                    continue
            if req.ahead:
                n = min(n, ahead_left)
                if n <= 0:
                    continue
            # A verify chunk [last, drafts] cut short verifies fewer drafts, which changes a
            # seeded request's draws: such a request waits for a step with room instead (its
            # draft count is capped below the token budget, so it never waits forever).
            fixed = bool(req.draft_token_ids) and _seeded_random(req)
            if fixed and n < end - req.num_computed_tokens:
                continue
            wait = False
            while not self.memory.allocate(req, n):
                if self.cache is not None and self.cache.evict(self.memory.shortfall(req, n)):
                    continue
                victim = self.running[-1]
                if fixed and victim is req and len(self.running) > 1:
                    # Nor is it cut for want of pages: the newest keeps its pages and waits
                    # (an older request short of pages preempts it). Alone, it runs a shorter
                    # chunk below rather than never (max_model_len leaves room for a whole
                    # verify chunk, max_request_tokens(K): only pages the cache cannot give
                    # back yet leave it short; its draws then differ from a roomier pool's).
                    # Admission below keeps the pages it lacks free.
                    wait = True
                    waiting_for += self.memory.shortfall(req, n)
                    break
                k = 0 if fixed and victim is not req else self._largest_fit(req, n)
                if k:
                    n = k  # a shorter chunk fits: progress without preempting anyone
                    continue
                if victim is req and len(self.running) == 1:
                    # Alone, with no cache page left to take and no shorter chunk: it never fits.
                    self.running.remove(req)
                    batch.rejected.append(self._finish(req))
                    log.error("request %s cannot fit in the KV pool; aborted", req.request_id)
                    break
                self._preempt(victim, batch)
                if victim is req:
                    break
            if wait:
                continue
            if req.status is RequestStatus.RUNNING:
                if req.draft_token_ids:  # drafts past the chunk are not verified (it holds `last`)
                    del req.draft_token_ids[max(0, req.num_computed_tokens + n - req.num_tokens) :]
                batch.add(req, n)
                budget -= n
                if prefilling:
                    prefill_left -= n
                if req.ahead:
                    ahead_left -= n
        if batch:
            self.new_token_ratio = max(
                MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
            )
        if batch.preempted:
            return batch  # memory is tight: admit nobody new this step
        reserve = None  # O(running): worked out only when someone may be admitted
        blocked = False  # the next waiting request found no room
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if reserve is None:
                reserve = self._growth_reserve(batch) + waiting_for
            room = budget if prefill_left is None else min(budget, prefill_left)
            if room <= 0:
                break
            req = self.waiting[0]
            n = self._admit(req, room, reserve + self._ahead_room())
            if n is None:
                if not self.running:
                    # The pool is empty and still cannot take one chunk: it never will.
                    self.waiting.popleft()
                    batch.rejected.append(self._finish(req))
                    log.error("request %s cannot fit in the KV pool; aborted", req.request_id)
                    continue
                blocked = True
                break
            self.waiting.popleft()
            req.parked = False
            self.run(req)
            if self._loading(req):
                held = True
                continue
            if n:  # 0: resumed one token short of its end (_chunk_end); it verifies next step
                batch.add(req, n)
                budget -= n
                if prefill_left is not None:
                    prefill_left -= n
        if (blocked and self.prefill_ahead_tokens and budget > 0 and ahead_left > 0
                and len(self.running) < self.max_num_seqs):
            held |= self._admit_ahead(batch, min(budget, ahead_left))
        if held and not batch:
            self.cache.wait_loads()  # nothing to overlap them with: no busy polling
        return batch

    # ---- prefill ahead ----------------------------------------------------------------------

    def _decodes(self) -> int:
        """Tokens the running requests in decode (or verify) compute next."""
        return sum(
            r.num_tokens_with_drafts - r.num_computed_tokens
            for r in self.running
            if r.status is RequestStatus.RUNNING and _decoding(r)
        )

    def _park_prefilled(self) -> None:
        """Ahead requests whose prompt is computed leave the pool: the cache keeps their pages
        (evicted to the host tier when room is needed) and they wait, parked, before the
        requests that never ran, to come back as a prefix hit once they have room to decode.
        One whose first token is still in flight (overlap schedule) parks a step later."""
        for req in [r for r in self.running if r.ahead]:
            if req.num_computed_tokens < req.num_prompt_tokens or (
                    req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER):
                continue  # fmt: skip
            self._leave_pool(req)
            req.parked = True
            self.num_parks += 1
            if self.by_priority:
                _insert(self.waiting, req)
            else:  # after the parked ones before it: they come back in the order they parked
                i = 0
                while i < len(self.waiting) and self.waiting[i].parked:
                    i += 1
                self.waiting.insert(i, req)
            log.debug("parked %s (prefilled ahead)", req.request_id)

    def _ahead_room(self) -> int:
        """Pages admission keeps free for the next prompt to prefill ahead: a prompt like the
        queue's head. 0 when off, when one is being prefilled ahead, when nothing would be left
        to prefill once the head is admitted, and when nothing decodes (the head would have no
        decodes to be prefilled beside: it starts now, and an empty pool always admits it)."""
        if not self.prefill_ahead_tokens or len(self.waiting) < 2:
            return 0
        if any(r.ahead for r in self.running) or not any(_decoding(r) for r in self.running):
            return 0
        return self.memory.settled_pages(self.waiting[0].num_prompt_tokens)

    def _admit_ahead(self, batch: ScheduledBatch, room: int) -> bool:
        """Start prefilling ahead the first waiting request that has not been (one at a time,
        while the host tier can take its prompt beside those parked already), if its prompt
        fits beside every running request grown to its last token (`max_tokens`): prefilling
        ahead never preempts anyone. Returns whether it waits for loads of a cached prefix."""
        if any(r.ahead for r in self.running):
            return False
        req = next((r for r in self.waiting if not r.parked), None)
        if req is None or req.params.prompt_logprobs is not None:
            return False
        settled = self.memory.settled_pages
        parked = sum(settled(r.num_prompt_tokens) for r in self.waiting if r.parked)
        if parked + settled(req.num_prompt_tokens) > self.cache.tiers[0].capacity:
            return False
        reserve = sum(settled(r.num_prompt_tokens + r.max_tokens) - settled(r.num_computed_tokens)
                      for r in self.running)  # fmt: skip
        n = self._admit(req, room, reserve, ahead=True)
        if n is None:
            return False
        self.waiting.remove(req)
        req.ahead = True
        self.run(req)
        if self._loading(req):
            return True
        if n:
            batch.add(req, n)
        return False

    def _decode_picks(self) -> set[int] | None:
        """The decoding requests (ids of the objects) that may run this step under the decode
        cap: round robin from the one the last capped step held back, while their tokens
        (1 + drafts each) stay within the cap; the first always runs (a verify larger than the
        cap alone: the engine refuses a cap below 1 + K, so only as a safeguard). None: no
        cap."""
        cap = self.decode_cap
        if not cap:
            return None
        decodes = [r for r in self.running if _decoding(r) and not self._loading(r)]
        start = next((i for i, r in enumerate(decodes) if r is self._decode_next), 0)
        self._decode_next = None
        picks: set[int] = set()
        used = 0
        for req in decodes[start:] + decodes[:start]:
            n = req.num_tokens_with_drafts - req.num_computed_tokens
            if picks and used + n > cap:
                self._decode_next = req
                break
            picks.add(id(req))
            used += n
        return picks

    def _prefill_allowance(self) -> int | None:
        """The prefill tokens this step may carry under KV pressure (module docstring), or
        None: no cap (off, nothing queued, nothing decoding, or a pool roomy enough)."""
        target = self.kv_bound_step_tokens
        if not target or not self.waiting:
            return None
        head = self.waiting[0]
        pages = self.memory.settled_pages(head.num_tokens + self.expected_new_tokens(head))
        if self.memory.pool.capacity >= target * max(1, pages):
            return None  # the pool holds >= R such requests: its decodes fill the GEMMs
        decodes = self._decodes()
        if not decodes:
            return None  # nothing to ride along with: big chunks are the fastest prefill
        return max(self.memory.page_size, target - decodes)

    def _loading(self, req: Request) -> bool:
        """The request's cached prefix is still being loaded: not in this step's forward."""
        return self.cache is not None and self.cache.loads_pending(req.request_id)

    def _chunk_end(self, req: Request) -> int:
        """Where the request's next chunk may end: its known tokens and drafts. Under
        speculation a seeded sampling request recomputed after a preemption stops one token
        short: its last token is then verified with drafts, as it would have been had it not
        been preempted, and draws what it would have drawn (a drafter proposes only once the
        positions before the last one are computed)."""
        if (self.speculative and req.output_token_ids and _seeded_random(req)
                and req.num_computed_tokens < req.num_tokens - 1):
            return req.num_tokens - 1
        return req.num_tokens_with_drafts

    def _largest_fit(self, req: Request, n: int) -> int:
        """The longest chunk shorter than n that `allocate` would take now (0: none)."""
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.memory.shortfall(req, mid) == 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _growth_reserve(self, batch: ScheduledBatch) -> int:
        """Pages the running requests will soon need: the rest of each prompt still being
        prefilled, and one page per decoding request (its next `page_size` tokens), per
        growing group. Admission leaves them free, so a request admitted now is not preempted
        by the older requests' growth a few steps later (admit, preempt, recompute, repeat
        while memory stays tight). SWA groups need at most a window of pages."""
        groups = self.memory.layout.groups
        ps = self.memory.page_size
        full = sum(g.window is None for g in groups)
        windows = [g.window for g in groups if g.window is not None]
        reserve = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            end = req.num_computed_tokens + n
            target = max(req.num_tokens + self.expected_new_tokens(req), end + ps)
            grow = -(-target // ps) - -(-end // ps)
            reserve += full * grow
            for w in windows:
                if end < w + ps:  # past that, it retires a page per page it adds
                    reserve += min(grow, -(-w // ps) + 1)
        return reserve

    def expected_new_tokens(self, req: Request) -> int:
        """Tokens the request is expected to add to its KV before it finishes (see
        INIT_NEW_TOKEN_RATIO): all that are left when it ignores EOS, else its min_tokens
        still due plus the ratio of the rest."""
        if self.conservativeness <= 0:
            return 0
        done = len(req.output_token_ids)
        left = req.max_tokens - done
        if left <= 0:
            return 0
        sure = min(left, max(0, req.params.min_tokens - done))
        rest = min(left - sure, CLIP_MAX_NEW_TOKENS)
        # Prefill ahead plans with every token due: the running requests' growth must not eat
        # the room kept for the prompt being prefilled ahead (module docstring)
        ratio = 1.0 if self.prefill_ahead_tokens else self.new_token_ratio
        return sure + int(rest * min(1.0, ratio * self.conservativeness))

    def _admit(
        self, req: Request, budget: int, reserve: int = 0, ahead: bool = False
    ) -> int | None:
        """Allocate the first chunk of a waiting request, from its longest cached prefix.
        Returns the chunk's token count, or None (nothing changed) when it does not fit.

        The hit stays locked from the match until the request holds its pages: evicting to
        make room for it, and the tidying that follows, must not remove a node of the hit (a
        leaf whose end is not a reuse point is dropped once nothing pins it)."""
        hit = None
        if self.cache is not None and req.params.prompt_logprobs is None:
            # Prompt logprobs need every prompt position computed: no hit for those.
            hit = self.cache.match(req.tokens(0, req.num_tokens), req.num_tokens - 1)
            if hit.num_tokens:
                self.cache.lock(hit)
            else:
                hit = None
        try:
            n = self._fit(req, hit, budget, reserve, ahead)
            if n is None and hit is not None and not self.running:
                # Nothing else runs: as a miss it may fit where the hit's pages do not.
                self.cache.unlock(hit)
                hit = None
                n = self._fit(req, hit, budget, reserve, ahead)
            if n is None:
                return None
            if self.cache is not None:
                self.cache.attach(req.request_id, hit or PrefixHit(), req.num_prompt_tokens)
        finally:
            if hit is not None:
                self.cache.unlock(hit)
        if hit is not None:
            req.num_computed_tokens = hit.num_tokens
            if req.num_preemptions == 0 and not req.parked:  # a parked prompt hits itself
                req.num_cached_tokens = hit.num_tokens
        ok = self.memory.allocate(req, n)
        assert ok, "_fit promised a joint fit"
        return n

    def _fit(
        self, req: Request, hit: PrefixHit | None, budget: int, reserve: int = 0,
        ahead: bool = False,
    ) -> int | None:
        """The chunk a waiting request would start with, if its pages fit (joint fit plus the
        watermark and the running requests' growth reserve), evicting unlocked cache pages
        (never the hit's: the caller keeps it locked) to make room. When the whole chunk does
        not fit, a shorter one of whole pages does (at least one new page per group), if the
        full groups have room for the whole prompt: a long prompt starts where its first
        chunk's SWA pages for every group would not fit at once."""
        p = hit.num_tokens if hit is not None else 0
        n = min(self._chunk_end(req) - p, budget)  # 0: a resumed request's last token is due
        fixed = self.memory.watermark_pages + reserve
        if hit is not None:
            fixed += hit.extra_pages
        ps = self.memory.page_size
        groups = self.memory.layout.groups
        need = self.memory.pages_to_cover(p, p + n) + fixed
        # The full groups must have room for the whole prompt: their pages never retire, so a
        # prompt started without it is preempted before it ends and recomputed, again and again.
        # Beside other requests, room for its expected output too; alone, it always starts.
        end = req.num_tokens + (self.expected_new_tokens(req) if self.running and not ahead
                                else 0)  # prefilled ahead: the prompt only, it parks
        prompt_pages = -(-end // ps) - -(-p // ps)
        full_need = sum(g.window is None for g in groups) * prompt_pages + fixed
        short = max(need, full_need) - self.memory.pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        free = self.memory.pool.num_free
        if full_need > free:
            return None
        if need <= free:
            return n
        per_group = (free - fixed) // len(groups)
        if per_group < 1:
            return None
        k = min(n, (-(-p // ps) + per_group) * ps - p)
        return k if k > 0 else None

    def _leave_pool(self, req: Request) -> None:
        """A running request waits again with its tokens (preempted or parked): its computed
        pages go to the cache and it frees the rest, drops its drafts, and is computed again
        from its longest cached prefix when admitted. The caller queues it."""
        self.running.remove(req)
        self._release(req)
        req.draft_token_ids.clear()
        req.num_computed_tokens = 0
        req.ahead = False
        req.status = RequestStatus.WAITING

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Recompute later: drop every page; the request keeps its tokens and goes first."""
        self._leave_pool(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        # The running requests grew more than expected: expect more from them from now on.
        self.new_token_ratio = min(1.0, max(INIT_NEW_TOKEN_RATIO, self.new_token_ratio + 0.2))
        if self.by_priority:
            _insert(self.waiting, req)  # ahead of later arrivals of its priority
        else:
            self.waiting.appendleft(req)
        batch.preempted.append(req)
        log.info("preempted %s (recompute)", req.request_id)

    def retire(self) -> None:
        """After a step: computed pages enter the cache, then every running request drops its
        window-dead SWA pages (CPU only)."""
        if self.cache is not None:
            for req in self.running:
                self.cache.insert(req)
        self.memory.retire_out_of_window(self.running)
        if self.cache is not None:
            self.cache.tidy()


def _order(req: Request) -> tuple[int, float]:
    return req.params.priority, req.arrival_time


def _insert(queue: deque[Request] | list[Request], req: Request) -> None:
    """Put `req` after every request that comes before or with it (`_order`): the queue stays
    sorted, equal keys in insertion order."""
    key = _order(req)
    i = len(queue)
    while i and _order(queue[i - 1]) > key:
        i -= 1
    queue.insert(i, req)


def _decoding(req: Request) -> bool:
    """Its chunk is its last known token (and its drafts): a decode or a verify."""
    return req.num_computed_tokens == req.num_tokens - 1


def _seeded_random(req: Request) -> bool:
    """The request samples from its own generator: its tokens must not depend on the batch."""
    return req.params.seed is not None and not req.params.greedy
