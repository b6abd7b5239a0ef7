"""The scheduler keeps a seeded sampling request's verify chunks whole under speculation
(issue 11; found by the speculative stress workloads, tests/stress.py `draw_spec`): its draws
depend on its drafts, so neither the batch nor memory pressure may change them.

- As the newest running request short of pages, it keeps its pages and waits (it used to
  preempt itself, and its recompute then sampled its last token without drafts).
- Resumed after a preemption, its recompute stops one token short of its end: the last token
  is verified with drafts the next step, as it would have been.
- Alone and still short (pages the cache cannot give back yet), it verifies fewer drafts
  (it used to be aborted as "cannot fit in the KV pool").

Real Scheduler and MemoryManager, one full-attention group of 1-token pages; the tests play
the engine's part (drafts, committed tokens)."""

from __future__ import annotations

from swaserve import SamplingParams
from swaserve.engine.request import Request, RequestStatus
from swaserve.engine.scheduler import Scheduler
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import MemoryManager

SEEDED = SamplingParams(max_tokens=50, temperature=1.0, seed=7)
GREEDY = SamplingParams(max_tokens=50, temperature=0.0)


def _scheduler(num_pages: int, budget: int = 64) -> Scheduler:
    memory = MemoryManager(build_layout([None]), 1, num_pages, watermark_pages=0)
    sched = Scheduler(memory, max_num_seqs=4, max_num_batched_tokens=budget,
                      conservativeness=0.0)
    sched.speculative = True
    return sched


def _decoding(sched: Scheduler, rid: str, prompt_len: int, params: SamplingParams) -> Request:
    """A running request in decode: its prompt computed, one output token not yet run."""
    req = Request(rid, list(range(2, 2 + prompt_len)), params, 50)
    sched.add(req)
    batch = sched.schedule()
    assert batch.requests[-1] is req and batch.num_new_tokens[-1] == prompt_len
    req.num_computed_tokens += prompt_len
    req.output_token_ids.append(9)
    return req


def test_newest_seeded_request_waits_for_pages_instead_of_preempting_itself():
    sched = _scheduler(num_pages=1 + 15)  # 15 usable pages
    _decoding(sched, "old", 6, GREEDY)  # 7 pages (its next position too), new 6
    new = _decoding(sched, "new", 6, SEEDED)
    new.draft_token_ids = [3, 4, 5]  # a 4-token verify: 4 more pages where 2 are free
    late = Request("late", [2], GREEDY, 50)  # would fit in those 2 (1 page + old's next)
    sched.add(late)
    batch = sched.schedule()
    assert [r.request_id for r in batch.requests] == ["old"]
    assert not batch.preempted and new.status is RequestStatus.RUNNING
    assert new.draft_token_ids == [3, 4, 5] and new.num_computed_tokens == 6
    assert late.status is RequestStatus.WAITING  # admission keeps new's shortfall free
    sched.memory.check_integrity()


def test_older_request_short_of_pages_still_preempts_a_waiting_seeded_one():
    sched = _scheduler(num_pages=1 + 14)
    old = _decoding(sched, "old", 6, SEEDED)  # 7 pages (its next position too), new 6
    new = _decoding(sched, "new", 6, SEEDED)
    new.draft_token_ids = [3, 4, 5]
    old.draft_token_ids = [3, 4, 5]  # a whole verify: 3 more pages, 1 is free; new goes
    batch = sched.schedule()
    assert batch.preempted == [new] and new.status is RequestStatus.WAITING
    sched.memory.check_integrity()


def test_resumed_seeded_request_recomputes_all_but_its_last_token():
    for speculative, params, want in [(True, SEEDED, 7), (False, SEEDED, 8), (True, GREEDY, 8)]:
        sched = _scheduler(num_pages=1 + 40)
        sched.speculative = speculative
        req = Request("r", list(range(2, 8)), params, 50)
        req.output_token_ids = [9, 10]  # as after a preemption: 8 tokens, none computed
        sched.add(req)
        batch = sched.schedule()
        assert batch.num_new_tokens == [want], (speculative, params.greedy)


def test_resumed_seeded_request_whose_prefix_is_cached_verifies_next_step():
    """A hit up to its last token leaves a chunk of 0: admitted, in no forward this step; the
    next step it is in decode (drafts, then a whole verify chunk)."""
    from swaserve.memory.radix_cache import RadixCache

    memory = MemoryManager(build_layout([None]), 1, 1 + 40, watermark_pages=0)
    cache = RadixCache(memory)
    sched = Scheduler(memory, 4, 64, cache=cache, conservativeness=0.0)
    sched.speculative = True
    first = _decoding(sched, "first", 8, SEEDED)
    sched.retire()  # its 8 prompt tokens enter the cache
    sched.finish(first)
    req = Request("r", list(range(2, 9)), SEEDED, 50)
    req.output_token_ids = [9]  # 8 tokens; the cache holds the first 8: all but the last
    sched.add(req)
    batch = sched.schedule()
    assert req.status is RequestStatus.RUNNING and not batch.requests
    assert req.num_computed_tokens == req.num_tokens - 1
    req.draft_token_ids = [1, 2]
    batch = sched.schedule()
    assert batch.requests == [req] and batch.num_new_tokens == [3]
    memory.check_integrity()


def test_lone_seeded_request_short_of_pages_verifies_fewer_drafts():
    sched = _scheduler(num_pages=1 + 9)
    req = _decoding(sched, "r", 6, SEEDED)  # 6 of 9 pages held
    req.draft_token_ids = [3, 4, 5]  # positions 6..9 need 4 pages: 3 are free
    batch = sched.schedule()
    assert not batch.rejected and batch.requests == [req] and batch.num_new_tokens == [3]
    assert req.draft_token_ids == [3, 4]
    sched.memory.check_integrity()
