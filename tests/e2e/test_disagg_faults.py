"""Faults of a prefill/decode pair (DESIGN §9.3), real processes on loopback, a tiny random
Llama, the local transfer backend, `--disaggregation-timeout 3`: a stalled side (SIGSTOP) is
a timeout, a killed side (SIGKILL of its engine core) a death, and a client that leaves; each
time the client gets a clear error, never a hang, every page comes back on both sides (the
cores check their pools' integrity after every move), and the surviving instance serves on.
A router given an instance that is down answers 503 with the OpenAI error body."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.e2e.disagg_servers import API_KEY, RunningRouter, idle, start_pair

pytestmark = pytest.mark.slow  # starts its own servers

TIMEOUT = ("--disaggregation-timeout", "3")
H = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def pair(tiny_model_folder, tmp_path_factory):
    """A pair that survives its tests (stalls, disconnects): [router, prefill, decode]."""
    servers = start_pair(tmp_path_factory.mktemp("pd-faults"), "local", str(tiny_model_folder),
                         TIMEOUT)
    try:
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


@pytest.fixture
def fresh_pair(tiny_model_folder, tmp_path):
    """A pair for a test that kills one side."""
    servers = start_pair(tmp_path, "local", str(tiny_model_folder), TIMEOUT)
    try:
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


def body(**kw) -> dict:
    return {"prompt": "Once upon a time " * 40, "max_tokens": 8, "temperature": 0, **kw}


def ok(srv, **kw) -> dict:
    r = httpx.post(srv.base_url + "/completions", json=body(**kw), headers=H, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(srv, **kw) -> list[dict]:
    events = []
    with httpx.stream("POST", srv.base_url + "/completions", json=body(stream=True, **kw),
                      headers=H, timeout=60) as r:
        if r.status_code != 200:
            return [json.loads(r.read())]
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_client_disconnect_frees_both_sides(pair):
    router, prefill, decode = pair
    with httpx.stream("POST", router.base_url + "/completions", headers=H, timeout=60,
                      json=body(stream=True, max_tokens=1500, ignore_eos=True)) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert "error" not in first
    for srv in (prefill, decode):
        idle(srv)
    assert ok(router)["choices"][0]["finish_reason"] == "length"
    # the same through /v1/responses, whose stream the router builds from the pair's chat one
    with httpx.stream("POST", router.base_url + "/responses", headers=H, timeout=60,
                      json={"input": "Once upon a time " * 40, "stream": True,
                            "max_output_tokens": 1500}) as r:  # fmt: skip
        assert r.status_code == 200
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert '"response.created"' in next(lines)
        assert '"response.in_progress"' in next(lines)
        assert '"error"' not in next(lines)  # the pair's first chunk reached the router
    for srv in (prefill, decode):
        idle(srv)
    assert ok(router)["choices"][0]["finish_reason"] == "length"


def test_stalled_prefill_times_out(pair):
    router, prefill, decode = pair
    pid = prefill.core_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = httpx.post(router.base_url + "/completions", json=body(), headers=H, timeout=60)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert "no KV from the prefill instance within 3 s" in r.json()["error"]["message"]
    assert took < 15
    for srv in (prefill, decode):
        idle(srv)
    ok(router)  # both serve on


def test_stalled_decode_times_out(pair):
    router, prefill, decode = pair
    pid = decode.core_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        events = stream_events(router)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "no reservation from the decode instance within 3 s" in events[-1]["error"]["message"]
    assert took < 15
    for srv in (prefill, decode):
        idle(srv)
    ok(router)


def test_killed_prefill(fresh_pair):
    """Its request fails with a clear error; the decode side's reservation is freed; the decode
    instance serves on; the router answers 503 (OpenAI body) while the prefill side is down."""
    router, prefill, decode = fresh_pair
    pid = prefill.core_pid()
    os.kill(pid, signal.SIGSTOP)  # the request reaches both sides and the reservation is made
    with httpx.stream("POST", router.base_url + "/completions", headers=H, timeout=60,
                      json=body(stream=True)) as r:
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert any("error" in line and "prefill" in line for line in lines), lines
    idle(decode)
    ok(decode)  # alone, without the router's headers
    r = httpx.post(router.base_url + "/completions", json=body(), headers=H, timeout=30)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "prefill" in err["message"], err


def test_killed_decode(fresh_pair):
    router, prefill, decode = fresh_pair
    pid = decode.core_pid()
    os.kill(pid, signal.SIGSTOP)
    with httpx.stream("POST", router.base_url + "/completions", headers=H, timeout=60,
                      json=body(stream=True)) as r:
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert any("error" in line for line in lines), lines
    idle(prefill)
    ok(prefill)
    r = httpx.post(router.base_url + "/completions", json=body(), headers=H, timeout=30)
    assert r.status_code == 503, r.text
    assert "decode" in r.json()["error"]["message"]


def test_router_with_instances_down(tmp_path):
    from tests.e2e.conftest import free_port

    router = RunningRouter([f"http://127.0.0.1:{free_port()}"],
                           [f"http://127.0.0.1:{free_port()}"], tmp_path / "router.log")
    try:
        router.wait_ready()
        for path, payload in (("/completions", body()),
                              ("/chat/completions", {"messages": [{"role": "user",
                                                                   "content": "hi"}]})):
            r = httpx.post(router.base_url + path, json=payload, headers=H, timeout=30)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error" and "prefill" in err["message"]
            assert set(err) == {"message", "type", "param", "code"}
        assert httpx.get(router.url + "/health", timeout=30).status_code == 503
    finally:
        router.stop()
