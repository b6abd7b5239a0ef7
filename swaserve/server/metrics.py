"""Prometheus metrics of the server (names and meanings: docs/serving.md, Metrics).

Token counts and latencies are measured in the frontend as core outputs arrive, per core
request (one sample): TTFT and end-to-end latency from the request's arrival at the
frontend, ITL per token, TPOT per finished request ((e2e - ttft) / (tokens - 1)). Queue time
(arrival in the core until first scheduled) is measured by the core and sent with its
outputs. Queue lengths, KV pages and the core's running totals (preemptions, evictions, host
loads) come from the stats the core sends with every step; the totals feed counters by
their growth. Pages are reported three ways: per attention group held by requests
(`kv_pages_used{group}`), in total held by requests, and held by the cache (pages no request
references: prefix cache, host loads); `kv_cache_usage_perc` is the fraction of the pool
held by requests (pages only the cache holds are evictable, so free as in vLLM).

Counters are exported with `_total` (as prometheus_client names them), without `_created`
series.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

P = "swaserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280)

def group_label(g: dict) -> str:
    """`0:full`, `1:swa512`: the group index and its kind."""
    kind = g["kind"] if g.get("window") is None else f"{g['kind']}{g['window']}"
    return f"{g['index']}:{kind}"


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # process-wide: the server's one registry is this one
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
        self.kv_usage = Gauge(
            P + "kv_cache_usage_perc",
            "Fraction of the KV pool's pages held by requests (0..1)",
            registry=r,
        )
        self.preemptions = Counter(P + "num_preemptions", "Preemptions", registry=r)
        self.parks = Counter(P + "num_parked_prompts",
                             "Prompts prefilled ahead and parked (--prefill-ahead-tokens)",
                             registry=r)  # fmt: skip
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Request latency, arrival to last token, per finished sequence",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            P + "time_per_output_token_seconds",
            "Per finished sequence: (e2e - ttft) / (output tokens - 1)",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Time a sequence waited in the core until it was first scheduled",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.prefix_hits = Counter(
            P + "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_queries = Counter(
            P + "prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        # Prefix cache and host tier (docs/architecture.md §5, §6), from the core's memory_stats().
        self.cache_pages = Gauge(
            P + "prefix_cache_device_pages", "Device KV pages held by the prefix cache",
            registry=r,
        )
        self.host_pages = Gauge(
            P + "prefix_cache_host_pages", "Host-tier KV pages held by the prefix cache",
            registry=r,
        )
        self.evictions = Counter(
            P + "prefix_cache_evictions", "Pages evicted from the device cache", registry=r
        )
        self.host_loads = Counter(
            P + "prefix_cache_host_loads", "Pages loaded back from the host tier", registry=r
        )
        self._core_totals: dict[str, float] = {}  # last seen running totals of the core
        # Speculative decoding (docs/architecture.md §8), counted when a request finishes.
        self.spec_drafts = Counter(
            P + "spec_decode_num_drafts", "Verify steps (forwards that checked drafts)",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            P + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.spec_accepted_tokens = Counter(
            P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position",
            ["position"],
            registry=r,
        )
        self.core_alive = Gauge(P + "engine_core_alive", "1 while the core runs", registry=r)
        self.core_alive.set(1)
        self.transfer: Any = None  # PD instances: disaggregation/transfer_stats.TransferMetrics

    def observe_spec(self, spec: dict) -> None:
        """A finished request's speculative decoding counters (vLLM's metric names):
        verify steps, drafts proposed, drafts accepted, and accepted drafts per position
        (position i counts the verify steps that accepted more than i drafts)."""
        h = spec["spec_accept_histogram"]
        self.spec_drafts.inc(spec["spec_verify_ct"])
        self.spec_draft_tokens.inc(spec["spec_proposed_drafts"])
        self.spec_accepted_tokens.inc(spec["spec_accepted_drafts"])
        for pos in range(len(h) - 1):
            self.spec_accepted_per_pos.labels(position=str(pos)).inc(sum(h[pos + 1 :]))

    def update_core_stats(self, stats: dict) -> None:
        if not stats:
            return
        if "kv_transfer" in stats:  # a PD instance's transfers (DESIGN §11 names)
            if self.transfer is None:
                from swaserve.disaggregation.transfer_stats import TransferMetrics

                self.transfer = TransferMetrics(self.registry, P)
            self.transfer.update(stats["kv_transfer"])
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        mem = stats.get("memory", {})
        for g in mem.get("groups", []):
            self.kv_pages_used.labels(group=group_label(g)).set(g["pages_used"])
        held, total = mem.get("pages_held_by_requests", 0), mem.get("pages_total", 0)
        self.kv_pages_requests.set(held)
        self.kv_pages_cache.set(mem.get("pages_held_by_others", 0))
        self.kv_pages_free.set(mem.get("pages_free", 0))
        self.kv_pages_total.set(total)
        self.kv_usage.set(held / total if total else 0.0)
        self.cache_pages.set(mem.get("cache_pages", 0))
        self.host_pages.set(mem.get("host_pages", 0))
        self._grow(self.preemptions, "num_preemptions", stats.get("num_preemptions", 0))
        self._grow(self.parks, "num_parks", stats.get("num_parks", 0))
        self._grow(self.evictions, "evictions", mem.get("evictions", 0))
        self._grow(self.host_loads, "host_loads", mem.get("host_loads", 0))

    def _grow(self, counter: Counter, key: str, total: float) -> None:
        """The counter grows by what the core's running total grew since the last stats."""
        delta = total - self._core_totals.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._core_totals[key] = total

    def observe_finished(self, e2e: float, ttft: float, num_tokens: int) -> None:
        """A sequence finished (stop or length): its latency and, past one token, its TPOT."""
        self.e2e.observe(e2e)
        if num_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
