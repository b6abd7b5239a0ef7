"""The periodic stats line (server/stats_log.py) from a real /metrics registry: throughputs
over the interval, KV usage and hit rate, preemptions and speculation when they happened,
silence while idle after one idle line, and data-parallel ranks summed."""

from __future__ import annotations

from swaserve.server.metrics import Metrics
from swaserve.server.metrics_dp import RankedMetrics
from swaserve.server.stats_log import StatsLine


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def busy(m: Metrics, prompt: int, generated: int, running: int) -> None:
    m.prompt_tokens.inc(prompt)
    m.generation_tokens.inc(generated)
    m.update_core_stats({"num_running": running, "num_waiting": 1, "memory": {
        "pages_held_by_requests": 25, "pages_total": 100}})  # fmt: skip
    m.prefix_queries.inc(prompt)
    m.prefix_hits.inc(prompt // 4)


def test_line_over_the_interval():
    m, clock = Metrics(), Clock()
    stats = StatsLine(m.registry, clock)
    assert stats.next() == []  # idle from the start: nothing to say
    busy(m, 400, 50, 3)
    clock.t += 10
    line, = stats.next()
    assert line == ("Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 5.0 "
                    "tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 25.0%")  # fmt: skip
    m.update_core_stats({"num_running": 0, "num_waiting": 0, "num_preemptions": 2,
                         "memory": {"pages_held_by_requests": 0, "pages_total": 100}})
    m.observe_spec({"spec_verify_ct": 4, "spec_proposed_drafts": 12, "spec_accepted_drafts": 6,
                    "spec_accept_histogram": [1, 1, 1, 1]})  # fmt: skip
    clock.t += 5
    idle, spec = stats.next()  # the line that says it went idle
    assert idle.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                           "0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: "
                           "0.0%")  # fmt: skip
    assert idle.endswith(", Preemptions: 2")
    assert spec == ("Speculative decoding: mean acceptance length 2.50, accepted 6 of 12 "
                    "draft tokens in 4 verify steps")
    clock.t += 10
    assert stats.next() == []  # still idle: silent


def test_ranks_are_summed():
    dp, clock = RankedMetrics(2), Clock()
    stats = StatsLine(dp.registry, clock)
    busy(dp.ranks[0], 100, 10, 2)
    busy(dp.ranks[1], 300, 30, 5)
    clock.t += 2
    line, = stats.next()
    assert "Avg prompt throughput: 200.0 tokens/s" in line
    assert "Avg generation throughput: 20.0 tokens/s" in line
    assert "Running: 7 reqs, Waiting: 2 reqs, KV cache usage: 25.0%" in line
