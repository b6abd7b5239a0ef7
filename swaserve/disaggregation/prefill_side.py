"""The prefill instance's side of a PD pair (DESIGN §9.3), inside its engine core process.

A sample's life here (key = bootstrap id . prompt . sample, bootstrap.py):

    added by the frontend  --+
                             +--> both known: computed by the engine like any request, with
    reservation from decode -+    max_tokens 1; its first token finishes it, but `hold` keeps
                                  its pages (EngineCore._finish asks) and its output is
                                  withheld; the pages to send (pages_to_send.py) are written
                                  into the reservation with the notice; then the pages are
                                  released and the output goes to the frontend (done), or
                                  `failed` goes to the decode side and the frontend gets a 503

The two halves may arrive in either order; either waits at most `timeout_s` for the other.
The engine runs without the overlap schedule here (launch): the seeded generator's state is
read right after the first token's draw, before any other step could draw again.
Pages are released only once the write is final (done or failed), never while the transfer
could still read them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from swaserve.disaggregation import bootstrap as B
from swaserve.disaggregation.pages_to_send import pages_to_send
from swaserve.disaggregation.transfer import TransferBackend
from swaserve.disaggregation.transfer_stats import TransferStats
from swaserve.engine.request import Request, RequestStatus
from swaserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)

Reject = tuple[list[str], str, int]  # (core ids, message, HTTP status) for the frontend


@dataclass
class _Sample:
    key: str
    deadline: float
    cid: str | None = None  # the frontend's core request id, once added
    ids: list[int] | None = None
    params: SamplingParams | None = None
    reservation: list | None = None  # the decode side's `reserve` message
    req: Request | None = None  # once computing
    gen_state: bytes | None = None
    held: bool = False  # computed; its pages kept until the write is final
    handle: int | None = None
    started: float = 0.0
    out: list | None = None  # the withheld first-token output (wire)
    num_pages: int = 0
    num_bytes: int = 0
    aborted: bool = False  # the frontend gave up on it: no output
    cancelled: bool = False  # the decode side gave up: ack once the write is final


class PrefillSide:
    def __init__(
        self, core: Any, backend: TransferBackend, bootstrap: B.Bootstrap, timeout_s: float
    ) -> None:
        self.core = core
        self.backend = backend
        self.bootstrap = bootstrap
        self.timeout_s = timeout_s
        self.samples: dict[str, _Sample] = {}  # by key
        self.by_cid: dict[str, str] = {}
        self.peers: dict[str, bytes] = {}  # decode backend name -> descriptor connected
        self.stats = TransferStats()
        self.outputs: list[list] = []  # for the frontend, in order
        self.rejects: list[Reject] = []
        page_bytes = core.kv.pages[0].numel() * core.kv.pages.element_size()
        self.page_bytes = page_bytes

    # ---- from the frontend ---------------------------------------------------------------

    def add(self, cid: str, ids: list[int], params: SamplingParams, key: str) -> None:
        s = self.samples.get(key)
        if s is None:
            s = self.samples[key] = _Sample(key, time.monotonic() + self.timeout_s)
        elif s.cid is not None:
            raise ValueError(f"bootstrap key {key!r} is already in use")
        s.cid, s.ids, s.params = cid, ids, params
        s.deadline = time.monotonic() + self.timeout_s
        self.by_cid[cid] = key
        if s.reservation is not None:
            self._start(s)

    def abort(self, cids: list[str]) -> list[str]:
        """The frontend's aborts; returns the core ids that are not this side's."""
        rest = []
        for cid in cids:
            key = self.by_cid.get(cid)
            if key is None:
                rest.append(cid)
                continue
            s = self.samples[key]
            s.aborted = True
            if s.handle is not None:
                continue  # the write finishes (or fails) first; then pages go
            if s.req is not None and not s.held:
                self.core.abort_requests([cid])
            self._fail(s, "the prefill request was aborted", tell_frontend=False)
        return rest

    # ---- the engine's hook -----------------------------------------------------------------

    def hold(self, req: Request) -> bool:
        """EngineCore._finish: keep a computed sample's pages (True), or let it go (False)."""
        key = self.by_cid.get(req.request_id)
        s = self.samples.get(key) if key is not None else None
        if s is None or s.req is not req or req.status is not RequestStatus.RUNNING:
            return False
        self.core.scheduler.running.remove(req)
        req.status = RequestStatus.FINISHED
        self.core._forget(req)
        if req.generator is not None:
            s.gen_state = bytes(req.generator.get_state().numpy().tobytes())
        s.held = True
        return True

    def filter_outputs(self, wires: list[list]) -> list[list]:
        """The step's outputs for the frontend: held samples' first tokens are withheld (and
        their writes start); a sample the engine aborted fails."""
        keep = []
        for w in wires:
            key = self.by_cid.get(w[0])
            s = self.samples.get(key) if key is not None else None
            if s is None:
                keep.append(w)
            elif s.held and s.handle is None and s.out is None:
                s.out = w
                self._write(s)
            elif w[2] == "abort":  # the engine dropped it (it can never fit)
                self._fail(s, "the prefill instance aborted the request", tell_frontend=False)
                keep.append(w)
            else:
                keep.append(w)
        return keep

    # ---- from the decode side and the transfer ---------------------------------------------

    def poll(self) -> None:
        for msg in self.bootstrap.receive():
            if msg[0] == B.RESERVE:
                self._reserved(msg)
            elif msg[0] == B.CANCEL:
                self._cancel(msg[1])
        now = time.monotonic()
        for s in list(self.samples.values()):
            if s.handle is not None:
                self._poll_write(s)
            elif s.req is None and now > s.deadline:
                why = (
                    "no reservation from the decode instance"
                    if s.reservation is None
                    else "the request never reached the prefill instance"
                )
                self._fail(s, f"{why} within {self.timeout_s:g} s")

    def busy(self) -> bool:
        return bool(self.samples)

    def _reserved(self, msg: list) -> None:
        _, key, addr, name, descriptor, _tables, _cached = msg
        s = self.samples.get(key)
        if s is None:
            s = self.samples[key] = _Sample(key, time.monotonic() + self.timeout_s)
        if s.reservation is not None:
            return
        s.reservation = msg
        try:
            if self.peers.get(name) != descriptor:
                self.backend.connect(name, descriptor)
                self.peers[name] = descriptor
        except Exception as e:  # a peer we cannot write to: its request fails at once
            log.error("cannot connect to decode instance %s: %s", name, e)
            self._fail(s, f"cannot connect to the decode instance: {e}")
            return
        if s.cid is not None:
            self._start(s)

    def _cancel(self, key: str) -> None:
        s = self.samples.get(key)
        if s is None:  # nothing here (done, failed or never seen): ack
            return
        s.cancelled = True
        if s.handle is not None:
            return  # acked once the write is final
        if s.req is not None and not s.held:
            self.core.abort_requests([s.cid])
        self._fail(s, "cancelled by the decode instance")

    # ---- steps -----------------------------------------------------------------------------

    def _start(self, s: _Sample) -> None:
        try:
            self.core.add_request(s.cid, s.ids, s.params)
        except ValueError as e:
            self._fail(s, str(e), status=400)
            return
        s.req = self.core.requests[s.cid]
        s.req.max_tokens = 1  # the decode side makes the rest

    def _write(self, s: _Sample) -> None:
        _, key, addr, name, _, tables, cached = s.reservation
        req = s.req
        try:
            pairs = pages_to_send(
                self.core.layout, self.core.config.page_size, req.num_prompt_tokens,
                self.core.memory.page_table(req.request_id), tables, cached,
            )
            s.num_pages = len(pairs)
            s.num_bytes = len(pairs) * self.page_bytes
            notice = B.encode([B.NOTICE, key, s.out, s.gen_state, s.num_pages, s.num_bytes])
            s.started = time.monotonic()
            s.handle = self.backend.write_pages(
                name, [p for p, _ in pairs], [d for _, d in pairs], notice, self.timeout_s
            )
        except Exception as e:
            log.error("KV write for %s failed to start: %s", key, e)
            self._fail(s, f"the KV transfer could not start: {e}")
            return
        self._poll_write(s)

    def _poll_write(self, s: _Sample) -> None:
        state = self.backend.poll(s.handle)
        if state == "pending":
            return
        error = self.backend.error(s.handle)
        self.backend.release(s.handle)
        s.handle = None
        if state == "done":
            self.stats.done(s.num_pages, s.num_bytes, time.monotonic() - s.started)
            self._release(s)
            if not s.aborted:
                self.outputs.append(s.out)
            if s.cancelled:
                self.bootstrap.send(s.reservation[2], [B.FAILED, s.key, "cancelled"])
        else:
            log.error("KV write for %s failed: %s", s.key, error)
            self._fail(s, f"the KV transfer to the decode instance failed: {error}")

    def _fail(self, s: _Sample, message: str, status: int = 503,
              tell_frontend: bool = True) -> None:
        """Drop a sample wherever it is: pages released, the decode side told (if it
        reserved), the frontend given an error (unless it is the one that gave up)."""
        if s.reservation is not None or s.req is not None:
            self.stats.failed()
        self._release(s)
        if s.reservation is not None:
            self.bootstrap.send(s.reservation[2], [B.FAILED, s.key, message])
        if tell_frontend and not s.aborted and s.cid is not None:
            self.rejects.append(([s.cid], message, status))

    def _release(self, s: _Sample) -> None:
        """Forget the sample; a held one's pages go back (the cache keeps what it computed)."""
        self.samples.pop(s.key, None)
        if s.cid is not None:
            self.by_cid.pop(s.cid, None)
        if s.held and s.req is not None:
            self.core.scheduler._release(s.req)
            s.held = False

    def close(self) -> None:
        self.backend.close()
        self.bootstrap.close()
