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

Reasoning and tool calls (slow, the same server: `--reasoning-parser qwen3`, `--tool-call-parser
hermes`): SmolLM2 does not think, so the page's delta logic (`applyDelta`, pure) and its
rendering are driven with synthetic deltas and streams made up in the page (a wrapped
`fetch`); one real run holds SmolLM2 to a call with tool_choice "required".
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
    "num_running", "num_waiting", "num_preemptions", "num_parks",
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
                   "num_waiting": 0, "num_preemptions": 0, "num_parks": 0}
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

    d = browser
    _connect(d, server)  # the server has a key: the page asks for it until it gets one
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


# ---- slow: reasoning and tool calls ----------------------------------------------------------

# Records every chat request's body in window.__bodies; while window.__scripts holds a list of
# chunks, the next chat request gets them as its stream instead of going to the server ("pause"
# in a list waits until the test calls window.__gates.shift()()). Other requests pass through.
_FAKE_CHAT = r"""
window.__bodies = [];
window.__scripts = [];
window.__gates = [];
const realFetch = window.fetch.bind(window);
window.fetch = (url, opts) => {
  if (!String(url).includes("chat/completions")) return realFetch(url, opts);
  window.__bodies.push(JSON.parse(opts.body));
  const script = window.__scripts.shift();
  if (!script) return realFetch(url, opts);
  const enc = new TextEncoder();
  const stream = new ReadableStream({
    async start(ctrl) {
      for (const item of script) {
        if (item === "pause") {
          await new Promise((go) => window.__gates.push(go));
          continue;
        }
        ctrl.enqueue(enc.encode("data: " + JSON.stringify(item) + "\n\n"));
      }
      ctrl.enqueue(enc.encode("data: [DONE]\n\n"));
      ctrl.close();
    },
  });
  return Promise.resolve(new Response(stream, {
    status: 200, headers: {"Content-Type": "text/event-stream"},
  }));
};
"""


def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None):
    if usage is not None:
        return {"object": "chat.completion.chunk", "choices": [], "usage": usage}
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}


def _call(index: int, args: str, name: str | None = None, cid: str | None = None) -> dict:
    piece: dict = {"index": index, "function": {"arguments": args}}
    if name is not None:
        piece["function"]["name"] = name
        piece["type"] = "function"
    if cid is not None:
        piece["id"] = cid
    return {"tool_calls": [piece]}


# Three calls split across deltas, interleaved by index: the third has no id and its arguments
# are not JSON.
_CALL_DELTAS = [
    _call(0, "", "get_weather", "call_a"),
    _call(1, '{"tz"', "get_time", "call_b"),
    _call(0, '{"city": '),
    _call(1, ': "UTC"}'),
    _call(0, '"Paris"}'),
    _call(2, "not json", "echo"),
]
_USAGE = {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
          "prompt_tokens_details": {"cached_tokens": 0}}


def _connect(d, server) -> None:
    """Open the page; it asks for the API key until it gets one and then shows the model."""
    from selenium.webdriver.common.keys import Keys

    d.get(server.url + "/")
    _wait(d, lambda d: d.find_element("id", "status-text").text == "API key needed",
          what="the page did not ask for the API key")
    d.find_element("id", "api-key").send_keys(API_KEY, Keys.ENTER)
    _wait(d, lambda d: MODEL in d.find_element("id", "model-info").text,
          what="the key was not accepted")


def _last(d, what: str = ".msg.assistant"):
    return d.find_elements("css selector", what)[-1]


