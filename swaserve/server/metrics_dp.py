"""/metrics with `--data-parallel-size D` > 1: each replica's `Metrics` (its own registry, fed
by its CoreClient: the core's stats and the frontend's latencies of the requests it served),
exported as one set of families where every series carries a `dp_rank` label. Counters stay
counters (a family's type is kept; only labels are added)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from swaserve.server.metrics import Metrics


class _Ranked:
    """A collector: the families of every rank's registry, merged, samples labelled."""

    def __init__(self, ranks: list[Metrics]) -> None:
        self.ranks = ranks

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for rank, m in enumerate(self.ranks):
            for fam in m.registry.collect():
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    labels = {**s.labels, "dp_rank": str(rank)}
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from families.values()


class RankedMetrics:
    """What the app calls `metrics`: `render()` of all ranks, `ranks[i]` per replica."""

    def __init__(self, num_ranks: int) -> None:
        self.ranks = [Metrics() for _ in range(num_ranks)]
        self.registry = CollectorRegistry()
        self.registry.register(_Ranked(self.ranks))

    def render(self) -> bytes:
        return generate_latest(self.registry)
