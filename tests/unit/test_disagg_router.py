"""The PD router without servers (swaserve/disaggregation/router.py and its parts): which
instance takes a request (prefix affinity, the load threshold, down instances skipped and
coming back), the prompt keys, the 400s that never leave the router, and retries on another
pair against instances simulated by an httpx mock transport."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from swaserve.disaggregation.forward import validate
from swaserve.disaggregation.instance_pool import BACKOFF_S, MAX_BACKOFF_S, InstancePool
from swaserve.disaggregation.prompt_keys import num_sequences, prompt_keys
from swaserve.disaggregation.router import Router, build_router_app
from swaserve.server.app import APIError

LONG = "You are a careful assistant who answers in French. " * 30  # 1,530 characters


def up_pool(n: int, role: str = "decode") -> InstancePool:
    pool = InstancePool([f"http://h:{i}" for i in range(n)], role)
    for inst in pool.instances:
        inst.mark_up({"mode": role})
    return pool


def keys_of(prompt: str) -> list[tuple]:
    return prompt_keys(validate("/v1/completions", {"prompt": prompt}))


# ---- the choice ---------------------------------------------------------------------------


def test_least_loaded_then_fewest_routed_without_affinity():
    pool = up_pool(3)
    a, b, c = pool.instances
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 1
    b.routed, c.routed = 5, 2
    assert pool.choose([]) is c
    assert pool.choose(keys_of("short")) is c  # too short for a key: load alone


def test_shared_prefix_goes_to_the_same_instance():
    pool = up_pool(2)
    first = pool.choose(keys_of(LONG + "Question one?"))
    pool.record(first, keys_of(LONG + "Question one?"))
    first.in_flight += 1  # busier, yet within the margin
    assert pool.choose(keys_of(LONG + "Question two?")) is first
    other = pool.choose(keys_of("Another prompt entirely. " * 20))
    assert other is not first  # no affinity: the least loaded


def test_load_threshold_overrides_affinity():
    pool = up_pool(2)
    a, b = pool.instances
    pool.record(a, keys_of(LONG))
    a.in_flight = pool.margin
    assert pool.choose(keys_of(LONG)) is a  # at the margin: still affine
    a.in_flight = pool.margin + 1
    assert pool.choose(keys_of(LONG)) is b


def test_down_instances_are_skipped_and_come_back():
    pool = up_pool(2)
    a, b = pool.instances
    pool.record(a, keys_of(LONG))
    a.mark_down("ConnectError: refused", now=100.0)
    assert pool.choose(keys_of(LONG)) is b
    assert pool.choose(keys_of(LONG), exclude={b}) is None
    assert pool.due(now=100.0 + BACKOFF_S / 2) == [] and pool.due(now=100.0 + BACKOFF_S) == [a]
    a.mark_down("ConnectError: refused", now=200.0)  # failed again: a longer back-off
    assert pool.due(now=200.0 + BACKOFF_S) == [] and pool.due(now=200.0 + 2 * BACKOFF_S) == [a]
    for _ in range(2000):  # a long outage: the back-off stays bounded
        a.mark_down("ConnectError: refused", now=300.0)
    assert a.retry_at == 300.0 + MAX_BACKOFF_S
    a.mark_up({"mode": "decode"})
    assert a.failures == 0 and pool.choose(keys_of(LONG)) is a  # its affinity is kept
    assert "refused" not in pool.describe()


# ---- the prompt keys ----------------------------------------------------------------------


def chat(*contents: str, **kw) -> dict:
    roles = ["system", "user", "assistant", "user"]
    msgs = [{"role": roles[i % 4], "content": c} for i, c in enumerate(contents)]
    return {"messages": msgs, **kw}


def chat_keys(body: dict) -> list[tuple]:
    return prompt_keys(validate("/v1/chat/completions", body))


def test_prompt_keys():
    assert keys_of("hello") == []
    one, two = keys_of(LONG + "A?"), keys_of(LONG + "B?")
    assert [k for k, _ in one] == [256, 1024] and one == two
    assert keys_of("x" + LONG)[0] != one[0]
    ids = list(range(300))
    k_ids = prompt_keys(validate("/v1/completions", {"prompt": ids}))
    assert [k for k, _ in k_ids] == [64, 256]  # token ids: token lengths
    batch = prompt_keys(validate("/v1/completions", {"prompt": [LONG + "A?", "other"]}))
    assert batch == one  # a batch is keyed by its first prompt
    # Chat: a shared system prompt (and first turns) share keys; text parts count as text.
    a, b = chat_keys(chat(LONG, "Hi")), chat_keys(chat(LONG, "Bye", "x", "y"))
    assert a and a[0] == b[0]
    parts = chat_keys({"messages": [{"role": "system", "content": [{"type": "text",
                                                                     "text": LONG}]},
                                    {"role": "user", "content": "Hi"}]})
    assert parts == a
    assert chat_keys(chat(LONG, "Hi"))[0] != chat_keys({"messages": [
        {"role": "user", "content": LONG}, {"role": "user", "content": "Hi"}]})[0]


def test_num_sequences():
    assert num_sequences(validate("/v1/completions", {"prompt": "x", "n": 3})) == 3
    assert num_sequences(validate("/v1/completions", {"prompt": ["a", "b"], "n": 2})) == 4
    assert num_sequences(validate("/v1/chat/completions", chat("x"))) == 1


# ---- malformed requests stop at the router --------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", [1, 2], None),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
         "messages"),
        ("/v1/chat/completions", {"messages": [], "tools": []}, "tools"),
    ],
)
def test_malformed_requests_stop_at_the_router(path, body, param):
    with pytest.raises(APIError) as e:
        validate(path, body)
    assert e.value.status == 400
    if param is not None:
        assert e.value.param is not None and e.value.param.startswith(param), e.value.param


def test_valid_requests_pass():
    validate("/v1/completions", {"prompt": [1, 2, 3], "n": 2, "stream": True,
                                 "stream_options": {"include_usage": True}})
    validate("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "logprobs": True, "top_logprobs": 2})


# ---- retries, against simulated instances ---------------------------------------------------


class Fleet:
    """Instances answered by an httpx mock transport: `dead` ones refuse connections."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.urls = {"prefill": [f"http://p{i}:1" for i in range(prefill)],
                     "decode": [f"http://d{i}:1" for i in range(decode)]}
        self.dead: set[str] = set()
        self.refusing: dict[str, int] = {}  # instance url -> the error status it answers
        self.cut_streams = False  # decode streams break after their first chunk
        self.calls: list[tuple[str, str]] = []  # (instance url, path) of delivered POSTs

    def handler(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        role = "prefill" if url in self.urls["prefill"] else "decode"
        if request.url.path == "/v1/disaggregation":
            return httpx.Response(200, json={"mode": role, "bootstrap": f"tcp://{url}"})
        self.calls.append((url, request.url.path))
        if url in self.refusing:
            status = self.refusing[url]
            return httpx.Response(status, json={"error": {
                "message": "queue full" if status == 503 else "boom", "type": "server_error",
                "param": None, "code": status}})
        if request.url.path == "/reset_prefix_cache":
            return httpx.Response(200, json={"reset": True})
        if role == "prefill":
            return httpx.Response(200, json={"sent": True})
        if json.loads(request.content).get("stream"):
            async def sse():  # a body streamed as a real one is
                yield b'data: {"choices": [{"index": 0, "text": "hi"}]}\n\n'
                if self.cut_streams:
                    raise httpx.ReadError("connection reset")
                yield b"data: [DONE]\n\n"

            return httpx.Response(200, content=sse(), headers={"content-type":
                                                                "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"index": 0, "text": url}]})

    def router(self) -> tuple[Router, TestClient]:
        router = Router(self.urls["prefill"], self.urls["decode"], None)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler))
        return router, TestClient(build_router_app(router))


def post(client: TestClient, prompt: str = LONG, **kw) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **kw})


