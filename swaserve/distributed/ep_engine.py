"""The offline `Engine`'s core with `data_parallel_size=D, enable_expert_parallel=True`:
`DPExpertCore` looks like one EngineCore to the Engine (add, abort, step, has_unfinished,
memory_stats) and runs D of them, rank 0's in this process and ranks 1..D-1 in spawned
processes (ep_worker.py), one step at a time over ep_wire.py; with `tensor_parallel_size=T`
each of them starts its own T - 1 tensor-parallel workers (ep_tp.py).

Each request goes to one rank (`router_dp.choose_replica`: prefix affinity, then load; or the
`dp_rank` a caller names) and stays there. `step()` hands the ranks their new requests and
aborts with STEP, steps rank 0 here while the others step there (every rank's EngineCore.step
makes the same agreement and MoE collectives), then gathers their outputs and states. Every
exchange runs under `TensorParallel.guard`: a rank that died is a RankFailure naming it, and
every later call raises that first failure again (the ranks that failed because of it die too,
each with its own, later word).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from pathlib import Path

from swaserve.config import EngineConfig
from swaserve.distributed.ep_wire import CHECK, STATS, STEP, EPWire
from swaserve.distributed.launch import RankFailure
from swaserve.outputs import EngineCoreOutput
from swaserve.sampling.params import SamplingParams


class _AnyRank:
    """`core.scheduler.has_unfinished()` over every rank (what the Engine asks)."""

    def __init__(self, core: DPExpertCore) -> None:
        self.core = weakref.proxy(core)  # the core holds this: no cycle (engine/gc_heap.py)

    def has_unfinished(self) -> bool:
        c = self.core
        return bool(c._adds) or c.local.scheduler.has_unfinished() or any(s[2] for s in c._remote)


class DPExpertCore:
    def __init__(self, config: EngineConfig, folder: Path) -> None:
        from swaserve.distributed.ep_launch import start_offline
        from swaserve.distributed.expert_shards import check_expert_parallel
        from swaserve.engine.core import EngineCore
        from swaserve.server.launch import replica_config
        from swaserve.server.router_dp import Placement
        from swaserve.weights.loader import load_hf_config

        size = config.data_parallel_size
        # before any process starts
        check_expert_parallel(load_hf_config(folder), size, config.tensor_parallel_size)
        self.config = config
        self.parallel, ep = start_offline(config, folder)
        try:
            self.local = EngineCore(replica_config(config, 0), folder, ep=ep)
        except BaseException as e:
            failure = self.parallel.explain() if isinstance(e, RuntimeError) else None
            self.parallel.shutdown(graceful=False)
            if failure is None:
                raise
            raise failure from e
        self.wire = EPWire(ep.group)
        self.size = size
        self.hf_config = self.local.hf_config
        self.max_model_len = self.local.max_model_len
        self.placement = Placement(size)
        self.scheduler = _AnyRank(self)
        self._adds: list[list] = []  # for ranks 1.. at the next step
        self._aborts: list[str] = []
        self._remote: list[list[bool]] = [[False] * 3 for _ in range(size)]  # per rank's answer
        self.failure: RankFailure | None = None  # the first, raised again by every later call

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        if self.failure is not None:
            raise self.failure
        try:
            with self.parallel.guard():
                yield
        except RankFailure as e:
            # ranks may wait in any collective now: shutdown terminates them (no STOP)
            self.failure = e
            self.parallel.failed(e)
            raise

    # ---- what the Engine uses -----------------------------------------------------------

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return self.local.resolve_max_tokens(num_prompt_tokens, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        dp_rank: int | None = None,
    ) -> int:
        """Start a request on `dp_rank` (None: by prefix affinity and load); returns the rank."""
        from swaserve.engine.replicas import place_new_request

        dp_rank = place_new_request(self, request_id, prompt_token_ids, params, dp_rank)
        if dp_rank == 0:
            self.local.add_request(request_id, prompt_token_ids, params)
        else:
            self._adds.append([dp_rank, request_id, list(prompt_token_ids), params.to_dict()])
        return dp_rank

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            rank = self.placement.forget(rid)
            if rank == 0:
                self.local.abort_requests([rid])
            elif rank is not None:
                self._adds = [a for a in self._adds if a[1] != rid]
                self._aborts.append(rid)

    def step(self) -> list[EngineCoreOutput]:
        """One lockstep step of every rank; their outputs, rank 0's first."""
        from swaserve.server.ipc import output_from_wire

        body = {"add": self._adds, "abort": self._aborts}
        self._adds, self._aborts = [], []
        with self._guard():
            self.wire.send(STEP, body)
            outputs = self.local.step()
            answers = self.wire.answer(None)
        for rank, answer in enumerate(answers[1:], start=1):
            wire_outs, self._remote[rank] = answer
            outputs += [output_from_wire(w) for w in wire_outs]
        for o in outputs:
            if o.finish_reason is not None:
                self.placement.forget(o.request_id)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._adds) or self.local.has_unfinished() or any(s[0] for s in self._remote)

    def has_in_flight(self) -> bool:
        return self.local.has_in_flight() or any(s[1] for s in self._remote)

    def memory_stats(self) -> dict:
        """The totals over the ranks plus `ranks`, one entry per rank (as the server's)."""
        from swaserve.server.core_process import core_stats
        from swaserve.server.dp_client import merge_stats

        with self._guard():
            self.wire.send(STATS)
            stats = self.wire.answer(core_stats(self.local))
        return merge_stats(stats)["memory"]

    def check_integrity(self) -> None:
        """Every rank's memory manager's check_integrity(); AssertionError naming the ranks."""
        with self._guard():
            self.wire.send(CHECK)
            try:
                self.local.memory.check_integrity()
                mine = ""
            except AssertionError as e:
                mine = f"data-parallel rank 0: {e!r}"
            errors = [e for e in self.wire.answer(mine) if e]
        assert not errors, "; ".join(errors)

    def check_ranks(self) -> None:
        self.parallel.check()
        self.local.check_ranks()  # rank 0's tensor-parallel workers (-tp)

    def shutdown(self) -> None:
        """Stop ranks 1..D-1, then rank 0's tensor-parallel workers (also done when the core is
        collected or the process exits)."""
        self.parallel.shutdown()
        self.local.shutdown()
