"""The playground page at `/` and `GET /v1/memory` (issue 15, item 2; docs/serving.md).

Fast tests (the session `server`, smollm2-135m-instruct with an API key, over HTTP): the page
and its files are served with no external URL in them, /v1/memory needs the key and returns
the engine's memory stats, and `--disable-playground` turns the page off.

The browser test (slow) drives the page in headless Chromium: Debian's `chromium` and
`chromium-driver` packages through Selenium, never a browser download. Run as root, it
installs what is missing (`apt-get install -y chromium chromium-driver`, `pip install
selenium`). A non-root user installs them once the same way (`sudo apt-get install -y
chromium chromium-driver`; `.venv/bin/pip install selenium` needs no root); until then the
test skips and says so. Its screenshot is kept at `test-artifacts/playground.png`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import API_KEY, MODEL

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "test-artifacts" / "playground.png"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,1100",
    "--force-device-scale-factor=1",
]
MEMORY_KEYS = {
    "page_size", "pages_total", "pages_free", "pages_held_by_requests", "pages_held_by_others",
    "groups", "cache_pages", "host_pages", "cache_hit_tokens", "evictions", "host_loads",
    "num_running", "num_waiting", "num_preemptions",
}


# ---- fast: over HTTP ------------------------------------------------------------------------


def test_page_and_its_files_are_served_with_no_external_url(server):
    page = httpx.get(server.url + "/", timeout=10)  # no key: the page itself is static
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assets = [r for r in refs if not r.startswith("data:") and r != "metrics"]
    assert sorted(assets) == ["static/playground.css", "static/playground.js"]
    bodies = {"/": page.text}
    types = {".css": "text/css", ".js": "text/javascript"}
    for ref in assets:
        r = httpx.get(f"{server.url}/{ref}", timeout=10)
        assert r.status_code == 200, ref
        assert r.headers["content-type"].startswith(types[Path(ref).suffix]), ref
        bodies[ref] = r.text
    for name, text in bodies.items():
        assert not re.search(r"https?:|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), name
        assert "@import" not in text and "url(" not in text, name
    for bad in ("/static/nope.js", "/static/..%2Fapp.py", "/static/__init__.py"):
        assert httpx.get(server.url + bad, timeout=10).status_code == 404, bad


def test_memory_needs_the_key_and_returns_the_engine_stats(server):
    r = httpx.get(server.base_url + "/memory", timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    before = httpx.get(server.base_url + "/memory", headers=server.headers(), timeout=10).json()
    assert MEMORY_KEYS <= set(before)
    assert before["pages_total"] > 0 and 0 <= before["pages_free"] <= before["pages_total"]
    held = before["pages_held_by_requests"] + before["pages_held_by_others"]
    assert held + before["pages_free"] == before["pages_total"]
    assert before["groups"] and {"index", "kind", "window", "pages_used"} <= set(
        before["groups"][0]
    )
    assert before["groups"][0]["kind"] == "full" and before["groups"][0]["window"] is None
    # A request moves the numbers: its prompt is looked up in, then added to, the cache.
    prompt = f"Playground memory check {time.time_ns()}: " + "pages and windows " * 20
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    done = httpx.post(
        server.base_url + "/completions", json=body, headers=server.headers(), timeout=60
    )
    assert done.status_code == 200, done.text
    after = httpx.get(server.base_url + "/memory", headers=server.headers(), timeout=10).json()
    assert after["cache_query_tokens"] > before["cache_query_tokens"]
    assert after["num_running"] == 0


def test_disable_playground_gives_404_at_root(monkeypatch):
    """The flag reaches ServerArgs, and an app built without the playground has no page
    (in-process: no second server); /v1/memory stays, behind the key."""
    from fastapi.testclient import TestClient

    import swaserve.server.launch as launch
    from swaserve import cli
    from swaserve.server.app import ServerState, build_app
    from swaserve.server.metrics import Metrics

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda config, args: seen.setdefault("args", args) and 0)
    assert cli.main(["serve", "--disable-playground"]) == 0
    assert seen.pop("args").playground is False
    assert cli.main(["serve"]) == 0
    assert seen.pop("args").playground is True

    class Client:  # what the routes read of CoreClient
        dead = None
        stats = {"num_running": 1, "num_waiting": 0, "num_preemptions": 0,
                 "memory": {"pages_total": 8, "pages_free": 5, "groups": []}}

    def app(playground: bool) -> TestClient:
        state = ServerState(
            client=Client(), tokenizer=None, model_name="m", chat_template=None,
            max_model_len=64, vocab_size=10, max_n=1, max_logprobs=1, api_key="k",
            metrics=Metrics(), created=0, playground=playground,
        )
        return TestClient(build_app(state))

    off, on = app(False), app(True)
    for path in ("/", "/static/playground.js"):
        r = off.get(path)
        assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found", path
        assert on.get(path).status_code == 200, path
    assert off.get("/v1/memory").status_code == 401
    mem = off.get("/v1/memory", headers={"Authorization": "Bearer k"}).json()
    assert mem == {"pages_total": 8, "pages_free": 5, "groups": [], "num_running": 1,
                   "num_waiting": 0, "num_preemptions": 0}
    assert "/v1/memory" in off.get("/openapi.json").json()["paths"]
    assert "/" not in on.get("/openapi.json").json()["paths"]
    Client.dead = "gone"
    assert on.get("/v1/memory", headers={"Authorization": "Bearer k"}).status_code == 503


# ---- slow: the page in headless Chromium ----------------------------------------------------


def _need_browser() -> tuple[str, str]:
    """Paths of chromium and chromedriver, with selenium importable; installs them as root."""
    missing = [b for b in ("chromium", "chromedriver") if shutil.which(b) is None]
    no_selenium = importlib.util.find_spec("selenium") is None
    if (missing or no_selenium) and os.geteuid() != 0:
        steps = ["as root: apt-get install -y chromium chromium-driver"] if missing else []
        if no_selenium:
            steps.append(f"{sys.executable} -m pip install selenium")
        what = ", ".join(missing + (["the selenium package"] if no_selenium else []))
        pytest.skip(f"the browser test needs {what} (not root, so not installed here): "
                    + "; ".join(steps))
    if missing:
        if shutil.which("apt-get") is None:
            pytest.skip(f"{', '.join(missing)} missing and no apt-get to install them")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
        if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True)
            assert r.returncode == 0, f"apt-get install chromium failed:\n{r.stdout}\n{r.stderr}"
    if no_selenium:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "selenium"],
                           capture_output=True, text=True)
        assert r.returncode == 0, f"pip install selenium failed:\n{r.stdout}\n{r.stderr}"
        importlib.invalidate_caches()
    return shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path):
    chromium, chromedriver = _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager (which could download one) never runs.
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


_SAMPLE = """
const m = [...document.querySelectorAll('.msg.assistant')].pop();
const kv = {};
for (const e of document.querySelectorAll('#kv-card [data-kv]')) kv[e.dataset.kv] = e.textContent;
return [m ? m.dataset.state : null,
        m ? m.querySelector('.msg-body').textContent.length : 0,
        JSON.stringify(kv)];
