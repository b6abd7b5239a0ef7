"""What an operator reaches for beside the API, on the real server: CORS as vLLM's defaults
set it (any origin; the key still needed), /ping and /version, and the periodic stats line in
the log."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import MODEL

pytestmark = pytest.mark.slow


def test_cors_preflight_and_headers(server):
    origin = {"Origin": "http://localhost:3000"}
    pre = httpx.options(server.base_url + "/chat/completions", timeout=30, headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
    assert pre.status_code == 200, pre.text  # answered before the key check: it has none
    assert pre.headers["access-control-allow-origin"] in ("*", origin["Origin"])
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.get(server.base_url + "/models", headers={**origin, **server.headers()}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.get(server.base_url + "/models", headers=origin, timeout=30)
    assert r.status_code == 401  # CORS opens nothing the key guards


def test_ping_and_version(server):
    assert httpx.get(server.url + "/ping", timeout=30).json() == {"status": "ok"}
    assert httpx.post(server.url + "/ping", timeout=30).status_code == 200
    version = httpx.get(server.url + "/version", timeout=30).json()["version"]
    assert version and version[0].isdigit()


def test_stats_line_in_the_log(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
    r = httpx.post(server.base_url + "/completions", json=body, headers=server.headers(),
                   timeout=60)  # fmt: skip
    assert r.status_code == 200
    deadline = time.monotonic() + 20  # the session server logs every second while busy
    while time.monotonic() < deadline:
        lines = [ln for ln in server.log().splitlines() if "Avg generation throughput" in ln]
        if lines:
            break
        time.sleep(0.5)
    assert lines, server.log()[-3000:]
    assert "Running: " in lines[-1] and "KV cache usage: " in lines[-1]
    assert any("Avg generation throughput: 0.0" not in ln for ln in lines)  # counted tokens
