"""The decode instance's side of a PD pair (DESIGN §9.3), inside its engine core process.

A sample's life here (key = bootstrap id . prompt . sample, bootstrap.py):

    waiting    created in the engine but out of its queues, until its pages fit (first in,
               first out, within --max-num-seqs; the frontend's --max-queue bounds how many
               wait): reserve.py takes the whole prompt's pages (window-aware, prefix hit
               attached), then `reserve` goes to the prefill instance
    reserved   waits for the notice (the pages have landed): the first token, its logprobs,
               prompt logprobs and the seeded generator's state become the request's, and it
               joins the running requests at position P like one that computed its prompt
    cancelling the frontend gave up: `cancel` went to the prefill side; the pages stay until
               it answers (its write may still be landing in them) or the timeout passes

Failures give the frontend a 503 with the reason: a `failed` from the prefill side (its write
is final: the pages go at once), or no notice within `timeout_s` (then as a cancel: the pages
wait for the prefill side's answer or one more timeout, never freed under a write).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from swaserve.disaggregation import bootstrap as B
from swaserve.disaggregation import reserve as R
from swaserve.disaggregation.transfer import TransferBackend
from swaserve.disaggregation.transfer_stats import TransferStats
from swaserve.engine.request import Request, RequestStatus
from swaserve.outputs import EngineCoreOutput
from swaserve.sampling.params import SamplingParams
from swaserve.server.ipc import output_from_wire, output_to_wire

log = logging.getLogger(__name__)

Reject = tuple[list[str], str, int]


@dataclass
class _Sample:
    key: str
    cid: str
    req: Request
    peer: str  # the prefill core's bootstrap address
    state: str = "waiting"  # waiting | reserved | cancelling
    deadline: float = 0.0
    reserved_at: float = 0.0


class DecodeSide:
    def __init__(
        self,
        core: Any,
        backend: TransferBackend,
        bootstrap: B.Bootstrap,
        descriptor: bytes,
        timeout_s: float,
    ) -> None:
        self.core = core
        self.backend = backend
        self.bootstrap = bootstrap
        self.descriptor = descriptor
        self.timeout_s = timeout_s
        self.samples: dict[str, _Sample] = {}  # by key, in arrival order
        self.by_cid: dict[str, str] = {}
        self.stats = TransferStats()
        self.outputs: list[list] = []
        self.rejects: list[Reject] = []

    # ---- from the frontend ---------------------------------------------------------------

    def add(self, cid: str, ids: list[int], params: SamplingParams, key: str, peer: str) -> None:
        if key in self.samples:
            raise ValueError(f"bootstrap key {key!r} is already in use")
        core = self.core
        core.add_request(cid, ids, params)
        req = core.requests[cid]
        core.scheduler.waiting.remove(req)  # it runs once its K/V has landed
        self.samples[key] = _Sample(key, cid, req, peer)
        self.by_cid[cid] = key

    def abort(self, cids: list[str]) -> list[str]:
        """The frontend's aborts; returns the core ids that are not this side's."""
        rest = []
        for cid in cids:
            key = self.by_cid.get(cid)
            if key is None:
                rest.append(cid)
                continue
            s = self.samples[key]
            if s.state == "waiting":
                self._drop(s)
            elif s.state == "reserved":  # the write may be landing: keep the pages for now
                self._cancel(s)
        return rest

    def _cancel(self, s: _Sample) -> None:
        s.state = "cancelling"
        s.deadline = time.monotonic() + self.timeout_s
        self.bootstrap.send(s.peer, [B.CANCEL, s.key])

    def filter_outputs(self, wires: list[list]) -> list[list]:
        return wires

    def hold(self, req: Request) -> bool:
        return False

    # ---- the loop --------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(self.samples)

    def poll(self) -> None:
        self._reserve_waiting()
        for sender, data in self.backend.notifications():
            try:
                msg = B.decode(data)
            except Exception:
                log.error("undecodable notification from %s", sender)
                continue
            if msg and msg[0] == B.NOTICE:
                self._landed(msg)
        for msg in self.bootstrap.receive():
            if msg[0] == B.FAILED:
                self._failed(msg[1], msg[2])
        now = time.monotonic()
        for s in list(self.samples.values()):
            if s.state == "reserved" and now > s.deadline:
                # The client hears now; the pages wait for the prefill side's answer to the
                # cancel (a late write may still land in them) or another timeout.
                self.stats.failed()
                msg = f"no KV from the prefill instance within {self.timeout_s:g} s"
                self.rejects.append(([s.cid], msg, 503))
                self._cancel(s)
            elif s.state == "cancelling" and now > s.deadline:
                self._drop(s)

    def _reserve_waiting(self) -> None:
        core = self.core
        reserved = sum(s.state != "waiting" for s in self.samples.values())
        for s in list(self.samples.values()):
            if s.state != "waiting":
                continue
            if len(core.scheduler.running) + reserved >= core.config.max_num_seqs:
                return
            if not R.reserve(core.scheduler, s.req):
                return  # first in, first out: the next ones wait behind it
            reserved += 1
            if core.cache is not None:
                core.cache.move_pages()  # copy-on-write of a shared page, before any write
                if core.device.type == "cuda":
                    torch.cuda.current_stream(core.device).synchronize()
            s.state, s.reserved_at = "reserved", time.monotonic()
            s.deadline = s.reserved_at + self.timeout_s
            tables = core.memory.page_table(s.cid)
            self.bootstrap.send(s.peer, [
                B.RESERVE, s.key, self.bootstrap.address, self.backend.name, self.descriptor,
                tables, s.req.num_cached_tokens,
            ])

    def _landed(self, msg: list) -> None:
        _, key, wire, gen_state, num_pages, num_bytes = msg
        s = self.samples.get(key)
        if s is None or s.state == "waiting":
            return
        if s.state == "cancelling":
            self._drop(s)
            return
        self.stats.done(num_pages, num_bytes, time.monotonic() - s.reserved_at)
        self.samples.pop(key)
        self.by_cid.pop(s.cid, None)
        self.outputs.append(output_to_wire(self._continue(s.req, output_from_wire(wire),
                                                          gen_state)))

    def _continue(self, req: Request, first: EngineCoreOutput, gen_state: bytes | None
                  ) -> EngineCoreOutput:
        """The prefill side's first token becomes this request's: it runs on from P."""
        core = self.core
        token = first.new_token_ids[0]
        req.output_token_ids = [token]
        req.num_computed_tokens = req.num_prompt_tokens
        if gen_state is not None and req.generator is not None:
            req.generator.set_state(torch.frombuffer(bytearray(gen_state), dtype=torch.uint8))
        out = EngineCoreOutput(req.request_id, [token], num_cached_tokens=first.num_cached_tokens)
        k = req.params.logprobs
        if k is not None and first.new_logprobs:
            lp = first.new_logprobs[0]
            lp.top = lp.top[:k]
            out.new_logprobs = [lp]
        req.prompt_logprobs_sent = True
        out.prompt_logprobs = first.prompt_logprobs
        out.finish_reason, out.stop_reason = core._stop_rule(req, token, 1)
        if out.finish_reason is not None:
            core.scheduler._release(req)  # the prompt's pages enter this side's cache
            req.status = RequestStatus.FINISHED
            core._forget(req)
        else:
            core.scheduler.run(req)
        return out

    def _failed(self, key: str, message: str) -> None:
        s = self.samples.get(key)
        if s is None:
            return
        if s.state == "cancelling":
            self._drop(s)
            return
        self.stats.failed()
        self._drop(s, f"prefill instance: {message}")

    def _drop(self, s: _Sample, error: str | None = None) -> None:
        """Release a sample's reservation (never computed: only its cached prefix stays) and
        forget it; with `error`, the frontend fails the request with a 503."""
        self.samples.pop(s.key, None)
        self.by_cid.pop(s.cid, None)
        if s.state != "waiting":
            R.release(self.core.scheduler, s.req)
        s.req.status = RequestStatus.FINISHED
        self.core._forget(s.req)
        if error is not None:
            self.rejects.append(([s.cid], error, 503))

    def close(self) -> None:
        self.backend.close()
        self.bootstrap.close()
