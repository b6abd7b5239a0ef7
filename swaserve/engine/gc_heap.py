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
    """Collect once, then move every object alive into the collector's permanent generation
    (`gc.freeze`): later collections skip them. Objects frozen by an earlier call (another
    engine started before in this process) are unfrozen first, so that this collection
    reclaims what that one left behind; a frozen object that becomes cyclic garbage is only
    reclaimed at such a call."""
    t = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.debug("%s: %d start-up objects frozen for the garbage collector (%.0f ms)", what,
              gc.get_freeze_count(), (time.perf_counter() - t) * 1e3)
