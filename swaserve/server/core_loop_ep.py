"""The core loop of one data-parallel rank under expert parallelism (`serve -dp D
--enable-expert-parallel`): D core processes, each with its own requests, that must make the
same collectives in the same order (swaserve/distributed/expert_parallel.py).

    while True:
        read every waiting message: without a wait while any rank had work in the last step,
            else for at most IDLE_POLL_MS (so an idle rank joins the next agreement soon after
            another rank gets a request; nobody waits in a forward for a rank that sleeps)
        step once, always: its agreement is the one collective every rank makes each iteration;
            a forward follows only when some rank has tokens
        send the step's outputs (as CoreLoop)
        leave once the agreement said some rank stops (shutdown, or its server gone): all
            ranks leave after the same step, none is left waiting in a collective

`reset_prefix_cache` (CoreLoop's) empties this rank's own cache only, answered from this
rank's state alone: the reset is bookkeeping plus this rank's own offload-tier copies (and its
tensor-parallel workers' replay of them), with no collective among the ranks, and each rank's
cache serves only its own requests, so no rank needs another's agreement (the frontend asks
every rank and answers with the AND: server/dp_client.py). It happens between two `step`s, so
the ranks' lockstep (one agreement per step) is untouched.

A peer that died fails the next agreement or exchange with a RankFailure naming its rank: the
core sends `dead` and exits, and the frontend's watchdog takes the server down.
"""

from __future__ import annotations

import logging
import time

from swaserve.config import EngineConfig
from swaserve.distributed.expert_parallel import ExpertParallel
from swaserve.server.core_process import CoreLoop, core_stats, first_scheduled
from swaserve.server.ipc import OUTPUTS, output_to_wire

log = logging.getLogger("swaserve.core")
IDLE_POLL_MS = 20  # an idle rank's wait for requests between two agreements


def join_group(config: EngineConfig, spec: dict) -> ExpertParallel:
    """Join the group the frontend set up: spec {"rank", "size", "host", "port", "node"}."""
    from swaserve.distributed.ep_launch import join_expert_parallel

    device = config.torch_device()
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    return join_expert_parallel(
        spec["size"], spec["rank"], spec["host"], spec["port"], device, spec.get("node", 0),
        config.tensor_parallel_size,
    )


class EPCoreLoop(CoreLoop):
    def run(self) -> None:
        core = self.core
        ep = core.ep
        self.send_ready()
        while True:
            busy = core.has_unfinished() or ep.any_work or bool(self.compiling)
            changed = self.read_inputs(0 if busy else IDLE_POLL_MS)
            changed = self.added_compiled() or changed
            gone = self.server_gone()
            if gone and not ep.want_stop:
                log.warning("%s; engine core exits", gone)
            ep.want_stop = ep.want_stop or not self.running or gone is not None
            if not busy:  # a tensor-parallel worker that died while idle: fail now, not later
                core.check_ranks()
            start = time.monotonic()
            outputs = core.step()
            queue_times = first_scheduled(self.queued, start) if self.queued else []
            if (outputs or changed or queue_times) and not gone:
                wire = [output_to_wire(o) for o in outputs]
                self.send([OUTPUTS, wire, core_stats(core), queue_times])
            if ep.stopping:
                break
        if gone:
            self.out.close(linger=0)  # nobody will read what is still queued
        ep.group.shutdown()
