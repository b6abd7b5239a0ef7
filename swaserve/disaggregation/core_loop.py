"""The engine core's loop on a PD instance (`--disaggregation-mode prefill|decode`).

It is server/core_process.py's loop with one side object (prefill_side.py or decode_side.py)
beside the engine:

    - `add` messages whose samples carry a bootstrap key (the 4th item of each sample, from
      the router's headers) go to the side; others are served as on any instance;
    - `abort`s go to the side first (it owns its samples until they run in the engine);
    - `reset_prefix_cache` empties this instance's own cache, as on any instance, but only
      while the side holds no sample (`held`): a decode reservation locks the hit it counted
      on, a held prefill sample's pages are still in the tree;
    - every iteration the side reads its peers' messages and transfer notifications, moves
      reservations and writes along, and its outputs and rejects go to the frontend; while it
      has samples the loop polls every POLL_MS instead of sleeping up to a second;
    - outgoing `outputs` pass through the side (the prefill side withholds first tokens until
      their pages are sent) and carry its transfer counters (`stats["kv_transfer"]`); `ready`
      carries what the router needs: mode, bootstrap address, transfer backend.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import zmq

from swaserve.disaggregation import bootstrap as B
from swaserve.disaggregation.transfer import create_transfer_backend
from swaserve.server.core_process import CoreLoop, CorePipes, core_stats
from swaserve.server.ipc import (
    ABORT,
    ADD,
    OUTPUTS,
    PREFIX_CACHE_RESET,
    READY,
    REJECT,
    RESET_PREFIX_CACHE,
    SHUTDOWN,
    decode,
)

log = logging.getLogger(__name__)
POLL_MS = 2
BOOTSTRAP_HOST_ENV = "SWASERVE_BOOTSTRAP_HOST"  # where the bootstrap socket binds
# Tests: MemoryManager.check_integrity() after every step and every move of the side (a
# broken invariant kills the core with its traceback).
CHECK_ENV = "SWASERVE_CHECK_INTEGRITY"


def build_side(core: Any) -> Any:
    """The side object of this core's --disaggregation-mode, its transfer backend registered
    on the KV pool and its bootstrap socket bound."""
    config = core.config
    mode = config.disaggregation_mode
    name = f"{mode}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    backend = create_transfer_backend(config.disaggregation_transfer_backend, name)
    descriptor = backend.register(core.kv.pages, core.layout)
    boot = B.Bootstrap(os.environ.get(BOOTSTRAP_HOST_ENV, "127.0.0.1"))
    timeout = config.disaggregation_timeout
    if mode == "prefill":
        from swaserve.disaggregation.prefill_side import PrefillSide

        side = PrefillSide(core, backend, boot, timeout)
        core.disagg = side  # EngineCore._finish asks it to hold computed samples
    else:
        from swaserve.disaggregation.decode_side import DecodeSide

        side = DecodeSide(core, backend, boot, descriptor, timeout)
    log.info("disaggregation: %s instance, %s transfer backend %s, bootstrap %s", mode,
             config.disaggregation_transfer_backend, name, boot.address)
    return side


class DisaggCoreLoop(CoreLoop):
    def __init__(self, core: Any, pipes: CorePipes) -> None:
        super().__init__(core, pipes)
        self.side = build_side(core)
        self.poller = zmq.Poller()
        self.poller.register(self.inp, zmq.POLLIN)
        self.poller.register(self.side.bootstrap.inbox, zmq.POLLIN)
        self.check = os.environ.get(CHECK_ENV) == "1"

    def info(self) -> dict:
        c = self.core.config
        return {
            "mode": c.disaggregation_mode,
            "bootstrap": self.side.bootstrap.address,
            "transfer_backend": c.disaggregation_transfer_backend,
            "backend_name": self.side.backend.name,
            "page_size": c.page_size,
        }

    def send(self, msg: list) -> None:
        if msg[0] == OUTPUTS:
            msg[1] = self.side.filter_outputs(msg[1])
            msg[2]["kv_transfer"] = self.side.stats.report()
        elif msg[0] == READY:
            msg[1]["disaggregation"] = self.info()
            msg[1]["stats"]["kv_transfer"] = self.side.stats.report()
        elif msg[0] == PREFIX_CACHE_RESET:
            msg[3]["kv_transfer"] = self.side.stats.report()
        super().send(msg)

    def held(self) -> bool:
        """Samples the side owns (waiting for their other half, computed and held until their
        pages are sent, reserved for pages on their way here): the cache is not reset under
        them (a decode reservation may count on cached pages; a held prefill sample's pages
        are still in the tree)."""
        return super().held() or self.side.busy()

    def read_inputs(self, timeout_ms: int) -> bool:
        if self.side.busy():
            timeout_ms = min(timeout_ms, POLL_MS)
        changed = False
        if self.poller.poll(timeout_ms):
            while self.running:
                try:
                    msg = decode(self.inp.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                changed = True
                kind = msg[0]
                if kind == ADD:
                    self.add(msg[1])
                elif kind == ABORT:
                    rest = self.side.abort(msg[1])
                    self.core.abort_requests(rest)
                    for cid in msg[1]:
                        self.queued.pop(cid, None)
                elif kind == RESET_PREFIX_CACHE:  # this instance's own cache (CoreLoop's)
                    self.reset_prefix_cache(msg[1])
                elif kind == SHUTDOWN:
                    self.running = False
                else:
                    log.error("unknown message kind %r", kind)
        if self.running:
            changed |= self.pump()
        if self.check:
            self.core.memory.check_integrity()
        return changed

    def pump(self) -> bool:
        """Let the side work; send what it has for the frontend. True if it had anything or
        pages moved (the frontend's stats are then sent fresh)."""
        side = self.side
        free = self.core.memory.pool.num_free
        side.poll()
        outputs, side.outputs = side.outputs, []
        rejects, side.rejects = side.rejects, []
        for cids, message, status in rejects:
            for cid in cids:
                self.queued.pop(cid, None)
            self.send([REJECT, cids, message, status])
        if outputs:
            self.send([OUTPUTS, outputs, core_stats(self.core), []])
        return bool(outputs or rejects) or free != self.core.memory.pool.num_free

    def add(self, children: list) -> None:
        plain = [c for c in children if len(c) < 4 or not c[3]]
        if plain:
            super().add(plain)
        disagg = [c for c in children if len(c) >= 4 and c[3]]
        if not disagg:
            return
        from swaserve.sampling.params import SamplingParams

        added: list[str] = []
        try:
            parsed = [(cid, ids, SamplingParams.from_dict(p), d) for cid, ids, p, d in disagg]
            for _, ids, p, _ in parsed:
                self.core.resolve_max_tokens(len(ids), p)
            mode = self.core.config.disaggregation_mode
            for cid, ids, p, d in parsed:
                key = B.request_key(d["bootstrap"], d["index"])
                if mode == "prefill":
                    self.side.add(cid, ids, p, key)
                else:
                    if not d.get("peer"):
                        raise ValueError(f"a decode instance needs the {B.PEER_HEADER} header")
                    self.side.add(cid, ids, p, key, d["peer"])
                added.append(cid)
        except (ValueError, TypeError) as e:
            self.side.abort(added)
            self.send([REJECT, [c[0] for c in disagg], str(e)])

    def close(self) -> None:
        self.side.close()
