"""The process groups of this process and their collectives: the one place that creates a
group (layers, the step wire and the workers are handed a `TPGroup`; the data-parallel ranks of
DP attention + expert parallelism an `EPGroup`, the same two groups over the D ranks plus the
collectives of the MoE exchange; with -tp T inside each data-parallel rank, T of them, one per
tensor-parallel index: `expert_group_store`).

Tensor parallelism over T ranks makes two groups, both from one TCPStore that rank 0 hosts at
the rendezvous address:

    device_group  NCCL on CUDA, gloo on CPU: the model's collectives (the all-reduce after each
                  row-parallel layer and the embedding, the logits gather) and each step's
                  input ids. Timeout DEVICE_TIMEOUT.
    cpu_group     gloo: the step wire's headers and host tensors, and start-up agreements (the
                  page count, FP8 scales). A worker waits here for rank 0's next step for as
                  long as the engine idles, hence the long timeout.

A peer that dies fails a pending gloo collective at once ("Connection closed by peer"); launch.py
turns that into an error naming the rank. The groups are process-group objects, not
torch.distributed's global default group, so several engines can live in one process.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEVICE_TIMEOUT = datetime.timedelta(minutes=10)  # a step's collectives (first steps compile)
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waiting for the next step
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)  # workers importing and connecting
_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def share_cpu_cores(size: int) -> int:
    """On CPU the T ranks share this machine's cores: each runs cores / T intra-op threads (T
    processes each spinning every core's worth of threads run many times slower), never more
    than this process has already (OMP_NUM_THREADS, or the share of a data-parallel replica
    whose core process then starts its tensor-parallel ranks). Returns the thread count set."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, min(torch.get_num_threads(), (cores or 1) // size))
    torch.set_num_threads(threads)
    return threads


def open_store(host: str, port: int, world_size: int, is_master: bool) -> dist.TCPStore:
    """The rendezvous store: rank 0 hosts it (port 0: a free port, read back from `.port`)."""
    return dist.TCPStore(
        host, port, world_size, is_master, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False
    )


def _gloo(store: dist.Store, rank: int, size: int, host: str, timeout) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # One machine: loopback, whatever the hostname resolves to; several: the default interface
    # (GLOO_SOCKET_IFNAME picks another).
    local = host in _LOCAL_HOSTS
    opts._devices = [
        dist.ProcessGroupGloo.create_device(hostname=host)
        if local
        else dist.ProcessGroupGloo.create_default_device()
    ]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = DEVICE_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, size, opts)


@dataclass
class TPGroup:
    """This process's place among the tensor-parallel ranks, and the collectives over them.
    Every call is collective: all ranks make it, in the same order."""

    rank: int
    size: int
    device: torch.device
    device_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None

    @classmethod
    def create(
        cls, store: dist.Store, rank: int, size: int, host: str, device: torch.device
    ) -> TPGroup:
        cpu = _gloo(dist.PrefixStore("tp_cpu", store), rank, size, host, IDLE_TIMEOUT)
        if device.type == "cuda":
            dev = _nccl(dist.PrefixStore("tp_device", store), rank, size)
        else:
            dev = _gloo(dist.PrefixStore("tp_device", store), rank, size, host, DEVICE_TIMEOUT)
        return cls(rank, size, device, dev, cpu)

    @classmethod
    def layout_only(cls, rank: int, size: int) -> TPGroup:
        """Rank and size without groups: for planning shards (no collective may run)."""
        return cls(rank, size, torch.device("cpu"), None, None)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns x."""
        self.device_group.allreduce([x]).wait()
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's x (same shape) to rank 0, in rank order; None on the other ranks."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self.device_group.gather([outs] if outs is not None else [], [x], opts).wait()
        return outs

    def broadcast(self, x: torch.Tensor, on_cpu: bool = False) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place; returns x.
        `on_cpu`: a host tensor over the gloo group."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        group = self.cpu_group if on_cpu else self.device_group
        group.broadcast([x], opts).wait()
        return x

    def agree(self, values: list[float], op: str) -> list[float]:
        """The elementwise "min" or "max" of `values` over the ranks (host values)."""
        t = torch.tensor(values, dtype=torch.float64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX
        self.cpu_group.allreduce([t], opts).wait()
        return t.tolist()

    def shutdown(self) -> None:
        for group in (self.device_group, self.cpu_group):
            if group is not None:
                try:
                    group.shutdown()
                except Exception:  # noqa: BLE001 - a broken group (a peer died) is gone anyway
                    pass
        self.device_group = self.cpu_group = None

    def abort(self) -> None:
        """Fail the collectives in flight (a peer is gone): NCCL would wait for its timeout."""
        for group in (self.device_group, self.cpu_group):
            if group is not None:
                try:
                    group.abort()
                except Exception:  # noqa: BLE001 - best effort, the engine stops anyway
                    pass


def expert_group_store(store: dist.Store, tp_rank: int) -> dist.Store:
    """Where the D data-parallel ranks' tensor-parallel ranks `tp_rank` meet to form their
    expert-parallel group (one group per tensor-parallel index: ep_tp.py); index 0, the engine
    cores, meet on the store itself."""
    return store if tp_rank == 0 else dist.PrefixStore(f"ep_tp{tp_rank}", store)


@dataclass
class EPGroup(TPGroup):
    """The D data-parallel ranks whose MoE layers share their experts (expert_parallel.py):
    device_group carries the MoE exchange, cpu_group each step's agreement (and, offline, rank
    0's messages). Every call is collective, as TPGroup's."""

    def all_gather(self, x: torch.Tensor, on_cpu: bool = False) -> list[torch.Tensor]:
        """Every rank's x (same shape and dtype on every rank), in rank order."""
        outs = [torch.empty_like(x) for _ in range(self.size)]
        group = self.cpu_group if on_cpu else self.device_group
        group.allgather([outs], [x.contiguous()]).wait()
        return outs

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [n, ...] into out [size * n, ...], rank-major; returns out."""
        self.device_group._allgather_base(out, x.contiguous()).wait()
        return out

    def reduce_scatter_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """reduce_scatter into a given out [n, ...]; returns out."""
        self.device_group._reduce_scatter_base(out, x.contiguous()).wait()
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [size * n, ...] summed over the ranks; this rank gets rows [rank * n, (rank+1) * n)."""
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.device_group._reduce_scatter_base(out, x.contiguous()).wait()
        return out

    def gather_cpu(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's host tensor x (same shape) to rank 0 over the gloo group; None elsewhere."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outs = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self.cpu_group.gather([outs] if outs is not None else [], [x], opts).wait()
        return outs
