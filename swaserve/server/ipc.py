"""The frontend's link to the EngineCore process: ZMQ IPC sockets carrying msgpack (no pickle).

Two PUSH/PULL pipes, both bound by the frontend (the core connects); IPC on one machine, TCP for
a core on another node (`--nnodes`, server/nodes.py), whose link is then watched from both ends
(server/link_watch.py):

    frontend --[add | abort | reset_prefix_cache | shutdown]--> core        (`in` pipe)
    frontend <--[ready | outputs | reject | prefix_cache_reset | dead]-- core  (`out` pipe)

Every message is a msgpack list whose first item is its kind:

    ["add", [[core_id, prompt_token_ids, SamplingParams.to_dict()], ...]]   all or none
    ["abort", [core_id, ...]]
    ["reset_prefix_cache", seq]                           empty the prefix cache (every tier),
                                                          unless a request runs or waits
    ["shutdown"]
    ["ready", {"max_model_len", "context_by_kv_pool", "vocab_size", "pid", "stats"}]
    ["outputs", [wire(EngineCoreOutput), ...], stats, queue_times]
                         stats: see core_process.core_stats; queue_times: seconds from arrival
                         in the core to first scheduled, of each core request first
                         scheduled since the last message
    ["reject", [core_id, ...], message, status?]          an add the core refused (ValueError;
                                                          status 400), or a PD transfer that
                                                          failed (503)
    ["prefix_cache_reset", seq, ok, stats]                the answer to reset_prefix_cache `seq`
                                                          (ok: it was emptied; False: requests
                                                          ran, nothing dropped) with the stats
                                                          after it
    ["dead", message, blames]                             the core's last words (a traceback,
                                                          or one line for a bad flag at start)
                                                          and the peer data-parallel rank they
                                                          say is gone (or None)

`CoreClient` is the frontend half: it owns the `OutputProcessor` (detokenizing, stop strings),
hands each user request's `RequestOutput`s to that request's asyncio queue, and never waits on
the core: sends never block (unbounded send queue), receives run in their own task. A reset
(`reset_prefix_cache`) is the one call that waits for the core's answer: on a future the
receive task resolves (a reply carries its message's `seq`), never by blocking the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from swaserve.engine.engine import child_params
from swaserve.engine.output_processor import OutputProcessor, make_core_request_ids
from swaserve.outputs import EngineCoreOutput, Logprob, RequestOutput
from swaserve.sampling.params import SamplingParams
from swaserve.server.link_watch import attach

log = logging.getLogger(__name__)

ADD, ABORT, RESET_PREFIX_CACHE, SHUTDOWN = "add", "abort", "reset_prefix_cache", "shutdown"
READY, OUTPUTS, REJECT, DEAD = "ready", "outputs", "reject", "dead"
PREFIX_CACHE_RESET = "prefix_cache_reset"


# ---- wire format ----------------------------------------------------------------------------


def encode(msg: list) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _lp_wire(lp: Logprob | None) -> list | None:
    if lp is None:
        return None
    return [lp.token_id, lp.logprob, lp.rank, [[t, v] for t, v in lp.top]]


def _lp_from(w: list | None) -> Logprob | None:
    if w is None:
        return None
    return Logprob(w[0], w[1], w[2], [(t, v) for t, v in w[3]])


def output_to_wire(o: EngineCoreOutput) -> list:
    return [
        o.request_id,
        o.new_token_ids,
        o.finish_reason,
        o.stop_reason,
        None if o.new_logprobs is None else [_lp_wire(lp) for lp in o.new_logprobs],
        None if o.prompt_logprobs is None else [_lp_wire(lp) for lp in o.prompt_logprobs],
        o.num_cached_tokens,
        o.spec,  # a dict of ints, a float and a list: plain msgpack
    ]


def output_from_wire(w: list) -> EngineCoreOutput:
    rid, ids, finish, stop, lps, plps, cached, spec = w
    return EngineCoreOutput(
        request_id=rid,
        new_token_ids=ids,
        finish_reason=finish,
        stop_reason=stop,
        new_logprobs=None if lps is None else [_lp_from(x) for x in lps],
        prompt_logprobs=None if plps is None else [_lp_from(x) for x in plps],
        num_cached_tokens=cached,
        spec=spec,
    )


# ---- the frontend's client ------------------------------------------------------------------


class CoreUnavailable(Exception):
    """The core process is gone (503)."""


class QueueFull(Exception):
    """More requests than `max_num_seqs + max_queue` would be in flight (503)."""


@dataclass
class RequestFailed:
    """Put on a request's queue instead of a RequestOutput when it cannot go on."""

    message: str
    status: int  # 400: the core refused the request; 503: the core died


