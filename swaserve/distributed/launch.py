"""Starting the tensor-parallel ranks, watching them, stopping them.

Rank 0 is the process that runs the EngineCore (the offline caller, or the server's core
process). It hosts the rendezvous store, spawns this node's other ranks (torch.multiprocessing,
spawn; each runs `worker.worker_main`), waits until every rank has reached the store, then joins
the groups. On another node (`--node-rank k`), `run_node` spawns that node's ranks and waits.

A rank that dies takes the engine down with `RankFailure` naming it, never a hang: every call
rank 0 makes through `guard()` first checks that the local workers live, and a collective that
fails (gloo reports a vanished peer at once) is re-raised as the failure of the rank found dead.
A watchdog thread logs a death when it happens and, on CUDA, aborts the groups so that an NCCL
collective in flight fails instead of waiting for its timeout. Workers are daemons: they go with
their parent, and a worker whose rank 0 vanished fails its next wait and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from swaserve.config import EngineConfig
from swaserve.distributed.nccl_guard import apply_nccl_guard
from swaserve.distributed.parallel_state import (
    RENDEZVOUS_TIMEOUT,
    TPGroup,
    open_store,
    share_cpu_cores,
)

log = logging.getLogger(__name__)
DEATH_GRACE_S = 2.0  # after a failed collective: how long a dying worker may take to exit
STOP_TIMEOUT_S = 5.0


class RankFailure(RuntimeError):
    """A tensor- or data-parallel rank died or failed; the engine cannot continue. `dp_rank`:
    the data-parallel rank of a process found gone that is not this core's own child (a peer
    core or its worker, watched by pid): how it ended is that core's to say, so the server
    prefers its last words (server/launch.py `_first_gone`); None when the cause is first-hand
    or unknown."""

    def __init__(self, message: str, dp_rank: int | None = None) -> None:
        super().__init__(message)
        self.dp_rank = dp_rank


def ready_key(rank: int) -> str:
    """The store key a rank sets once it reached the rendezvous."""
    return f"swaserve/tp_ready/{rank}"


def rendezvous_address(config: EngineConfig) -> tuple[str, int]:
    """(host, port) of --dist-init-addr; without it, a free port on loopback (one machine)."""
    if config.dist_init_addr:
        host, _, port = config.dist_init_addr.rpartition(":")
        return host.strip("[]"), int(port)
    return "127.0.0.1", 0  # rank 0's store picks a free port


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """cuda:<first + local rank> on CUDA (rank 0 included), first the index --device names (a
    data-parallel replica's first GPU; 0 for `cuda`), else the CPU."""
    device = config.torch_device()
    if device.type != "cuda":
        return device
    first = device.index or 0
    return torch.device("cuda", first + rank % (config.tensor_parallel_size // config.nnodes))


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "is not responding"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}" + (" (its error is in the log above)" if code else "")


def spawn_ranks(
    config: EngineConfig,
    folder: Path,
    host: str,
    port: int,
    ranks: range,
    target: Callable[[int, str], None] | None = None,
    kind: str = "tp",
    expert_parallel: dict | None = None,
) -> dict[int, Any]:
    """Start `ranks` as daemon processes running `target(rank, spec)` (default: the tensor-
    parallel worker; spawn: a fresh interpreter, which imports the main script again, so a
    script that builds an Engine keeps its top level under `if __name__ == "__main__":`). Their
    start-up message is JSON, as every one in swaserve; on CPU each takes the intra-op thread
    count this process has (`threads`: its share of the cores, set before). `expert_parallel`:
    the tensor-parallel workers' place in an expert-parallel world (ep_tp.py), or None."""
    if target is None:
        from swaserve.distributed.worker import worker_main as target

    spec = json.dumps({
        "config": dataclasses.asdict(config), "folder": str(folder), "host": host, "port": port,
        "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
        "threads": torch.get_num_threads(), "expert_parallel": expert_parallel,
    })  # fmt: skip
    ctx = mp.get_context("spawn")
    procs = {}
    for rank in ranks:
        p = ctx.Process(
            target=target, args=(rank, spec), daemon=True, name=f"swaserve-{kind}-rank{rank}"
        )
        p.start()
        procs[rank] = p
    return procs


def watch_for_failure(polls: list[Callable[[], RankFailure | None]]) -> RankFailure | None:
    """After a failed collective: the first failure one of `polls` (each one look, no wait)
    finds within DEATH_GRACE_S (a vanished peer fails gloo's wait before its process is
    reaped), trying them in order each time; None if none does."""
    deadline = time.monotonic() + DEATH_GRACE_S
    while True:
        for poll in polls:
            failure = poll()
            if failure is not None:
                return failure
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


@contextlib.contextmanager
def naming_dead_ranks(explain: Callable[[], RankFailure | None]) -> Iterator[None]:
    """Around a collective: a RuntimeError that a dead rank caused (`explain` finds it) is
    re-raised as the RankFailure naming that rank; any other error passes unchanged."""
    try:
        yield
    except RankFailure:
        raise
    except RuntimeError as e:
        failure = explain()
        if failure is None:
            raise
        raise failure from e


class TensorParallel:
    """Rank 0's handle on the ranks: the group, this node's worker processes, their watch."""

    def __init__(
        self,
        tp: TPGroup,
        procs: dict[int, Any],
        store: Any,
        threads: int,
        role: str = "tensor-parallel",
        remote: range = range(0),
    ) -> None:
        self.tp = tp
        self.role = role  # how errors name the ranks ("data-parallel" for expert parallelism)
        self.procs = procs
        self.remote = remote  # ranks on other nodes (--nnodes): no process handle to watch
        self.store = store  # rank 0 hosts it: kept alive as long as the ranks are
        self.failure: str | None = None
        # Under expert parallelism with -tp (ep_tp.py): watches (with `poll`) of the other
        # processes of the expert-parallel world, asked with this group's own workers, so that a
        # worker that failed because another data-parallel rank died does not hide that death.
        self.peer_watches: list[Any] = []
        self._down: RankFailure | None = None  # `failed`: the failure every check raises
        self._stopping = _Stopping(threads=threads)
        threading.Thread(
            target=_watchdog,
            args=(tp, procs, self._stopping, role),
            daemon=True,
            name="swaserve-tp-watch",
        ).start()
        # Stop the workers when the engine goes away (or at exit), whoever forgets to.
        self._finalizer = weakref.finalize(self, _stop, tp, procs, self._stopping)

    def check(self) -> None:
        """RankFailure if a rank died (now or before)."""
        failure = self._down or self.poll()
        if failure is not None:
            raise failure

    def poll(self, killed_only: bool = False) -> RankFailure | None:
        """One look: the failure of a worker found dead (now or before), else None.
        `killed_only`: only one killed by a signal (a cause, where a worker that exited may
        have failed because of another's death)."""
        if self.failure is None:
            for rank, p in self.procs.items():
                if not p.is_alive() and (not killed_only or (p.exitcode or 0) < 0):
                    self.failure = f"{self.role} rank {rank} (pid {p.pid}) " + _exit_reason(
                        p.exitcode
                    )
                    break
        return None if self.failure is None else RankFailure(self.failure + CANNOT_CONTINUE)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around every exchange with the workers: a failure names the rank."""
        self.check()
        with naming_dead_ranks(self.explain):
            yield

    def explain(self) -> RankFailure | None:
        """After an error: the failure of a rank found dead within DEATH_GRACE_S, among this
        group's workers and the processes of `peer_watches`, one killed by a signal first; with
        every local rank alive and ranks on other nodes, those (whose death this node cannot
        see but through the failed collective); else None."""
        watches = [*self.peer_watches, self]

        def first(killed_only: bool) -> RankFailure | None:
            return next((f for w in watches if (f := w.poll(killed_only)) is not None), None)

        failure = watch_for_failure([lambda: first(True), lambda: first(False)])
        if failure is not None:
            self.failed(failure)
            return failure
        if not self.remote:
            return None
        self.failure = remote_ranks_failed(self.role, self.remote)
        return RankFailure(self.failure + CANNOT_CONTINUE)

    def failed(self, failure: RankFailure) -> None:
        """The ranks cannot continue (`failure`, found here or by the caller): every later
        check raises it, and shutdown terminates the workers instead of sending STOP (they may
        wait in any collective, where a STOP would wait with them)."""
        self._down = self._down or failure
        self._stopping.graceful = False

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers and drop the groups: STOP, then terminate whoever lingers; not
        `graceful` (rank 0 failed while starting, or the ranks `failed`: the workers may wait
        in any collective): terminate them."""
        self._stopping.graceful = self._stopping.graceful and graceful
        self._finalizer()


CANNOT_CONTINUE = "; the engine cannot continue"


def remote_ranks_failed(role: str, ranks: list[int] | range) -> str:
    """A collective failed and every rank on this node lives: the ranks on other nodes, whose
    processes this node cannot see, are named (their node's log says which failed and how)."""
    lo, hi = min(ranks), max(ranks)
    where = f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"
    if len(ranks) != hi - lo + 1:
        where = "ranks " + ", ".join(str(r) for r in sorted(ranks))
    return (
        f"a collective with {role} {where} on other nodes failed (a node is gone or "
        "unreachable, or its ranks failed: see its log)"
    )


@dataclasses.dataclass
class _Stopping:
    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    graceful: bool = True
    threads: int = 0  # this process's torch threads before the ranks shared the cores

    def is_set(self) -> bool:
        return self.event.is_set()


def _watchdog(
    tp: TPGroup, procs: dict[int, Any], stopping: _Stopping, role: str = "tensor-parallel"
) -> None:
    """Logs a worker's death as it happens; on CUDA aborts the groups, so that an NCCL
    collective waiting for the dead rank fails now instead of at its timeout."""
    sentinels = {p.sentinel: rank for rank, p in procs.items()}
    while sentinels and not stopping.is_set():
        for s in wait_sentinels(list(sentinels), timeout=1.0):
            rank = sentinels.pop(s)
            if stopping.is_set():
                return
            p = procs[rank]
            p.join(0.1)
            log.error("%s rank %d (pid %d) %s", role, rank, p.pid, _exit_reason(p.exitcode))
            if tp.device.type == "cuda":
                tp.abort()


def _stop(tp: TPGroup, procs: dict[int, Any], stopping: _Stopping) -> None:
    stopping.event.set()
    alive = all(p.is_alive() for p in procs.values())
    told = stopping.graceful and alive and tp.cpu_group is not None
    if told:
        from swaserve.distributed.step_wire import HEADER, STOP

        words = torch.tensor([STOP] + [0] * (HEADER - 1), dtype=torch.int64)
        with contextlib.suppress(RuntimeError):
            tp.broadcast(words, on_cpu=True)
    # the workers told to stop get the time to; the others may wait in any collective
    deadline = time.monotonic() + (STOP_TIMEOUT_S if told else 0.0)
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(1.0)
    tp.shutdown()
    if stopping.threads:
        torch.set_num_threads(stopping.threads)


def _wait_ready(
    store: Any, ranks: range, procs: dict[int, Any], role: str = "tensor-parallel"
) -> None:
    """Until every rank in `ranks` has reached the store; RankFailure if a local one dies."""
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    keys = [ready_key(r) for r in ranks]
    while not store.check(keys):
        time.sleep(0.05)
        for rank, p in procs.items():
            if not p.is_alive():
                raise RankFailure(
                    f"{role} rank {rank} (pid {p.pid}) {_exit_reason(p.exitcode)} "
                    "while starting; see its log above"
                )
        if time.monotonic() > deadline:
            raise RankFailure(
                f"{role} ranks did not all reach {store.host}:{store.port} within "
                f"{RENDEZVOUS_TIMEOUT.total_seconds():.0f} s (--dist-init-addr, --nnodes)"
            )


def start_tensor_parallel(
    config: EngineConfig, folder: Path, expert_parallel: dict | None = None
) -> TensorParallel:
    """Rank 0: host the rendezvous, spawn this node's other ranks, join the groups.
    `expert_parallel`: this engine core's place in an expert-parallel world, for its workers
    (ep_tp.py)."""
    size = config.tensor_parallel_size
    device = worker_device(config, 0)
    apply_nccl_guard(device.type == "cuda" and config.cuda_graph_max_bs != 0, size)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        log.info("tensor parallelism on CPU: %d threads per rank", share_cpu_cores(size))
    host, port = rendezvous_address(config)
    store = open_store(host, port, size, is_master=True)
    per_node = size // config.nnodes
    procs = spawn_ranks(config, folder, host, store.port, range(1, per_node),
                        expert_parallel=expert_parallel)  # fmt: skip
    try:
        _wait_ready(store, range(1, size), procs)
        tp = TPGroup.create(store, 0, size, host, device)
    except BaseException:
        for p in procs.values():
            p.terminate()
        torch.set_num_threads(threads)
        raise
    log.info("tensor parallelism: %d ranks (%s), rendezvous %s:%d", size, device, host, store.port)
    return TensorParallel(tp, procs, store, threads, remote=range(per_node, size))


def run_node(config: EngineConfig, folder: Path) -> int:
    """Another node (`--node-rank k > 0`): run its ranks until they stop; 1 if one failed."""
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    apply_nccl_guard(
        worker_device(config, first).type == "cuda" and config.cuda_graph_max_bs != 0,
        config.tensor_parallel_size,
    )
    if worker_device(config, first).type == "cpu":  # its ranks take their share (spawn_ranks)
        share_cpu_cores(per_node)
    host, port = rendezvous_address(config)
    procs = spawn_ranks(config, folder, host, port, range(first, first + per_node))
    failed = 0
    for rank, p in procs.items():
        p.join()
        if p.exitcode:
            log.error("tensor-parallel rank %d %s", rank, _exit_reason(p.exitcode))
            failed = 1
    return failed