def _type(d, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    d.find_element("id", "input").send_keys(text, Keys.ENTER)


def _fields(d, values: dict[str, str]) -> None:
    for field, value in values.items():
        el = d.find_element("id", field)
        el.clear()
        el.send_keys(value)


def _choose(d, choice: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(d.find_element("id", "tool-choice")).select_by_value(choice)


def _set_tools(d, text: str, choice: str) -> None:
    """Puts `text` in the Tools editor (as typing would: an input event) and picks `choice`."""
    d.execute_script("const t = document.getElementById('tools'); t.value = arguments[0];"
                     "t.dispatchEvent(new Event('input'));", text)  # fmt: skip
    _choose(d, choice)


def _severe(d, allowed: tuple[str, ...] = ("status of 401",)) -> list:
    return [e for e in d.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allowed)]


@pytest.mark.slow
def test_playground_reasoning_and_tool_call_deltas(server, browser):
    """The stream-delta logic (applyDelta, pure) on synthetic deltas, then the page on synthetic
    streams: reasoning in a "Thinking" block, open while it streams and folded once the answer
    starts, and never sent back; tool calls accumulated by index into cards, sent back with
    their results; the Tools editor's inline error. The session server (--reasoning-parser
    qwen3) serves the page; SmolLM2 does not think, so the streams are made up in the page."""
    d = browser
    _connect(d, server)

    # applyDelta: pure, the turn accumulated; tool calls by index.
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Let me "},
              {"reasoning_content": "think."}, {"reasoning_content": " Done.", "content": "Hi"},
              {"content": " there"}, *_CALL_DELTAS]  # fmt: skip
    got = d.execute_script("""
        const P = window.swaservePlayground;
        const first = P.emptyTurn();
        let t = first;
        const added = [];
        for (const delta of arguments[0]) {
          const r = P.applyDelta(t, delta);
          added.push(r.added);
          t = r.turn;
        }
        return {first, turn: t, added, message: P.assistantMessage(t),
                pretty: P.formatArgs('{"a": [1, 2]}'), raw: P.formatArgs('{"a": '),
                tools: ["", "[", "{}", "[{}]", "[]",
                        '[{"type": "function", "function": {"name": "f"}}]'].map(P.parseTools)};
    """, deltas)
    assert got["first"] == {"reasoning": "", "content": "", "toolCalls": []}  # not changed
    turn = got["turn"]
    assert turn["reasoning"] == "Let me think. Done." and turn["content"] == "Hi there"
    assert [a["reasoning"] for a in got["added"][:4]] == ["", "Let me ", "think.", " Done."]
    assert got["added"][3]["content"] == "Hi"
    assert [a["calls"] for a in got["added"][5:]] == [[0], [1], [0], [1], [0], [2]]
    assert [(c["index"], c["id"], c["name"], c["arguments"]) for c in turn["toolCalls"]] == [
        (0, "call_a", "get_weather", '{"city": "Paris"}'),
        (1, "call_b", "get_time", '{"tz": "UTC"}'),
        (2, "", "echo", "not json"),
    ]
    assert got["message"] == {"role": "assistant", "content": "Hi there", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "echo", "arguments": "not json"}},
    ]}  # fmt: skip
    assert got["pretty"] == {"json": True, "text": '{\n  "a": [\n    1,\n    2\n  ]\n}'}
    assert got["raw"] == {"json": False, "text": '{"a": '}
    ok = [(t["tools"] is not None, t["error"] is None) for t in got["tools"]]
    assert ok == [(False, True), (False, False), (False, False), (False, False), (False, True),
                  (True, True)]  # fmt: skip

    # Turn 1 on the page: reasoning, then the answer.
    d.execute_script(_FAKE_CHAT)
    d.execute_script("window.__scripts.push(arguments[0])", [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "The user says hi. "}),
        _chunk({"reasoning_content": "I greet them back."}),
        "pause",
        _chunk({"content": "Hello"}),
        "pause",
        _chunk({"content": " there!"}),
        _chunk({}, "stop"),
        _chunk(usage=_USAGE),
    ])  # fmt: skip
    _type(d, "Hi")
    _wait(d, lambda d: d.execute_script("return window.__gates.length") == 1, timeout=10,
          what="the stream did not reach its first pause")
    msg = _last(d)
    thinking = msg.find_element("css selector", "details.thinking")
    assert thinking.get_attribute("open") is not None, "the Thinking block is not open"
    assert msg.get_attribute("data-phase") == "thinking"
    assert msg.find_element("css selector", ".thinking-body").text == (
        "The user says hi. I greet them back.")
    assert not msg.find_element("css selector", ".msg-body").is_displayed()
    d.execute_script("window.__gates.shift()()")
    _wait(d, lambda d: msg.find_element("css selector", ".msg-body").text == "Hello",
          timeout=10, what="the answer did not start")
    assert thinking.get_attribute("open") is None, "the Thinking block did not fold"
    assert msg.get_attribute("data-state") == "streaming"
    assert msg.find_element("css selector", ".thinking-label").text == "Thinking"
    d.execute_script("window.__gates.shift()()")
    _wait(d, lambda d: msg.get_attribute("data-state") == "done", timeout=10,
          what="turn 1 did not finish")
    assert msg.find_element("css selector", ".msg-body").text == "Hello there!"
    assert thinking.get_attribute("open") is None
    thinking.find_element("css selector", "summary").click()  # it opens on demand
    assert "I greet them back." in thinking.text
    assert "finish: stop" in msg.find_element("css selector", ".msg-meta").text

    # Turn 2: three calls, split across deltas by index; the reasoning stays out of the history.
    d.execute_script("window.__scripts.push(arguments[0])", [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning_content": "I need the weather and the time."}),
        *[_chunk(c) for c in _CALL_DELTAS],
        _chunk({}, "tool_calls"),
        _chunk(usage=_USAGE),
    ])  # fmt: skip
    _type(d, "Weather and time in Paris?")
    _wait(d, lambda d: len(d.find_elements("css selector", ".msg.assistant")) == 2
          and _last(d).get_attribute("data-state") == "done", timeout=10,
          what="turn 2 did not finish")
    msg = _last(d)
    body2 = d.execute_script("return window.__bodies[1]")
    assert body2["messages"] == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there!"},
        {"role": "user", "content": "Weather and time in Paris?"},
    ]
    assert "tools" not in body2 and "tool_choice" not in body2  # the editor is empty
    assert not msg.find_element("css selector", ".msg-body").is_displayed()  # calls only
    assert msg.find_element("css selector", "details.thinking").get_attribute("open") is None
    cards = msg.find_elements("css selector", ".tool-call")
    assert [c.get_attribute("data-name") for c in cards] == ["get_weather", "get_time", "echo"]
    assert [c.find_element("css selector", ".tool-name").text for c in cards] == [
        "get_weather", "get_time", "echo"]
    args = [c.find_element("css selector", ".tool-args") for c in cards]
    assert args[0].text == json.dumps({"city": "Paris"}, indent=2)
    assert args[1].text == json.dumps({"tz": "UTC"}, indent=2)
    assert args[2].text == "not json" and "raw" in args[2].get_attribute("class")
    assert "call_a" in cards[0].text
    assert "finish: tool_calls" in msg.find_element("css selector", ".msg-meta").text

    # The results, one per call: the last one sends them all back and the model goes on.
    d.execute_script("window.__scripts.push(arguments[0])", [
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Sunny, and it is noon."}),
        _chunk({}, "stop"),
    ])  # fmt: skip
    results = ['{"sky": "sunny"}', "12:00", "echoed"]
    for card, result in zip(cards, results):
        card.find_element("css selector", ".tool-result input").send_keys(result)
        card.find_element("css selector", ".tool-result button").click()
        if result != results[-1]:
            assert d.execute_script("return window.__bodies.length") == 2  # not yet
    _wait(d, lambda d: len(d.find_elements("css selector", ".msg.assistant")) == 3
          and _last(d).get_attribute("data-state") == "done", timeout=10,
          what="the turn after the tool results did not finish")
    tool_msgs = d.find_elements("css selector", ".msg.tool")
    assert [m.find_element("css selector", ".msg-body").text for m in tool_msgs] == results
    body3 = d.execute_script("return window.__bodies[2]")
    assert body3["messages"][3:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "echo", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": results[0]},
        {"role": "tool", "tool_call_id": "call_b", "content": results[1]},
        {"role": "tool", "tool_call_id": "call_2", "content": results[2]},
    ]  # fmt: skip
    assert _last(d).find_element("css selector", ".msg-body").text == "Sunny, and it is noon."

    # The Tools editor: invalid JSON is an inline error and nothing is sent; a valid list goes
    # out with the chosen tool_choice.
    _set_tools(d, '[{"type": "function", "function": {"name": ', "none")
    err = d.find_element("id", "tools-error")
    assert err.is_displayed() and "not valid JSON" in err.text
    _type(d, "Anything else?")
    time.sleep(0.3)
    assert d.execute_script("return window.__bodies.length") == 3
    assert d.find_element("id", "input").get_attribute("value") == "Anything else?"
    assert len(d.find_elements("css selector", ".msg.user")) == 2
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    _set_tools(d, json.dumps(tools), "none")
    assert not err.is_displayed()
    assert d.find_element("id", "tools-summary").text == "1 tool: get_weather"
    d.execute_script("window.__scripts.push(arguments[0])",
                     [_chunk({"content": "No."}), _chunk({}, "stop")])  # fmt: skip
    _type(d, "")  # the text is still there: Enter sends it
    _wait(d, lambda d: d.execute_script("return window.__bodies.length") == 4, timeout=10,
          what="the fixed tools were not sent")
    body4 = d.execute_script("return window.__bodies[3]")
    assert body4["tools"] == tools and body4["tool_choice"] == "none"
    assert body4["messages"][-1] == {"role": "user", "content": "Anything else?"}
    _wait(d, lambda d: _last(d).get_attribute("data-state") == "done", timeout=10)
    assert not _severe(d), json.dumps(_severe(d), indent=1)