@dataclass
class _Timing:
    """Per core request, for the latency metrics."""

    arrival: float
    first: float = 0.0  # when its first token arrived
    last: float = 0.0
    num_tokens: int = 0
    num_prompt_tokens: int = 0
    done: bool = False  # finished (its latency observed) or stopped by a stop string


class CoreClient:
    """Frontend side of the IPC: add/abort requests, route outputs to per-request queues."""

    def __init__(
        self,
        tokenizer: Any,
        in_addr: str,
        out_addr: str,
        max_queue: int,
        metrics: Any = None,
        stream_interval: int = 1,
    ) -> None:
        self.processor = OutputProcessor(tokenizer, stream_interval)
        self.metrics = metrics
        self.max_queue = max_queue
        # core requests: max_num_seqs + max_queue, once the core says its max_num_seqs (its
        # default depends on the device)
        self.max_in_flight = max_queue
        # Sends go through a plain (sync) socket: they never block (no high-water mark), and they
        # work from `finally` blocks of cancelled tasks, where awaiting is not possible.
        self._ctx = zmq.Context()
        self._send = self._ctx.socket(zmq.PUSH)
        self._send.setsockopt(zmq.SNDHWM, 0)
        self._send.setsockopt(zmq.LINGER, 0)
        self._actx = zmq.asyncio.Context()
        self._recv = self._actx.socket(zmq.PULL)
        self._recv.setsockopt(zmq.RCVHWM, 0)
        self._recv.setsockopt(zmq.LINGER, 0)
        # a core on another node (TCP): its link is its liveness (`link_lost`)
        self.link = attach([(self._send, in_addr), (self._recv, out_addr)], bind=True)
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its (or its HTTP call's) queue
        self._core_to_req: dict[str, str] = {}  # live core ids -> request id
        self._req_to_core: dict[str, list[str]] = {}
        self._timing: dict[str, _Timing] = {}
        self.info: dict | None = None  # the core's "ready" message
        self.stats: dict = {}  # latest core stats
        self.dead: str | None = None  # why the core is gone
        self.blames: int | None = None  # the peer rank its last words say is gone (or None)
        self.ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        # reset_prefix_cache calls waiting for the core's answer, by their message's seq
        self._resets: dict[int, asyncio.Future] = {}
        self._reset_seq = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive_loop())

    def endpoints(self) -> tuple[str, str]:
        """The (in, out) addresses bound, with the ports the system picked for `tcp://HOST:*`."""
        return (
            self._send.getsockopt_string(zmq.LAST_ENDPOINT),
            self._recv.getsockopt_string(zmq.LAST_ENDPOINT),
        )

    def link_lost(self) -> bool:
        """A core on another node whose connection closed or stopped answering heartbeats: it
        is gone (launch.py's watchdog). Always False for a core of this machine."""
        return self.link is not None and self.link.lost()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.link is not None:
            self.link.close()
        try:
            self._send.send(encode([SHUTDOWN]), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._send.close(linger=1000)  # let `shutdown` reach a live core
        self._recv.close(linger=0)
        self._ctx.term()
        self._actx.term()

    def fail_all(self, reason: str) -> None:
        """The core is gone: every live request ends with a 503, new ones get CoreUnavailable."""
        if self.dead is None:
            self.dead = reason
        for rid, q in list(self._queues.items()):
            q.put_nowait((rid, RequestFailed(f"engine core died: {reason}", 503)))
            self._forget(rid)
        for fut in self._resets.values():
            if not fut.done():
                fut.set_exception(CoreUnavailable(f"engine core died: {reason}"))
        self._resets.clear()

    # ---- requests -------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._core_to_req)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        stream: bool,
        disagg: dict | None = None,
    ) -> None:
        """Starts a request; its outputs arrive on `queue` as (request_id, RequestOutput) and
        end with one that is `finished` (or a RequestFailed). `disagg`: a PD instance's
        bootstrap fields (swaserve/disaggregation/), sent with each sample and its index."""
        if self.dead is not None:
            raise CoreUnavailable(f"engine core is not running: {self.dead}")
        if self.num_in_flight + params.n > self.max_in_flight:
            raise QueueFull(
                f"the server is at capacity ({self.max_in_flight} sequences in flight, "
                "--max-num-seqs + --max-queue); retry later"
            )
        core_ids = make_core_request_ids(request_id, params.n)
        self.processor.add_request(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            core_ids,
            stream=stream,
            final_only=not stream,
        )
        now = time.monotonic()
        self._queues[request_id] = queue
        self._req_to_core[request_id] = core_ids
        for cid in core_ids:
            self._core_to_req[cid] = request_id
            self._timing[cid] = _Timing(now, num_prompt_tokens=len(prompt_token_ids))
        children = [
            [cid, prompt_token_ids, child_params(params, i).to_dict()]
            + ([{**disagg, "index": i}] if disagg else [])
            for i, cid in enumerate(core_ids)
        ]
        self._send.send(encode([ADD, children]))
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt_token_ids))

    def abort(self, request_id: str) -> None:
        """Stops a request (client gone, error): the core frees its pages. Idempotent."""
        if request_id not in self._queues:
            return
        live = self.processor.abort_request(request_id)
        self._forget(request_id)
        if live and self.dead is None:
            self._send.send(encode([ABORT, live]))
        if self.metrics is not None:
            self.metrics.request_success.labels(finished_reason="abort").inc()

    def is_live(self, request_id: str) -> bool:
        return request_id in self._queues

    async def reset_prefix_cache(self) -> bool:
        """Asks the core to empty its prefix cache (EngineCore.reset_prefix_cache): True once it
        did, False if requests ran or waited there (nothing dropped). Waits on a future the
        receive task resolves; raises CoreUnavailable if the core is or goes away first."""
        if self.dead is not None:
            raise CoreUnavailable(f"engine core is not running: {self.dead}")
        self._reset_seq += 1
        seq = self._reset_seq
        fut = self._resets[seq] = asyncio.get_running_loop().create_future()
        try:
            self._send.send(encode([RESET_PREFIX_CACHE, seq]))
            return await fut
        finally:  # answered, failed, or the HTTP call went away meanwhile
            self._resets.pop(seq, None)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        for cid in self._req_to_core.pop(request_id, []):
            self._core_to_req.pop(cid, None)
            self._timing.pop(cid, None)
        self.processor.abort_request(request_id)

    # ---- receiving ------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            data = await self._recv.recv()
            try:
                self._handle(decode(data))
            except Exception:  # a bug here must not stop the serving of everyone else
                log.exception("error handling a message from the engine core")

    def _handle(self, msg: list) -> None:
        kind = msg[0]
        if kind == OUTPUTS:
            self._on_outputs([output_from_wire(w) for w in msg[1]])
            self._update_stats(msg[2])
            if self.metrics is not None:
                for seconds in msg[3] if len(msg) > 3 else []:
                    self.metrics.queue_time.observe(seconds)
        elif kind == REJECT:
            rids = {self._core_to_req[c] for c in msg[1] if c in self._core_to_req}
            for rid in rids:
                q = self._queues[rid]
                live = self.processor.abort_request(rid)
                self._forget(rid)
                others = [c for c in live if c not in msg[1]]
                if others:
                    self._send.send(encode([ABORT, others]))
                q.put_nowait((rid, RequestFailed(msg[2], msg[3] if len(msg) > 3 else 400)))
        elif kind == PREFIX_CACHE_RESET:
            _, seq, ok, stats = msg
            self._update_stats(stats)  # the cache's pages are gone from /v1/memory at once
            fut = self._resets.pop(seq, None)
            if fut is not None and not fut.done():
                fut.set_result(bool(ok))
        elif kind == READY:
            self.info = msg[1]
            if "max_num_seqs" in self.info:
                self.max_in_flight = self.info["max_num_seqs"] + self.max_queue
            self.stats = msg[1].get("stats", {})
            if self.metrics is not None:
                self.metrics.update_core_stats(self.stats)
            self.ready.set()
        elif kind == DEAD:
            log.error("engine core reported a fatal error:\n%s", msg[1])
            self.blames = msg[2]
            self.fail_all(msg[1].strip().splitlines()[-1] if msg[1].strip() else "unknown error")
            self.ready.set()  # wakes a startup waiting for "ready"

    def _update_stats(self, stats: dict) -> None:
        self.stats = stats
        if self.metrics is not None:
            self.metrics.update_core_stats(stats)

    def _on_outputs(self, outs: list[EngineCoreOutput]) -> None:
        self._observe(outs)
        results, to_abort = self.processor.process(outs)
        if to_abort:
            self._send.send(encode([ABORT, to_abort]))
            now = time.monotonic()
            for cid in to_abort:  # finished by a stop string
                self._observe_finished(cid, now)
        for ro in results:
            q = self._queues.get(ro.request_id)
            if q is None:
                continue
            if ro.finished:
                self._finished(ro)
            q.put_nowait((ro.request_id, ro))

    def _finished(self, ro: RequestOutput) -> None:
        rid = ro.request_id
        self._queues.pop(rid, None)
        for cid in self._req_to_core.pop(rid, []):
            self._core_to_req.pop(cid, None)
            self._timing.pop(cid, None)
        if self.metrics is not None:
            reason = ro.outputs[0].finish_reason if ro.outputs else None
            self.metrics.request_success.labels(finished_reason=reason or "abort").inc()
            if ro.spec_decoding is not None:
                self.metrics.observe_spec(ro.spec_decoding)

    def _observe(self, outs: list[EngineCoreOutput]) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.monotonic()
        for o in outs:
            t = self._timing.get(o.request_id)
            k = len(o.new_token_ids)
            if t is None or t.done:
                continue
            if k:
                m.generation_tokens.inc(k)
                if t.num_tokens == 0:
                    t.first = now
                    m.ttft.observe(now - t.arrival)
                    m.prefix_queries.inc(t.num_prompt_tokens)
                    m.prefix_hits.inc(o.num_cached_tokens)
                else:
                    per_token = (now - t.last) / k
                    for _ in range(k):
                        m.itl.observe(per_token)
                t.last = now
                t.num_tokens += k
            if o.finish_reason is not None:
                self._observe_finished(o.request_id, now, o.finish_reason == "abort")

    def _observe_finished(self, core_id: str, now: float, aborted: bool = False) -> None:
        """E2E latency and TPOT of a sequence that completed (not one aborted)."""
        t = self._timing.get(core_id)
        if self.metrics is None or t is None or t.done:
            return
        t.done = True
        if not aborted and t.num_tokens:
            self.metrics.observe_finished(now - t.arrival, t.first - t.arrival, t.num_tokens)
