"""The frontend's link to D engine-core replicas (`--data-parallel-size D`, dense models).

`DPClient` looks like one `CoreClient` to the HTTP handlers: `add` picks a replica
(`router_dp.choose_replica`: prefix affinity, then load) and hands the request, all its samples
together, to that replica's CoreClient; `abort` finds the replica holding the request.
Capacity is the sum of the replicas'. `dead` is set once any replica's core is gone: the
server then fails every live request and exits, as with one core (launch.py's watchdog), so
/health and new requests answer 503 from that moment.

`stats` merges the replicas' latest stats for /v1/memory: totals (counts summed, per group
pages summed) plus `ranks`, one entry per replica (its own stats, with `dp_rank`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from swaserve.sampling.params import SamplingParams
from swaserve.server.ipc import CoreClient, CoreUnavailable, QueueFull
from swaserve.server.router_dp import PrefixAffinity, choose_replica, prefix_keys

_QUEUE_KEYS = ("num_running", "num_waiting", "num_preemptions", "num_parks")
_NOT_SUMMED = ("page_size",)


class DPClient:
    def __init__(self, clients: list[CoreClient]) -> None:
        self.clients = clients
        self.affinity = PrefixAffinity(len(clients))
        self.routed = [0] * len(clients)  # requests given to each replica
        self.metrics = None  # per replica: clients[i].metrics
        self._dead: str | None = None  # set by fail_all

    # ---- what the handlers use ------------------------------------------------------------

    @property
    def dead(self) -> str | None:
        if self._dead is not None:
            return self._dead
        for rank, c in enumerate(self.clients):
            if c.dead is not None:
                return f"dp rank {rank}: {c.dead}"
        return None

    @property
    def info(self) -> dict | None:
        infos = [c.info for c in self.clients]
        if any(i is None for i in infos):
            return None
        merged = dict(infos[0])
        merged["max_model_len"] = min(int(i["max_model_len"]) for i in infos)
        return merged

    @property
    def max_in_flight(self) -> int:
        return sum(c.max_in_flight for c in self.clients)

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    @property
    def stats(self) -> dict:
        return merge_stats([c.stats for c in self.clients])

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        queue: asyncio.Queue,
        stream: bool,
    ) -> int:
        """Starts the request on one replica (all n samples there); returns its rank."""
        if self.dead is not None:
            raise CoreUnavailable(f"engine core is not running: {self.dead}")
        keys = prefix_keys(prompt_token_ids)
        loads = [c.num_in_flight for c in self.clients]
        fits = [c.num_in_flight + params.n <= c.max_in_flight for c in self.clients]
        try:
            rank = choose_replica(loads, self.affinity.match(keys), self.routed, eligible=fits)
        except ValueError:
            raise QueueFull(
                f"the server is at capacity ({self.max_in_flight} sequences in flight over "
                f"{len(self.clients)} replicas, --max-num-seqs + --max-queue each); retry later"
            ) from None
        self.clients[rank].add(request_id, prompt, prompt_token_ids, params, queue, stream)
        self.affinity.record(rank, keys)
        self.routed[rank] += 1
        return rank

    def abort(self, request_id: str) -> None:
        for c in self.clients:
            if c.is_live(request_id):
                c.abort(request_id)

    def is_live(self, request_id: str) -> bool:
        return any(c.is_live(request_id) for c in self.clients)

    async def reset_prefix_cache(self) -> bool:
        """Every replica empties its own prefix cache (CoreClient.reset_prefix_cache; under
        expert parallelism each rank alone, core_loop_ep.py): True only if all did. A replica
        that had requests keeps its cache while the idle ones empty theirs (as vLLM's DP
        client, the AND of the ranks' answers). The affinity of the replicas that emptied is
        forgotten: their caches no longer hold those prefixes."""
        if self.dead is not None:
            raise CoreUnavailable(f"engine core is not running: {self.dead}")
        done = await asyncio.gather(*(c.reset_prefix_cache() for c in self.clients))
        for rank, ok in enumerate(done):
            if ok:
                self.affinity.forget(rank)
        return all(done)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        for c in self.clients:
            c.start()

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def fail_all(self, reason: str) -> None:
        """One replica is gone (`reason` names it): every replica's requests end (503)."""
        if self._dead is None:
            self._dead = reason
        for c in self.clients:
            c.fail_all(reason)


def merge_stats(per_rank: list[dict]) -> dict:
    """The replicas' core stats as one: numbers summed (not `page_size`), group pages summed
    by group index; `memory.ranks` holds each replica's own (queue lengths included)."""
    merged: dict[str, Any] = {k: sum(s.get(k, 0) for s in per_rank) for k in _QUEUE_KEYS}
    mems = [s.get("memory", {}) for s in per_rank]
    mem: dict[str, Any] = {}
    for m in mems:
        for key, value in m.items():
            if key == "groups":
                continue
            if isinstance(value, (int, float)) and key not in _NOT_SUMMED:
                mem[key] = mem.get(key, 0) + value
            else:
                mem.setdefault(key, value)
    groups: dict[int, dict] = {}
    for m in mems:
        for g in m.get("groups", []):
            total = groups.setdefault(g["index"], {**g, "pages_used": 0})
            total["pages_used"] += g.get("pages_used", 0)
    mem["groups"] = [groups[i] for i in sorted(groups)]
    mem["ranks"] = [
        {**m, **{k: s.get(k, 0) for k in _QUEUE_KEYS}, "dp_rank": rank}
        for rank, (s, m) in enumerate(zip(per_rank, mems))
    ]
    merged["memory"] = mem
    return merged