def test_an_unreachable_decode_instance_sends_the_request_to_another_pair():
    fleet = Fleet(1, 2)
    router, client = fleet.router()
    with client:
        r = post(client)
        assert r.status_code == 200
        home = r.json()["choices"][0]["text"]  # the decode instance that served it
        assert post(client, LONG + "again").json()["choices"][0]["text"] == home  # affinity
        fleet.dead.add(home)
        fleet.calls.clear()
        for stream in (False, True):
            r = post(client, LONG + "more", stream=stream)
            assert r.status_code == 200 and "error" not in r.text, r.text
        other = next(u for u in fleet.urls["decode"] if u != home)
        assert [u for u, _ in fleet.calls if u.startswith("http://d")] == [other, other]
        dead = next(i for i in router.decode.instances if i.url == home)
        assert not dead.up and "refused" in dead.error
        assert dead.in_flight == 0 and all(i.in_flight == 0 for i in router.instances)
        # Its back-off over and the instance back: a probe brings it back, affinity with it.
        fleet.dead.clear()
        dead.retry_at = 0.0
        post(client, "a prompt without affinity")  # probes it in the background
        for _ in range(200):
            if dead.up:
                break
            time.sleep(0.01)
        assert dead.up and dead.failures == 0
        assert post(client, LONG + "back").json()["choices"][0]["text"] == home


