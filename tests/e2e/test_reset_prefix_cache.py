"""POST /reset_prefix_cache (vLLM's name) and /flush_cache (SGLang's) on the real server (the
session one, API key on): a prompt cached before a reset is not after it; while a request runs
the reset is refused with a 400 (SGLang's rule) and drops nothing; the key guards both routes."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow


def _reset(server, path: str = "/reset_prefix_cache", method: str = "POST") -> httpx.Response:
    return httpx.request(method, server.url + path, headers=server.headers(), timeout=60)


def _reset_when_idle(server, timeout: float = 30.0) -> None:
    """Reset, retrying while the server still finishes earlier tests' requests (aborts)."""
    deadline = time.monotonic() + timeout
    while (r := _reset(server)).status_code != 200:
        assert r.status_code == 400 and time.monotonic() < deadline, r.text
        time.sleep(0.2)


def test_reset_prefix_cache_and_flush_cache(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
    prompt = f"Note {uuid.uuid4().hex}: the old mill stands by the river, " * 12  # ~250 tokens

    def cached_tokens() -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    _reset_when_idle(server)
    assert cached_tokens() == 0
    assert cached_tokens() > 0
    r = _reset(server)
    assert r.status_code == 200 and r.json() == {"reset": True}, r.text
    memory = httpx.get(server.base_url + "/memory", headers=server.headers(), timeout=30).json()
    assert memory["cache_pages"] == 0  # the stats came back with the answer
    assert cached_tokens() == 0
    assert cached_tokens() > 0
    for method in ("POST", "GET"):  # SGLang's route takes both
        r = _reset(server, "/flush_cache", method)
        assert r.status_code == 200 and r.json() == {"reset": True}, r.text
        assert cached_tokens() == 0
    assert "swaserve:" in httpx.get(server.url + "/metrics", timeout=30).text

    # A request runs: refused with the OpenAI error body, nothing dropped.
    assert cached_tokens() > 0
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/completions", json=body,
                      headers=server.headers(), timeout=120) as stream:  # fmt: skip
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        for path in ("/reset_prefix_cache", "/flush_cache"):
            r = _reset(server, path)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "requests_in_flight" and "running" in err["message"]
        assert cached_tokens() > 0
    _reset_when_idle(server)  # the stream closed: its request is aborted, then the reset works
    assert cached_tokens() == 0


def test_reset_routes_need_the_api_key(server):
    for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/flush_cache"),
                         ("GET", "/flush_cache")):
        r = httpx.request(method, server.url + path, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        r = httpx.request(method, server.url + path, headers=wrong, timeout=30)
        assert r.status_code == 401