@pytest.mark.slow
def test_playground_tool_call_against_the_server(server, browser):
    """A real run: tools with tool_choice "required" (a grammar holds SmolLM2 to a call) show a
    card naming one of the tools; its result sent back goes on to a text answer
    (tool_choice "none"). A tools request the server refuses (400) shows as the page shows
    errors, and the turn is not kept."""
    d = browser
    _connect(d, server)
    d.execute_script(_FAKE_CHAT)  # no scripts: requests go to the server, their bodies kept
    _fields(d, {"max-tokens": "48", "temperature": "0"})  # room for one call, spaces and all

    # Refused: a tool name with a space (the server's 400, shown in the turn).
    _set_tools(d, json.dumps([{"type": "function", "function": {"name": "bad name"}}]),
               "required")
    _type(d, "Hello")
    _wait(d, lambda d: d.find_elements("css selector", ".msg.assistant")
          and _last(d).get_attribute("data-state") == "error", timeout=30,
          what="the refused request did not show an error")
    assert "must be 1 to 64 letters" in _last(d).find_element("css selector", ".msg-body").text

    names = ["get_weather", "get_time"]
    tools = [
        {"type": "function", "function": {
            "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]}},
                "required": ["city"]}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "The current time in a time zone.",
            "parameters": {"type": "object", "properties": {
                "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}},
    ]  # fmt: skip
    _set_tools(d, json.dumps(tools), "required")
    _type(d, "What is the weather in Paris?")
    _wait(d, lambda d: len(d.find_elements("css selector", ".msg.assistant")) == 2
          and _last(d).get_attribute("data-state") != "streaming", timeout=120,
          what="the tool call did not finish")
    msg = _last(d)
    assert msg.get_attribute("data-state") == "done", msg.text
    cards = msg.find_elements("css selector", ".tool-call")
    assert cards, msg.text
    assert cards[0].get_attribute("data-name") in names
    args = json.loads(cards[0].find_element("css selector", ".tool-args").text)
    assert isinstance(args, dict)
    # "tool_calls", or "length" where SmolLM2 went on to a second call (parallel calls are on)
    meta = msg.find_element("css selector", ".msg-meta").text
    assert re.search(r"finish: (tool_calls|length)", meta), meta
    sent = d.execute_script("return window.__bodies")
    assert [m["role"] for m in sent[-1]["messages"]] == ["user"]  # the refused turn is gone
    assert sent[-1]["tool_choice"] == "required" and sent[-1]["tools"] == tools

    # Each call's result, then the answer in text: the server takes the history back.
    _choose(d, "none")
    _fields(d, {"max-tokens": "8"})
    for card in cards:
        card.find_element("css selector", ".tool-result input").send_keys('{"result": "sunny"}')
        card.find_element("css selector", ".tool-result button").click()
    _wait(d, lambda d: len(d.find_elements("css selector", ".msg.assistant")) == 3
          and _last(d).get_attribute("data-state") != "streaming", timeout=120,
          what="the answer after the tool result did not finish")
    assert _last(d).get_attribute("data-state") == "done", _last(d).text
    last_body = d.execute_script("return window.__bodies")[-1]
    roles = [m["role"] for m in last_body["messages"]]
    assert roles == ["user", "assistant"] + ["tool"] * len(cards)
    assert len(last_body["messages"][1]["tool_calls"]) == len(cards)
    errors = _severe(d, ("status of 401", "status of 400"))  # the refused request's 400
    assert not errors, json.dumps(errors, indent=1)