"""


def _kv(driver, key: str) -> int:
    value = driver.find_element("css selector", f'#kv-card [data-kv="{key}"]').get_attribute(
        "data-value"
    )
    return int(float(value)) if value not in (None, "") else -1


def _send(driver, text: str, timeout: float = 240.0) -> dict:
    """Types a message, samples the answer and the KV panel until the answer is finished."""
    from selenium.webdriver.common.keys import Keys

    n_before = len(driver.find_elements("css selector", ".msg.assistant"))
    driver.find_element("id", "input").send_keys(text, Keys.ENTER)
    streaming, panels, held = [], set(), []
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, "the answer did not finish"
        state, length, kv = driver.execute_script(_SAMPLE)
        n_now = len(driver.find_elements("css selector", ".msg.assistant"))
        panels.add(kv)
        held.append(_kv(driver, "pages_held_by_requests"))
        if n_now > n_before and state == "streaming":
            streaming.append(length)
        elif n_now > n_before and state != "streaming":
            return {"state": state, "streaming": streaming, "final": length,
                    "panels": panels, "held": held}
        time.sleep(0.02)


def _wait(driver, cond, timeout: float = 60.0, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
        lambda d: cond(d), message=what
    )


@pytest.mark.slow
def test_playground_streams_and_shows_the_kv_pool(server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    d = browser
    d.get(server.url + "/")
    # The server has a key: the page says so until it gets one.
    _wait(d, lambda d: d.find_element("id", "status-text").text == "API key needed",
          what="the page did not ask for the API key")
    d.find_element("id", "api-key").send_keys(API_KEY, Keys.ENTER)
    _wait(d, lambda d: MODEL in d.find_element("id", "model-info").text,
          what="the key was not accepted")
    _wait(d, lambda d: _kv(d, "pages_total") > 0, what="the KV panel stayed empty")
    assert d.execute_script("return sessionStorage.getItem('swaserve.playground.apiKey')") == (
        API_KEY
    )
    for field, value in (("max-tokens", "40"), ("temperature", "0.7"), ("seed", "1234")):
        el = d.find_element("id", field)
        el.clear()
        el.send_keys(value)

    turn = _send(d, "Write a short poem about a lighthouse.")
    assert turn["state"] == "done", d.find_element("css selector", ".msg.assistant").text
    grew = [n for n in turn["streaming"] if n > 0]
    assert grew == sorted(grew), "streamed text shrank"
    assert len(set(grew)) >= 3, f"the answer did not grow over several updates: {grew}"
    assert turn["final"] > min(grew)
    last = d.find_elements("css selector", ".msg.assistant")[-1]
    assert int(last.get_attribute("data-updates")) >= 3
    # The panel's numbers changed while the answer streamed: the request held pages.
    assert len(turn["panels"]) >= 2, "the KV panel did not change"
    assert max(turn["held"]) > 0, f"no pages held by requests seen: {turn['held']}"
    chip = last.find_element("css selector", ".cached-chip")
    assert re.fullmatch(r"\d+ of \d+ prompt tokens cached", chip.text), chip.text

    # A second turn reuses the first one's KV: cached tokens in the turn and the panel.
    turn2 = _send(d, "Now give it a title.")
    assert turn2["state"] == "done"
    last = d.find_elements("css selector", ".msg.assistant")[-1]
    cached = int(last.find_element("css selector", ".cached-chip").get_attribute("data-cached"))
    assert cached > 0, "the second turn took no prefix-cache hit"
    _wait(d, lambda d: _kv(d, "cache_hit_tokens") >= cached, timeout=10,
          what="the panel's cache hit tokens did not grow")

    # JSON output: the answer is held to a JSON object (response_format json_object).
    d.find_element("id", "json-mode").click()
    turn3 = _send(d, "Describe the lighthouse as JSON.")
    assert turn3["state"] == "done"
    answer = d.find_elements("css selector", ".msg.assistant")[-1]
    text = answer.find_element("css selector", ".msg-body").text
    assert text.startswith("{"), text
    d.find_element("id", "json-mode").click()

    # Hovering a token shows its logprob and the top 5 alternatives.
    d.execute_script("document.querySelector('.side').scrollTop = 0")  # the whole KV panel
    first = d.find_elements("css selector", ".msg.assistant")[0]  # turn 2's chips stay seen
    toks = first.find_elements("css selector", ".tok:not(.special)")
    assert len(toks) >= 3
    ActionChains(d).move_to_element(toks[2]).perform()
    tip = _wait(d, lambda d: d.find_element("id", "tooltip").is_displayed() and
                d.find_element("id", "tooltip"), what="no tooltip on hover")
    assert "logprob" in tip.text
    assert len(tip.find_elements("css selector", ".alt")) == 5
    time.sleep(0.6)  # one more panel refresh, then the picture

    shot = tmp_path / "playground.png"
    assert d.save_screenshot(str(shot))
    ARTIFACT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)
    assert ARTIFACT.stat().st_size > 10_000

    # Nothing failed in the page: no CSP violation, no script error. (The 401s before the
    # key was entered are expected.)
    errors = [e for e in d.get_log("browser")
              if e["level"] == "SEVERE" and "status of 401" not in e["message"]]
    assert not errors, json.dumps(errors, indent=1)


@pytest.mark.slow
def test_playground_without_chat_template_uses_completions(tiny_server_factory, browser):
    """A model with no chat template: the page says so and sends plain text to
    /v1/completions (a tiny random model, no API key)."""
    srv = tiny_server_factory()
    d = browser
    d.get(srv.url + "/")
    _wait(d, lambda d: d.find_element("id", "key-status").text == "No key needed.",
          what="the page did not connect")
    el = d.find_element("id", "max-tokens")
    el.clear()
    el.send_keys("12")
    turn = _send(d, "Hello there")
    assert turn["state"] == "done", d.find_elements("css selector", ".msg.assistant")[-1].text
    notice = d.find_element("id", "notice")
    assert notice.is_displayed() and "no chat template" in notice.text
    assert "/v1/completions" in d.find_element("id", "endpoint").text
    last = d.find_elements("css selector", ".msg.assistant")[-1]
    assert "/v1/completions" in last.find_element("css selector", ".msg-meta").text
    assert last.find_elements("css selector", ".tok")  # completions logprobs, per token
    errors = [e for e in d.get_log("browser")
              if e["level"] == "SEVERE" and "status of 400" not in e["message"]]
    assert not errors, json.dumps(errors, indent=1)
