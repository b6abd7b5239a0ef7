"""The offline `Engine`'s core with `data_parallel_size=D` and no expert parallelism: D
EngineCore replicas in this process, each with its own scheduler, KV pool and prefix cache and,
with `tensor_parallel_size=T`, its own T ranks (itself as rank 0 and T-1 spawned workers, on
cuda:i*T .. i*T+T-1, meeting at a rendezvous of their own: server/launch.replica_config).

`DPReplicas` looks like one EngineCore to the Engine. Each request goes to one replica
(router_dp.Placement: prefix affinity, then load; or the `dp_rank` a caller names) and stays
there. `step()` steps, one after another, every replica with work: nothing ties them together
(no collective between replicas), so an idle replica is skipped. The host work of all replicas
is this thread's; the server runs one process per replica instead (server/launch.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from swaserve.config import EngineConfig
from swaserve.engine.core import EngineCore
from swaserve.outputs import EngineCoreOutput
from swaserve.sampling.params import SamplingParams


class _AnyReplica:
    """`core.scheduler.has_unfinished()` over every replica (what the Engine asks)."""

    def __init__(self, replicas: list[EngineCore]) -> None:
        self.replicas = replicas

    def has_unfinished(self) -> bool:
        return any(r.scheduler.has_unfinished() for r in self.replicas)


def place_new_request(
    core: Any,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    dp_rank: int | None,
) -> int:
    """An offline data-parallel core's new request (DPReplicas, DPExpertCore): checked as one
    EngineCore checks it (token ids, max_tokens within the context) before it is placed
    (`core.placement`); returns its replica."""
    from swaserve.engine.limits import check_token_ids

    check_token_ids(prompt_token_ids, core.hf_config.vocab_size)
    core.resolve_max_tokens(len(prompt_token_ids), params)
    return core.placement.place(request_id, prompt_token_ids, dp_rank)


@contextlib.contextmanager
def _naming_replica(rank: int) -> Iterator[None]:
    """A replica's failed rank (RankFailure) is named with the replica: each has a rank 1."""
    from swaserve.distributed.launch import RankFailure

    try:
        yield
    except RankFailure as e:
        raise RankFailure(f"dp rank {rank}: {e}") from e


class DPReplicas:
    def __init__(self, config: EngineConfig, folder: Path) -> None:
        from swaserve.server.launch import replica_config
        from swaserve.server.router_dp import Placement

        self.config = config
        self.replicas: list[EngineCore] = []
        try:
            for rank in range(config.data_parallel_size):
                self.replicas.append(EngineCore(replica_config(config, rank), folder))
        except BaseException:
            self.shutdown()  # the replicas built so far stop their ranks
            raise
        first = self.replicas[0]
        self.hf_config, self.max_model_len, self.device = (
            first.hf_config, first.max_model_len, first.device
        )
        self.placement = Placement(len(self.replicas))
        self.scheduler = _AnyReplica(self.replicas)

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.replicas[0].resolve_max_tokens(num_prompt_tokens, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        dp_rank: int | None = None,
    ) -> int:
        """Start a request on `dp_rank` (None: by prefix affinity and load); returns the rank."""
        rank = place_new_request(self, request_id, prompt_token_ids, params, dp_rank)
        try:
            self.replicas[rank].add_request(request_id, prompt_token_ids, params)
        except BaseException:
            self.placement.forget(request_id)
            raise
        return rank

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.placement.forget(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, rids in by_rank.items():
            self.replicas[rank].abort_requests(rids)

    def step(self) -> list[EngineCoreOutput]:
        """One step of every replica with work; their outputs, replica 0's first."""
        outputs: list[EngineCoreOutput] = []
        for rank, r in enumerate(self.replicas):
            if r.has_unfinished():
                with _naming_replica(rank):
                    outputs += r.step()
        for o in outputs:
            if o.finish_reason is not None:
                self.placement.forget(o.request_id)
        return outputs

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def has_in_flight(self) -> bool:
        return any(r.has_in_flight() for r in self.replicas)

    def memory_stats(self) -> dict:
        """The totals over the replicas plus `ranks`, one entry per replica (as the server's)."""
        from swaserve.server.core_process import core_stats
        from swaserve.server.dp_client import merge_stats

        return merge_stats([core_stats(r) for r in self.replicas])["memory"]

    def check_ranks(self) -> None:
        for rank, r in enumerate(self.replicas):
            with _naming_replica(rank):
                r.check_ranks()

    def reset_prefix_cache(self) -> bool:
        """Every replica's (see EngineCore.reset_prefix_cache): False while any runs a request."""
        if self.has_unfinished():
            return False
        return all([r.reset_prefix_cache() for r in self.replicas])

    def shutdown(self) -> None:
        """Stop every replica's tensor-parallel workers, the last started first (each gives
        back the thread count it found)."""
        for r in reversed(self.replicas):
            r.shutdown()
