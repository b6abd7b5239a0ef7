"""The garbage collector in a long-running serving loop.

Python's full collections walk every tracked object. After start-up an engine process holds
hundreds of thousands of them (torch, transformers, the model's modules, graph state), almost
none of which will ever become garbage; the step loop, meanwhile, allocates enough (outputs,
token lists, speculation's rows) to trigger a full collection now and then. On the 2-core
development VM with a 1-layer model and 512 running requests, one full collection took 196 ms
over 381k objects (one every ~60 steps with n-gram speculation: 4.5 ms a step on average,
and a 0.2 s stall of every stream when it comes), and 2.7 ms once the start-up heap was frozen
(benchmarks/RESULTS.md). vLLM freezes its engine core's start-up heap the same way.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> None:
    """Move every object alive into the collector's permanent generation (`gc.freeze`): later
    collections skip them. The first call in a process collects first; later ones (more
    engines in one process: tests, notebooks) only freeze what is new, since a full
    collection of a large heap at every engine start cost more than it saves (a frozen object
    that becomes cyclic garbage stays; engines themselves hold no cycles and are freed by
    reference counting when dropped: tests/unit/test_engine_release.py keeps it so)."""
    t = time.perf_counter()
    if not gc.get_freeze_count():
        gc.collect()
    gc.freeze()
    log.debug("%s: %d start-up objects frozen for the garbage collector (%.0f ms)", what,
              gc.get_freeze_count(), (time.perf_counter() - t) * 1e3)


def release_heap(what: str) -> None:
    """Undo `freeze_startup_heap` and run a full collection, so that whatever a dropped engine
    left in cycles is freed now (Engine.shutdown). The next engine start freezes again."""
    t = time.perf_counter()
    gc.unfreeze()
    found = gc.collect()
    log.debug("%s: the frozen heap released, %d unreachable objects collected (%.0f ms)", what,
              found, (time.perf_counter() - t) * 1e3)
