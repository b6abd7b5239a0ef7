"""The periodic engine stats line in the server's log, as vLLM prints it: every
`--log-stats-interval` seconds (default 10; `--disable-log-stats` turns it off) while the server
is busy, and once more when it goes idle:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 63.0%

plus `Preemptions: N` when some happened in the interval, and a speculative decoding line
(mean acceptance length, drafts accepted of drafted) when verify steps finished in it. Numbers
come from the /metrics registry (summed over data-parallel ranks): throughputs and the hit
rate over the interval, the rest as now. Speculation counters count when a request finishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from swaserve.server.metrics import P

log = logging.getLogger("swaserve.server")
DEFAULT_INTERVAL_S = 10.0

_TOTALS = {  # the samples read, by short name
    "prompt": "prompt_tokens_total",
    "generation": "generation_tokens_total",
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "held": "kv_pages_held_by_requests",
    "pages": "kv_pages_total",
    "hits": "prefix_cache_hit_tokens_total",
    "queries": "prefix_cache_queries_tokens_total",
    "preemptions": "num_preemptions_total",
    "verify": "spec_decode_num_drafts_total",
    "drafted": "spec_decode_num_draft_tokens_total",
    "accepted": "spec_decode_num_accepted_tokens_total",
}


def read_totals(registry: Any) -> dict[str, float]:
    """The samples of `_TOTALS` in `registry`, each summed over its label sets (DP ranks)."""
    wanted = {P + name: short for short, name in _TOTALS.items()}
    out = dict.fromkeys(_TOTALS, 0.0)
    for family in registry.collect():
        for s in family.samples:
            short = wanted.get(s.name)
            if short is not None:
                out[short] += s.value
    return out


class StatsLine:
    """Consecutive snapshots of the registry -> the lines to log (None: nothing to say)."""

    def __init__(self, registry: Any, clock: Any = time.monotonic) -> None:
        self.registry, self.clock = registry, clock
        self.last = read_totals(registry)
        self.t = clock()
        self.was_busy = False

    def next(self) -> list[str]:
        now, cur = self.clock(), read_totals(self.registry)
        d = {k: cur[k] - self.last[k] for k in cur}
        dt = max(now - self.t, 1e-9)
        self.last, self.t = cur, now
        busy = bool(cur["running"] or cur["waiting"] or d["prompt"] or d["generation"])
        if not busy and not self.was_busy:
            return []  # idle, and the last line already said so
        self.was_busy = busy
        usage = 100.0 * cur["held"] / cur["pages"] if cur["pages"] else 0.0
        hit = 100.0 * d["hits"] / d["queries"] if d["queries"] > 0 else 0.0
        line = (f"Avg prompt throughput: {d['prompt'] / dt:.1f} tokens/s, "
                f"Avg generation throughput: {d['generation'] / dt:.1f} tokens/s, "
                f"Running: {cur['running']:.0f} reqs, Waiting: {cur['waiting']:.0f} reqs, "
                f"KV cache usage: {usage:.1f}%, Prefix cache hit rate: {hit:.1f}%")  # fmt: skip
        if d["preemptions"] > 0:
            line += f", Preemptions: {d['preemptions']:.0f}"
        lines = [line]
        if d["verify"] > 0:
            mean = 1.0 + d["accepted"] / d["verify"]
            lines.append(f"Speculative decoding: mean acceptance length {mean:.2f}, accepted "
                         f"{d['accepted']:.0f} of {d['drafted']:.0f} draft tokens in "
                         f"{d['verify']:.0f} verify steps")  # fmt: skip
        return lines


async def log_stats(registry: Any, interval: float) -> None:
    """Logs StatsLine's lines every `interval` seconds until cancelled."""
    stats = StatsLine(registry)
    while True:
        await asyncio.sleep(interval)
        for line in stats.next():
            log.info("%s", line)