def test_an_unreachable_prefill_instance_costs_no_decode_call():
    fleet = Fleet(2, 1)
    fleet.dead.add(fleet.urls["prefill"][0])
    router, client = fleet.router()
    with client:
        r = post(client)
        assert r.status_code == 200, r.text
        assert fleet.calls == [(fleet.urls["prefill"][1], "/v1/completions"),
                               (fleet.urls["decode"][0], "/v1/completions")]


def test_503_with_the_openai_body_only_when_no_pair_is_up():
    fleet = Fleet(1, 2)
    router, client = fleet.router()
    with client:
        assert post(client).status_code == 200
        fleet.dead.update(fleet.urls["decode"])
        fleet.calls.clear()
        for path, body in (("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", chat("x"))):
            r = client.post(path, json=body)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "server_error" and "no decode instance" in err["message"]
            assert "refused" in err["message"]
        # The prefill instance got the first attempt's call (aborted); no decode call reached.
        assert all(u.startswith("http://p") for u, _ in fleet.calls)
        assert all(i.in_flight == 0 for i in router.instances)


def test_no_retry_once_bytes_reached_the_client():
    """A decode instance that fails mid-stream ends the stream with an error event; the request
    is never sent to the other decode instance."""
    fleet = Fleet(1, 2)
    fleet.cut_streams = True
    router, client = fleet.router()
    with client:
        r = post(client, stream=True)
        assert r.status_code == 200
        events = [line for line in r.text.splitlines() if line.startswith("data: {")]
        assert '"hi"' in events[0] and "error" in events[-1] and "decode instance" in events[-1]
        assert [u for u, _ in fleet.calls if u.startswith("http://d")] == [fleet.urls["decode"][0]]
        assert all(i.in_flight == 0 for i in router.instances)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_503_answer_sends_the_request_to_another_pair(role):
    """An instance that answers 503 (queue full, engine core gone) runs nothing of the
    request: another pair takes it, the instance is marked down, the retry counted once.
    Any other error status goes to the client."""
    fleet = Fleet(2, 2)
    router, client = fleet.router()
    with client:
        assert post(client).status_code == 200
        victim = fleet.calls[0][0] if role == "prefill" else fleet.calls[1][0]
        fleet.refusing[victim] = 503
        fleet.calls.clear()
        for stream in (False, True):
            r = post(client, LONG + "more", stream=stream)
            assert r.status_code == 200 and "error" not in r.text, r.text
        inst = next(i for i in router.instances if i.url == victim)
        assert not inst.up and "503" in inst.error and "queue full" in inst.error
        assert [u for u, _ in fleet.calls].count(victim) == 1  # then skipped while down
        assert all(i.in_flight == 0 for i in router.instances)
        # a 500 is the client's error, not retried
        inst.mark_up({"mode": role, "bootstrap": f"tcp://{victim}"})
        fleet.refusing = {u: 500 for u in fleet.urls[role]}
        r = post(client, LONG + "again")
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"], r.text
        assert all(i.in_flight == 0 for i in router.instances)


def test_reset_prefix_cache_reaches_every_instance():
    """/reset_prefix_cache and /flush_cache go to every instance: 200 when all reset (their
    pools' affinity forgotten), else the OpenAI error body naming those that did not (their
    400; 503 when one cannot be reached)."""
    fleet = Fleet(1, 2)
    router, client = fleet.router()
    everyone = sorted(fleet.urls["prefill"] + fleet.urls["decode"])
    with client:
        assert post(client).status_code == 200
        assert max(router.decode.affinity.match(keys_of(LONG))) > 0
        fleet.calls.clear()
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"reset": True}, r.text
        assert sorted(u for u, path in fleet.calls if path == "/reset_prefix_cache") == everyone
        assert max(router.decode.affinity.match(keys_of(LONG))) == 0
        busy = fleet.urls["decode"][1]
        fleet.refusing[busy] = 400
        r = client.get("/flush_cache")
        assert r.status_code == 400 and busy in r.json()["error"]["message"], r.text
        fleet.dead.add(fleet.urls["prefill"][0])
        r = client.post("/flush_cache")
        assert r.status_code == 503 and fleet.urls["prefill"][0] in r.text, r.text
