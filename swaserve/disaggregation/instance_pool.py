"""The instances of one role (prefill or decode) behind the PD router: which are up, and which
one takes a request.

An instance is

    up     its /v1/disaggregation answered (`info` set): it may be chosen
    down   a call to it or a probe failed (`error` says why): never chosen; once `retry_at`
           has passed the router probes it again (a back-off that doubles with each
           consecutive failure, BACKOFF_S up to MAX_BACKOFF_S); a probe that answers brings
           it back, a call that succeeds clears the failure count

The choice is the DP frontend's (router_dp.choose_replica) over the instances that are up:
the one that recently served the longest matching prompt prefix (its prefix cache holds those
pages: a decode instance then reserves fewer and receives fewer, a prefill instance computes
fewer), unless it carries more than `margin` sequences beyond the least loaded; otherwise the
least loaded, ties to the one given fewer requests, then to the first listed.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from swaserve.server.router_dp import LOAD_MARGIN, LRU_SIZE, PrefixAffinity, choose_replica

BACKOFF_S = 1.0  # a failed instance is not tried again sooner
MAX_BACKOFF_S = 15.0


@dataclass(eq=False)  # identity: instances go in sets (a request's tried ones)
class Instance:
    url: str
    role: str  # prefill | decode
    index: int = 0  # its place in its pool (the affinity LRU's replica number)
    info: dict | None = None  # its /v1/disaggregation answer; None while down or unknown
    in_flight: int = 0  # sequences this router has in flight on it
    routed: int = 0  # requests given to it so far
    error: str | None = None  # why it is down
    failures: int = 0  # consecutive failed calls or probes
    retry_at: float = 0.0  # time.monotonic() before which a down instance is not probed

    @property
    def up(self) -> bool:
        return self.info is not None

    def mark_up(self, info: dict) -> None:
        self.info, self.error, self.failures = info, None, 0

    def mark_ok(self) -> None:
        """A call succeeded."""
        self.failures = 0

    def mark_down(self, why: str, now: float | None = None) -> None:
        self.info, self.error = None, why
        self.failures += 1
        backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** min(self.failures - 1, 16))
        self.retry_at = (time.monotonic() if now is None else now) + backoff


class InstancePool:
    def __init__(
        self, urls: list[str], role: str, margin: int = LOAD_MARGIN, capacity: int = LRU_SIZE
    ) -> None:
        self.role = role
        self.margin = margin
        self.instances = [Instance(u.rstrip("/"), role, i) for i, u in enumerate(urls)]
        self.affinity = PrefixAffinity(len(self.instances), capacity)

    def choose(self, keys: list[tuple], exclude: Collection[Instance] = ()) -> Instance | None:
        """The instance for a request with prompt-prefix `keys` (prompt_keys.py), among those
        up and not in `exclude`; None when there is none."""
        eligible = [i.up and i not in exclude for i in self.instances]
        if not any(eligible):
            return None
        k = choose_replica(
            [i.in_flight for i in self.instances],
            self.affinity.match(keys),
            [i.routed for i in self.instances],
            self.margin,
            eligible,
        )
        return self.instances[k]

    def record(self, inst: Instance, keys: list[tuple]) -> None:
        """`inst` was given a request with these keys."""
        self.affinity.record(inst.index, keys)
        inst.routed += 1

    def due(self, now: float | None = None) -> list[Instance]:
        """The down instances whose back-off has passed: to probe."""
        now = time.monotonic() if now is None else now
        return [i for i in self.instances if not i.up and now >= i.retry_at]

    def describe(self, exclude: Collection[Instance] = ()) -> str:
        """Why none is available, instance by instance."""

        def why(i: Instance) -> str:
            if i.error is not None:
                return i.error
            return "failed for this request" if i in exclude else "not probed yet"

        return "; ".join(f"{i.url}: {why(i)}" for i in self.instances)
