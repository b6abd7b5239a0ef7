"""Counters of KV transfers, kept by either side's engine core and sent with its stats
(`stats["kv_transfer"]`); the frontend's /metrics exports them (server/metrics.py):

    swaserve:kv_transfers_total            transfers completed (one per sample)
    swaserve:kv_transfer_bytes_total       bytes of the pages they moved
    swaserve:kv_transfer_seconds           prefill side: write start -> done; decode side:
                                           reservation sent -> pages landed (includes the
                                           prefill's compute)
    swaserve:kv_transfer_failures_total    transfers that failed (peer dead, timeout, aborted
                                           by the peer, write error)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TransferStats:
    transfers: int = 0
    bytes: int = 0
    failures: int = 0
    pages: int = 0
    seconds: list[float] = field(default_factory=list)  # not yet reported

    def done(self, num_pages: int, num_bytes: int, seconds: float) -> None:
        self.transfers += 1
        self.pages += num_pages
        self.bytes += num_bytes
        self.seconds.append(seconds)

    def failed(self) -> None:
        self.failures += 1

    def report(self) -> dict:
        """Running totals plus the durations since the last report (each reported once)."""
        seconds, self.seconds = self.seconds, []
        return {
            "transfers": self.transfers,
            "bytes": self.bytes,
            "pages": self.pages,
            "failures": self.failures,
            "seconds": seconds,
        }


class TransferMetrics:
    """The frontend's Prometheus series of a PD instance, fed by the core's reports."""

    def __init__(self, registry: Any, prefix: str = "swaserve:") -> None:
        from prometheus_client import Counter, Histogram

        r = registry
        self.transfers = Counter(prefix + "kv_transfers", "KV transfers completed", registry=r)
        self.bytes = Counter(prefix + "kv_transfer_bytes", "Bytes of KV pages moved", registry=r)
        self.failures = Counter(
            prefix + "kv_transfer_failures", "KV transfers that failed", registry=r
        )
        self.seconds = Histogram(
            prefix + "kv_transfer_seconds",
            "Prefill side: write time; decode side: reservation to pages landed",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self._last = {"transfers": 0, "bytes": 0, "failures": 0}

    def update(self, report: dict) -> None:
        for key, counter in (("transfers", self.transfers), ("bytes", self.bytes),
                             ("failures", self.failures)):
            grew = report.get(key, 0) - self._last[key]
            if grew > 0:
                counter.inc(grew)
            self._last[key] = report.get(key, 0)
        for s in report.get("seconds", []):
            self.seconds.observe(s)
