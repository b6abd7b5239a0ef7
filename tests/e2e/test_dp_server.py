"""`swaserve serve -dp 2` on CPU: two engine-core replicas behind one frontend. Greedy outputs
equal the one-core server's, requests spread over both replicas, a shared long prefix lands
on one replica (a prefix-cache hit there), /v1/memory has both ranks; one replica's core
killed: live requests fail, /health answers 503 naming the rank, the server exits (last)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, RunningServer, check_dead_rank_1_stops_server

pytestmark = pytest.mark.slow  # starts its own server besides the session's one


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    args = ["--model", MODEL, "-dp", "2", "--device", "cpu", "--kv-cache-gb", "0.2",
            "--max-model-len", "2048"]
    srv = RunningServer(args, tmp_path_factory.mktemp("dp") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _complete(srv: RunningServer, prompt: str, max_tokens: int = 12) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(srv.base_url + "/completions", json=body, headers=srv.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _per_rank(srv: RunningServer, family: str) -> dict[str, float]:
    """The summed samples of one counter family by dp_rank."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    rank = s.labels["dp_rank"]
                    out[rank] = out.get(rank, 0.0) + s.value
    return out


def test_greedy_outputs_equal_one_core(dp_server, server):
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time"):
        assert _complete(dp_server, prompt)["choices"][0]["text"] == (
            _complete(server, prompt)["choices"][0]["text"]
        )


def test_requests_spread_over_both_replicas(dp_server):
    before = _per_rank(dp_server, "swaserve:request_success")
    for i in range(4):
        _complete(dp_server, f"Count with me {i}: one, two,", max_tokens=4)
    after = _per_rank(dp_server, "swaserve:request_success")
    grew = {r: after[r] - before.get(r, 0.0) for r in after}
    assert set(grew) == {"0", "1"} and all(v > 0 for v in grew.values()), grew


def test_shared_long_prefix_lands_on_one_replica(dp_server):
    prefix = "Here is a long shared document about rivers, lakes and seas. " * 30
    hits0 = _per_rank(dp_server, "swaserve:prefix_cache_hit_tokens")
    done0 = _per_rank(dp_server, "swaserve:request_success")
    first = _complete(dp_server, prefix + "Question one: what flows?", max_tokens=4)
    second = _complete(dp_server, prefix + "Question two: what is still?", max_tokens=4)
    assert first["usage"]["prompt_tokens"] > 256
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    hits = _per_rank(dp_server, "swaserve:prefix_cache_hit_tokens")
    done = _per_rank(dp_server, "swaserve:request_success")
    grew_hits = {r for r in hits if hits[r] > hits0.get(r, 0.0)}
    grew_done = {r: done[r] - done0.get(r, 0.0) for r in done}
    assert len(grew_hits) == 1, (hits0, hits)
    (rank,) = grew_hits
    assert grew_done[rank] == 2, grew_done


def test_memory_has_both_ranks_and_health(dp_server):
    mem = httpx.get(dp_server.base_url + "/memory", timeout=10).json()
    assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
    assert mem["pages_total"] == sum(r["pages_total"] for r in mem["ranks"])
    assert httpx.get(dp_server.url + "/health", timeout=10).status_code == 200


def test_a_dead_replica_fails_requests_and_stops_the_server(dp_server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "stream": True,
            "ignore_eos": True}
    check_dead_rank_1_stops_server(dp_server, body)
