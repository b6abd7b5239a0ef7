"""Offline expert parallelism: ranks 1..D-1, each its own process (spawned by ep_launch.py) with
a whole EngineCore of its own (scheduler, KV pool, prefix cache, its experts; with -tp T its own
T - 1 tensor-parallel workers, spawned by it), stepping when rank 0 says so (ep_wire.py) until
STOP or until rank 0 is gone (the next wait fails).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from swaserve.config import EngineConfig
from swaserve.distributed.ep_wire import CHECK, STATS, STEP, STOP, EPWire

log = logging.getLogger("swaserve.ep_worker")


def spawn_workers(config: EngineConfig, folder: Path, host: str, port: int) -> dict[int, Any]:
    """Start ranks 1..D-1 as daemon processes running `worker_main` (launch.spawn_ranks)."""
    from swaserve.distributed.launch import spawn_ranks

    return spawn_ranks(
        config, folder, host, port, range(1, config.data_parallel_size), worker_main, "dp"
    )


def worker_main(rank: int, spec_json: str) -> None:
    """Process entry of data-parallel rank `rank` (offline, expert parallelism)."""
    from swaserve.distributed.ep_launch import ROLE, join_expert_parallel, rank_device
    from swaserve.distributed.launch import RankFailure
    from swaserve.engine.core import EngineCore
    from swaserve.server.launch import replica_config

    spec = json.loads(spec_json)
    logging.basicConfig(
        level=spec.get("log_level", "INFO"),
        format=f"%(asctime)s %(levelname)s [dp{rank}] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the ranks stop
    # A daemon may not start processes (multiprocessing's guard against orphans); this rank's
    # tensor-parallel workers, daemons of it, end with it or when it vanishes (their next wait
    # fails), as rank 0's own do.
    multiprocessing.current_process().daemon = False
    config = EngineConfig(**spec["config"])
    size = config.data_parallel_size
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # rank 0's share of the cores
        torch.set_num_threads(spec["threads"])
    ep = join_expert_parallel(size, rank, spec["host"], spec["port"], device,
                              tp_size=config.tensor_parallel_size)  # fmt: skip
    try:
        core = EngineCore(replica_config(config, rank), Path(spec["folder"]), ep=ep)
        serve_steps(core, EPWire(ep.group), rank)
        core.shutdown()  # its tensor-parallel workers (-tp), told to stop before this exits
    except RuntimeError as e:
        # rank 0 vanished: gloo's word for it, or the failure naming it (any other process's
        # failure is this rank's too: raised, so that rank 0 sees it exit with an error)
        closed = "Connection closed by peer" in str(e) and not isinstance(e, RankFailure)
        if closed or str(e).startswith(f"{ROLE} rank 0 (pid "):
            log.info("rank 0 is gone; data-parallel rank %d exits", rank)
            sys.exit(0)
        raise
    finally:
        ep.group.shutdown()


def serve_steps(core: Any, wire: EPWire, rank: int) -> None:
    """Answer rank 0's messages (ep_wire.py) until STOP."""
    from swaserve.sampling.params import SamplingParams
    from swaserve.server.core_process import core_stats
    from swaserve.server.ipc import output_to_wire

    while True:
        op, body = wire.recv()
        if op == STEP:
            for r, rid, ids, params in body["add"]:
                if r == rank:
                    core.add_request(rid, ids, SamplingParams.from_dict(params))
            if body["abort"]:
                core.abort_requests(body["abort"])
            outs = core.step()
            flags = [core.has_unfinished(), core.has_in_flight(), core.scheduler.has_unfinished()]
            wire.answer([[output_to_wire(o) for o in outs], flags])
        elif op == STATS:
            wire.answer(core_stats(core))
        elif op == CHECK:
            try:
                core.memory.check_integrity()
                wire.answer("")
            except AssertionError as e:
                wire.answer(f"data-parallel rank {rank}: {e!r}")
        elif op == STOP:
            return
        else:
            raise RuntimeError(f"expert-parallel wire: unknown op {op}")
