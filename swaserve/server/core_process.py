"""The EngineCore process: `python -m swaserve.server.core_process --spec JSON`.

The loop (message kinds in `swaserve.server.ipc`):

    while True:
        read every waiting message (block only when there is no work)
        add the requests whose grammars finished compiling (on the compiler thread)
        step once if any request is unfinished
        send the step's outputs with fresh stats and the queue times of the requests it
        scheduled for the first time (also after adds/aborts while idle)

It never waits on HTTP: outputs go out through a PUSH socket without a high-water mark. It
exits when told to (`shutdown`), when the server is gone without a word (its parent process
gone, or for a core on another node its TCP link to node 0 lost: `CoreLoop.server_gone`,
checked every iteration, at least once a second), and, after sending `dead` with the
traceback, on any error inside a step or on a tensor-parallel rank found dead (checked at least
once a second while idle; the frontend then answers 503 and exits). A ValueError while the
core starts (a flag the model or the KV pool cannot take) is sent as its one-line message, not
a traceback. The pipes connect before the model loads (`CorePipes`).

With expert parallelism (`--data-parallel-size D --enable-expert-parallel`) the core is one of
D ranks that step in lockstep: core_loop_ep.py's loop replaces this one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from swaserve.config import EngineConfig
from swaserve.server.ipc import (
    ABORT,
    ADD,
    DEAD,
    OUTPUTS,
    PREFIX_CACHE_RESET,
    READY,
    REJECT,
    RESET_PREFIX_CACHE,
    SHUTDOWN,
    decode,
    encode,
    output_to_wire,
)
from swaserve.server.link_watch import attach

if TYPE_CHECKING:
    from swaserve.engine.core import EngineCore
    from swaserve.engine.request import Request

log = logging.getLogger("swaserve.core")
IDLE_POLL_MS = 1000  # while idle, wake up this often to notice a vanished parent
COMPILE_POLL_MS = 2  # while idle but for grammars compiling: how often to look at them


def core_stats(core: EngineCore) -> dict:
    """What the frontend's /metrics reports: queue lengths, page usage and running totals
    (docs/serving.md, Metrics)."""
    mem = core.memory_stats()
    keep = ("index", "kind", "window", "pages_used")
    mem["groups"] = [{k: g[k] for k in keep} for g in mem["groups"]]
    return {
        "num_running": len(core.scheduler.running),
        "num_waiting": len(core.scheduler.waiting),
        "num_preemptions": getattr(core.scheduler, "num_preemptions", 0),
        "num_parks": getattr(core.scheduler, "num_parks", 0),
        "memory": mem,
    }


def first_scheduled(queued: dict[str, Request], step_start: float) -> list[float]:
    """Queue times (arrival in the core -> the step that first scheduled it) of the requests
    in `queued` that a step starting at `step_start` scheduled; they leave `queued`. Running,
    or finished with a token (scheduled and done within the step), means scheduled; finished
    without one means rejected (never scheduled, no queue time)."""
    from swaserve.engine.request import RequestStatus

    times = []
    for cid, req in list(queued.items()):
        if req.status is RequestStatus.WAITING:
            continue
        del queued[cid]
        if req.status is RequestStatus.RUNNING or req.output_token_ids:
            times.append(max(0.0, step_start - req.arrival_time))
    return times


class CorePipes:
    """The core's two sockets to the frontend, connected first thing, before the model loads:
    a core on another node (TCP pipes) is then linked to node 0 while it loads, so either side
    sees the other go from then on (`link`, server/link_watch.py)."""

    def __init__(self, in_addr: str, out_addr: str) -> None:
        self.ctx = zmq.Context()
        self.inp = self.ctx.socket(zmq.PULL)
        self.inp.setsockopt(zmq.RCVHWM, 0)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)
        self.out.setsockopt(zmq.LINGER, 2000)
        self.link = attach([(self.inp, in_addr), (self.out, out_addr)], bind=False)

    def link_lost(self) -> bool:
        return self.link is not None and self.link.lost()


class CoreLoop:
    def __init__(self, core: EngineCore, pipes: CorePipes) -> None:
        self.core = core
        self.pipes = pipes
        self.ctx, self.inp, self.out = pipes.ctx, pipes.inp, pipes.out
        self.parent = os.getppid()
        self.running = True
        self.queued: dict[str, Request] = {}  # added, not scheduled yet (for queue times)
        # User requests whose grammars compile on the compiler thread (Grammars.compile_async):
        # (their futures, their core requests), added once every future is done.
        self.compiling: list[tuple[list[Future], list]] = []

    def send(self, msg: list) -> None:
        self.out.send(encode(msg))

    def server_gone(self) -> str | None:
        """Why the server is gone without a word, if it is: this process was reparented (the
        server, or node k's launcher, died) or its link to node 0 was lost. The core then exits
        (status 0, as nobody is left to be told: node 0 gone is node k's end too)."""
        if os.getppid() != self.parent:
            return "the server process is gone"
        if self.pipes.link_lost():
            return "the link to node 0's server is lost"
        return None

    def send_ready(self) -> None:
        core = self.core
        self.send(
            [
                READY,
                {
                    "max_model_len": core.max_model_len,
                    "max_num_seqs": core.config.max_num_seqs,  # resolved for the device
                    "context_by_kv_pool": core.context_by_kv_pool,
                    "vocab_size": int(core.hf_config.vocab_size),
                    "pid": os.getpid(),
                    "stats": core_stats(core),
                },
            ]
        )

    def run(self) -> None:
        core = self.core
        self.send_ready()
        while self.running:
            busy = core.has_unfinished()
            changed = self.read_inputs(self.poll_ms(busy))
            changed = self.added_compiled() or changed
            if not self.running:
                break
            gone = self.server_gone()
            if gone:
                log.warning("%s; engine core exits", gone)
                self.out.close(linger=0)  # nobody will read what is still queued
                break
            if not busy:  # a tensor-parallel rank that died while idle: fail now, not later
                core.check_ranks()
            start = time.monotonic()
            outputs = core.step() if core.has_unfinished() else []
            queue_times = first_scheduled(self.queued, start) if self.queued else []
            if outputs or changed or queue_times:
                wire = [output_to_wire(o) for o in outputs]
                self.send([OUTPUTS, wire, core_stats(core), queue_times])

    def poll_ms(self, busy: bool) -> int:
        """How long to wait for a message: not at all while stepping, briefly while grammars
        compile (their requests go in once done), else IDLE_POLL_MS."""
        return 0 if busy else COMPILE_POLL_MS if self.compiling else IDLE_POLL_MS

    def added_compiled(self) -> bool:
        """Adds the requests whose grammars are now compiled, or rejects them (a grammar that
        does not compile); True if any was."""
        done = [e for e in self.compiling if all(f.done() for f in e[0])]
        for entry in done:
            self.compiling.remove(entry)
            futures, children = entry
            failed = next((f.exception() for f in futures if f.exception() is not None), None)
            if failed is not None:
                self.send([REJECT, [c[0] for c in children], str(failed)])
            else:
                self.add(children)
        return bool(done)

    def read_inputs(self, timeout_ms: int) -> bool:
        """Handles every waiting message; waits up to timeout_ms for the first. True if any."""
        if not self.inp.poll(timeout_ms):
            return False
        while True:
            try:
                msg = decode(self.inp.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            kind = msg[0]
            if kind == ADD:
                self.add(msg[1])
            elif kind == ABORT:
                self.core.abort_requests(msg[1])
                self._drop_compiling(set(msg[1]))
                for cid in msg[1]:
                    self.queued.pop(cid, None)
            elif kind == RESET_PREFIX_CACHE:
                self.reset_prefix_cache(msg[1])
            elif kind == SHUTDOWN:
                self.running = False
                return True
            else:
                log.error("unknown message kind %r", kind)

    def reset_prefix_cache(self, seq: int) -> None:
        """Answers `reset_prefix_cache` `seq`: the cache is emptied (EngineCore's) only while
        no request is here, running, waiting, or compiling its grammar (`held`); else nothing
        is dropped and the answer is False. Messages are handled in order, so an abort the
        frontend sent before the reset (a stop string, a client gone) counts as done."""
        ok = not self.held() and self.core.reset_prefix_cache()
        if ok:
            log.info("prefix cache reset")
        else:
            log.info("prefix cache not reset: requests are running or waiting")
        self.send([PREFIX_CACHE_RESET, seq, ok, core_stats(self.core)])

    def held(self) -> bool:
        """Requests this loop holds outside the engine's scheduler (grammars compiling)."""
        return bool(self.compiling)

    def _drop_compiling(self, cids: set[str]) -> None:
        """An aborted request whose grammar still compiles is never added."""
        for entry in list(self.compiling):
            kept = [c for c in entry[1] if c[0] not in cids]
            self.compiling.remove(entry)
            if kept:
                self.compiling.append((entry[0], kept))

    def add(self, children: list) -> None:
        """Adds a user request's core requests: all of them, or none and a `reject`. A grammar
        not compiled yet compiles on the compiler thread first (`added_compiled` adds them
        then), so the running requests keep stepping meanwhile."""
        from swaserve.sampling.params import SamplingParams

        added: list[str] = []
        try:
            parsed = [(cid, ids, SamplingParams.from_dict(p)) for cid, ids, p in children]
            specs = {json.dumps(p.structured_outputs, sort_keys=True): p.structured_outputs
                     for _, _, p in parsed if p.structured_outputs is not None}  # fmt: skip
            futures = [self.core.grammars.compile_async(spec) for spec in specs.values()]
            pending = [f for f in futures if f is not None]
            if pending:
                self.compiling.append((pending, children))
                return
            for _, ids, p in parsed:
                self.core.resolve_max_tokens(len(ids), p)
            for cid, ids, p in parsed:
                self.core.add_request(cid, ids, p)
                added.append(cid)
            for cid in added:
                self.queued[cid] = self.core.requests[cid]
        except (ValueError, TypeError) as e:
            self.core.abort_requests(added)
            self.send([REJECT, [c[0] for c in children], str(e)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spec", required=True, help="JSON: config, folder, in_addr, out_addr")
    spec = json.loads(ap.parse_args(argv).spec)
    logging.basicConfig(
        level=spec.get("log_level", "INFO").upper(),
        format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s",
    )
    # Ctrl-C reaches the whole process group; the frontend decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pipes = CorePipes(spec["in_addr"], spec["out_addr"])
    try:
        from swaserve.engine.core import EngineCore

        config = EngineConfig(**spec["config"])
        if spec.get("cpu_share", 1) > 1 and config.torch_device().type != "cuda":
            from swaserve.distributed.parallel_state import share_cpu_cores

            share_cpu_cores(spec["cpu_share"])  # data-parallel replicas share the cores
        ep = None
        if spec.get("expert_parallel"):  # one data-parallel rank of an expert-parallel group
            from swaserve.server.core_loop_ep import join_group

            ep = join_group(config, spec["expert_parallel"])
        try:
            core = EngineCore(config, Path(spec["folder"]), server=True, ep=ep)
        except ValueError as e:  # a flag the model or the pool cannot take: one line
            log.error("engine core failed: %s", e)
            _last_words(pipes, str(e))
            return 1
        loop_class = CoreLoop
        if ep is not None:  # steps in lockstep with the other ranks
            from swaserve.server.core_loop_ep import EPCoreLoop as loop_class
        if config.disaggregation_mode:  # a PD instance: its side of the pair beside the engine
            from swaserve.disaggregation.core_loop import DisaggCoreLoop as loop_class
        loop_class(core, pipes).run()
        return 0
    except Exception as e:
        tb = traceback.format_exc()
        log.error("engine core failed:\n%s", tb)
        _last_words(pipes, tb, getattr(e, "dp_rank", None))
        return 1


def _last_words(pipes: CorePipes, message: str, blames: int | None = None) -> None:
    """Sends `dead` with `message` and the data-parallel rank it `blames` (RankFailure.dp_rank:
    a peer found gone, whose own last words the server prefers), or None."""
    pipes.out.send(encode([DEAD, message, blames]))
    pipes.out.close(2000)

if __name__ == "__main__":
    sys.exit(main())
