"""Offline expert parallelism: what rank 0 (the Engine's process) tells ranks 1..D-1 and what
they answer, over the group's gloo group, as msgpack bytes in uint8 tensors (never pickle).

    rank 0 -> all   header [op, nbytes, 0, 0] (step_wire's HEADER words: STOP, sent by
                    TensorParallel.shutdown, ends a worker), then nbytes of msgpack
    all -> rank 0   every rank's answer length (all-gather), then the answers padded to the
                    longest (gather)

    STEP   {"add": [[rank, request_id, prompt_token_ids, SamplingParams.to_dict()], ...],
            "abort": [request_id, ...]}: each rank adds its own, aborts those it holds, steps
           once (EngineCore.step, with its agreement and forward); answer
           [[wire(EngineCoreOutput), ...], [has_unfinished, has_in_flight, has_queued]]
    STATS  answer: core_process.core_stats of the rank
    CHECK  answer: "" or the rank's check_integrity() failure
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

from swaserve.distributed.parallel_state import EPGroup
from swaserve.distributed.step_wire import HEADER, STOP

STEP, STATS, CHECK = 5, 6, 7
__all__ = ["CHECK", "STATS", "STEP", "STOP", "EPWire"]


def _bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


class EPWire:
    def __init__(self, group: EPGroup) -> None:
        self.group = group

    def send(self, op: int, body: Any = None) -> None:
        """Rank 0: a message to every rank."""
        data = b"" if body is None else msgpack.packb(body, use_bin_type=True)
        header = torch.tensor([op, len(data)] + [0] * (HEADER - 2), dtype=torch.int64)
        self.group.broadcast(header, on_cpu=True)
        if data:
            self.group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), on_cpu=True)

    def recv(self) -> tuple[int, Any]:
        """Ranks 1..D-1: the next message (blocks while rank 0 idles)."""
        header = self.group.broadcast(torch.empty(HEADER, dtype=torch.int64), on_cpu=True)
        op, n = int(header[0]), int(header[1])
        if not n:
            return op, None
        data = self.group.broadcast(torch.empty(n, dtype=torch.uint8), on_cpu=True)
        return op, msgpack.unpackb(_bytes(data), raw=False, strict_map_key=False)

    def answer(self, body: Any) -> list[Any] | None:
        """Every rank: its answer to the message; rank 0 gets all of them in rank order (its
        own included), the others None."""
        data = msgpack.packb(body, use_bin_type=True)
        lens = self.group.all_gather(torch.tensor([len(data)], dtype=torch.int64), on_cpu=True)
        longest = max(int(n) for n in lens)
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = self.group.gather_cpu(buf)
        if parts is None:
            return None
        return [
            msgpack.unpackb(_bytes(p[: int(n)]), raw=False, strict_map_key=False)
            for p, n in zip(parts, lens)
        ]
