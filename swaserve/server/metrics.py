"""Prometheus metrics of the server (names of DESIGN §11, prefix `swaserve:`).

Token counts and latencies are measured in the frontend as core outputs arrive; queue
lengths and KV pages come from the stats the core sends with every step. Pages are reported
three ways: per attention group held by requests (`kv_pages_used{group}`), in total held by
requests, and held by the cache (pages no request references: prefix cache, host loads).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

P = "swaserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def group_label(g: dict) -> str:
    """`0:full`, `1:swa512`: the group index and its kind."""
    kind = g["kind"] if g.get("window") is None else f"{g['kind']}{g['window']}"
    return f"{g['index']}:{kind}"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(P + "num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Sequences waiting", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(
            P + "request_success", "Requests finished, by reason", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Time to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Latency between tokens, per token",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.kv_pages_used = Gauge(
            P + "kv_pages_used",
            "KV pages held by requests, per attention group",
            ["group"],
            registry=r,
        )
        self.kv_pages_requests = Gauge(
            P + "kv_pages_held_by_requests", "KV pages held by running requests", registry=r
        )
        self.kv_pages_cache = Gauge(
            P + "kv_pages_held_by_cache", "KV pages held only by the cache", registry=r
        )
        self.kv_pages_free = Gauge(P + "kv_pages_free", "Free KV pages", registry=r)
        self.kv_pages_total = Gauge(P + "kv_pages_total", "KV pages in the pool", registry=r)
        self.preemptions = Gauge(P + "num_preemptions", "Preemptions since start", registry=r)
        self.prefix_hits = Counter(
            P + "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_queries = Counter(
            P + "prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        # Prefix cache and host tier (DESIGN §3, §4), from the core's memory_stats().
        self.cache_pages = Gauge(
            P + "prefix_cache_device_pages", "Device KV pages held by the prefix cache",
            registry=r,
        )
        self.host_pages = Gauge(
            P + "prefix_cache_host_pages", "Host-tier KV pages held by the prefix cache",
            registry=r,
        )
        self.evictions = Gauge(
            P + "prefix_cache_evictions", "Pages evicted from the device cache since start",
            registry=r,
        )
        self.host_loads = Gauge(
            P + "prefix_cache_host_loads", "Pages loaded back from the host tier since start",
            registry=r,
        )
        self.core_alive = Gauge(P + "engine_core_alive", "1 while the core runs", registry=r)
        self.core_alive.set(1)

    def update_core_stats(self, stats: dict) -> None:
        if not stats:
            return
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.preemptions.set(stats.get("num_preemptions", 0))
        mem = stats.get("memory", {})
        for g in mem.get("groups", []):
            self.kv_pages_used.labels(group=group_label(g)).set(g["pages_used"])
        self.kv_pages_requests.set(mem.get("pages_held_by_requests", 0))
        self.kv_pages_cache.set(mem.get("pages_held_by_others", 0))
        self.kv_pages_free.set(mem.get("pages_free", 0))
        self.kv_pages_total.set(mem.get("pages_total", 0))
        self.cache_pages.set(mem.get("cache_pages", 0))
        self.host_pages.set(mem.get("host_pages", 0))
        self.evictions.set(mem.get("evictions", 0))
        self.host_loads.set(mem.get("host_loads", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
