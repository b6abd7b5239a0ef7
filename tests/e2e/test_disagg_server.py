"""Prefill/decode disaggregation end to end (DESIGN §9.3), CPU, real processes on loopback:
`swaserve router` + one prefill + one decode instance of Gemma 3 270M (local transfer
backend) against one plain instance, through the official `openai` client. Greedy outputs,
logprobs and top-logprob tokens equal the plain instance's (completions and chat, streaming
and not, n > 1, a seeded sampled request, prompts past the 512-token window); the bytes the
transfer counters report equal full layers x prompt + sliding layers x last window, page
rounded, and fewer on a decode-side prefix hit; /v1/responses over the pair; a prefix-cache
reset through the router; pages all back at idle; the router's 400s.
Faults (a killed or stalled instance, a client that leaves) are in test_disagg_faults.py;
NIXL in test_disagg_nixl.py."""

from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import RunningServer
from tests.e2e.disagg_servers import (
    API_KEY,
    CHAT_TEMPLATE,
    GEMMA,
    LAYER_PAGE_BYTES,
    counter,
    expected_bytes,
    idle,
    start_pair,
)

pytestmark = pytest.mark.slow  # starts servers of its own
# Module-scoped servers: shared by the tests here, gone before the next module starts its own
# (five Gemma servers beside another module's would crowd a small machine).

LONG = "The river runs past the old mill and under the stone bridge. " * 60  # ~780 tokens


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """(router, prefill, decode) on the local transfer backend."""
    servers = start_pair(tmp_path_factory.mktemp("pd"), "local")
    try:
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    args = ["--model", GEMMA, "--device", "cpu", "--kv-cache-gb", "0.3", "--max-model-len",
            "2048", "--max-n", "4", "--chat-template", CHAT_TEMPLATE]
    srv = RunningServer(args, tmp_path_factory.mktemp("single") / "server.log", API_KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key=API_KEY, max_retries=0, timeout=300)


def same_logprobs(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert math.isclose(x, y, abs_tol=1e-4), (a, b)


def same_top(a: list[dict] | None, b: list[dict] | None) -> None:
    assert (a is None) == (b is None)
    for x, y in zip(a or [], b or []):
        assert list(x) == list(y)  # the same tokens, in the same order
        same_logprobs(list(x.values()), list(y.values()))


def completion(srv, **kw) -> dict:
    r = client(srv).completions.create(model=GEMMA, **kw)
    return r.model_dump()


def test_greedy_completions_equal_single(pd, single):
    router = pd[0]
    for prompt, plp in (("The capital of France is", 2), (LONG + "The bridge is", None)):
        kw = dict(prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                  extra_body={"return_token_ids": True, "prompt_logprobs": plp})
        a, b = completion(router, **kw), completion(single, **kw)
        ca, cb = a["choices"][0], b["choices"][0]
        assert ca["text"] == cb["text"] and ca["token_ids"] == cb["token_ids"]
        assert ca["logprobs"]["tokens"] == cb["logprobs"]["tokens"]
        same_logprobs(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"])
        same_top(ca["logprobs"]["top_logprobs"], cb["logprobs"]["top_logprobs"])
        if plp:  # computed on the prefill side, passed on by the decode side
            pa, pb = ca["prompt_logprobs"], cb["prompt_logprobs"]
            assert len(pa) == len(pb) == a["usage"]["prompt_tokens"] and pa[0] is None
            for x, y in zip(pa[1:], pb[1:]):
                assert sorted(x) == sorted(y)
                same_logprobs([x[k]["logprob"] for k in sorted(x)],
                              [y[k]["logprob"] for k in sorted(y)])
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["usage"]["prompt_tokens"] > 512  # past the sliding window


def stream_text(srv, path: str, body: dict) -> tuple[dict[int, str], dict[int, list]]:
    """Streamed text and logprob entries per choice index (raw SSE, as a client sees it)."""
    texts: dict[int, str] = {}
    lps: dict[int, list] = {}
    with httpx.stream("POST", srv.base_url + path, json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                i = c["index"]
                piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                texts[i] = texts.get(i, "") + piece
                if c.get("logprobs"):
                    lp = c["logprobs"]
                    lps.setdefault(i, []).extend(
                        lp["content"] if "content" in lp else lp["token_logprobs"]
                    )
    return texts, lps


def test_streaming_completions_and_chat_equal_single(pd, single):
    router = pd[0]
    body = {"model": GEMMA, "prompt": LONG + "Under the bridge", "max_tokens": 10,
            "temperature": 0, "logprobs": 2}
    ta, la = stream_text(router, "/completions", body)
    tb, lb = stream_text(single, "/completions", body)
    assert ta == tb and ta[0]
    same_logprobs(la[0], lb[0])
    chat = {"model": GEMMA, "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    ta, la = stream_text(router, "/chat/completions", chat)
    tb, lb = stream_text(single, "/chat/completions", chat)
    assert ta == tb and ta[0]
    assert [e["token"] for e in la[0]] == [e["token"] for e in lb[0]]
    assert [[t["token"] for t in e["top_logprobs"]] for e in la[0]] == [
        [t["token"] for t in e["top_logprobs"]] for e in lb[0]
    ]
    same_logprobs([e["logprob"] for e in la[0]], [e["logprob"] for e in lb[0]])


def test_chat_whole_equal_single(pd, single):
    kw = dict(model=GEMMA, messages=[{"role": "user", "content": "Say hello in French."}],
              max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    a = client(pd[0]).chat.completions.create(**kw).model_dump()
    b = client(single).chat.completions.create(**kw).model_dump()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    ea, eb = a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"]
    assert [(e["token"], [t["token"] for t in e["top_logprobs"]]) for e in ea] == [
        (e["token"], [t["token"] for t in e["top_logprobs"]]) for e in eb
    ]


def test_n_and_seeded_sampling_equal_single(pd, single):
    router = pd[0]
    for kw in (
        dict(n=3, temperature=0.9, seed=7, max_tokens=10),  # every sample's first token: prefill
        dict(n=2, temperature=0, max_tokens=8),
        dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16),
        # a grammar: its first token sampled on the prefill side, the rest here
        dict(temperature=0.9, seed=3, max_tokens=12,
             extra_body={"structured_outputs": {"regex": "[a-z ]{1,30}[.]"}}),
        dict(temperature=0, max_tokens=24, extra_body={"response_format": {"type": "json_object"}}),
    ):
        a = completion(router, prompt="Once upon a time", **kw)
        b = completion(single, prompt="Once upon a time", **kw)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]], kw
    texts, _ = stream_text(router, "/completions", {"model": GEMMA, "prompt": "Once upon a time",
                                                    "n": 3, "temperature": 0.9, "seed": 7,
                                                    "max_tokens": 10})
    assert [texts[i] for i in range(3)] == [c["text"] for c in
                                            completion(single, prompt="Once upon a time", n=3,
                                                       temperature=0.9, seed=7,
                                                       max_tokens=10)["choices"]]


def test_bytes_moved_are_window_aware(pd):
    router, prefill, decode = pd
    ids = [(i * 7919) % 5000 + 1000 for i in range(700)]  # 700 tokens, no shared prefix
    before = (counter(prefill, "kv_transfer_bytes"), counter(decode, "kv_transfer_bytes"))
    hits0 = httpx.get(decode.base_url + "/memory", headers=decode.headers()).json()
    completion(router, prompt=ids, max_tokens=2, temperature=0)
    sent = counter(prefill, "kv_transfer_bytes") - before[0]
    got = counter(decode, "kv_transfer_bytes") - before[1]
    full_every_layer = 18 * math.ceil(700 / 16) * LAYER_PAGE_BYTES
    assert sent == got == expected_bytes(700, 0) < 0.8 * full_every_layer
    # The same prompt again: the decode side's prefix cache holds it, so fewer pages travel.
    completion(router, prompt=ids, max_tokens=2, temperature=0)
    hits = httpx.get(decode.base_url + "/memory", headers=decode.headers()).json()
    cached = hits["cache_hit_tokens"] - hits0["cache_hit_tokens"]
    assert cached >= 512
    again = counter(decode, "kv_transfer_bytes") - before[1] - got
    assert again == expected_bytes(700, cached) < got
    assert counter(prefill, "kv_transfer_bytes") - before[0] == sent + again


def test_router_answers_400_for_malformed_requests(pd):
    router = pd[0]
    h = {"Authorization": f"Bearer {API_KEY}"}
    for body in (b"{not json", b"[1, 2]", json.dumps({"model": GEMMA}).encode(),
                 json.dumps({"prompt": "x", "max_tokens": "5"}).encode(),
                 json.dumps({"prompt": "x", "temperature": -1}).encode(),
                 json.dumps({"prompt": "x", "tools": []}).encode()):
        r = httpx.post(router.base_url + "/completions", content=body, headers=h, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(router.base_url + "/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401  # the router checks the shared key itself
    r = httpx.post(router.base_url + "/chat/completions", headers=h, timeout=30,
                   json={"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400


def test_models_and_bench_serve_through_the_router(pd, tmp_path, capsys):
    from swaserve.cli import main as cli_main

    router = pd[0]
    assert client(router).models.list().data[0].id == GEMMA
    h = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(router.url + "/tokenize", json={"prompt": "Once upon a time"}, headers=h,
                     timeout=30).json()["tokens"]  # fmt: skip
    back = httpx.post(router.url + "/detokenize", json={"tokens": ids}, headers=h, timeout=30)
    assert back.json()["prompt"].endswith("Once upon a time")
    assert httpx.post(router.url + "/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401
    out = tmp_path / "bench.json"
    rc = cli_main(["bench", "serve", "--base-url", router.url, "--api-key", API_KEY,
                   "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "32",
                   "--output-len", "8", "--result-file", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    result = json.loads(out.read_text())
    assert result["completed"] == 4, result


def test_responses_through_the_router(pd, single):
    """/v1/responses at the router, over the pair's chat endpoint: the same answers as a plain
    instance (whole and streamed), a conversation continued
    by previous_response_id from the router's own store, retrieve and delete, and the 400s
    naming the Responses field."""
    r, s = client(pd[0]), client(single)
    ask = dict(model=GEMMA, input=LONG + "Where does the river run?", max_output_tokens=12,
               temperature=0, instructions="Answer briefly.")
    a, b = r.responses.create(**ask), s.responses.create(**ask)
    assert a.output_text == b.output_text and a.output_text
    assert a.model == GEMMA and a.status == b.status
    assert a.usage.input_tokens == b.usage.input_tokens > 512  # past the sliding window
    assert a.usage.output_tokens == b.usage.output_tokens
    events = list(r.responses.create(stream=True, **ask))
    assert events[0].type == "response.created" and events[0].response.model == GEMMA
    assert events[-1].type == f"response.{a.status}"  # completed, or incomplete when cut
    final = events[-1].response
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text == a.output_text
    assert final.usage.output_tokens == a.usage.output_tokens
    turn = dict(model=GEMMA, input="And what is under the bridge?", max_output_tokens=10,
                temperature=0)
    ra = r.responses.create(previous_response_id=final.id, **turn)  # stored by the router
    rb = s.responses.create(previous_response_id=b.id, **turn)
    assert ra.output_text == rb.output_text and ra.previous_response_id == final.id
    assert ra.usage.input_tokens == rb.usage.input_tokens
    assert r.responses.retrieve(a.id).output_text == a.output_text
    r.responses.delete(a.id)
    with pytest.raises(openai.NotFoundError):
        r.responses.retrieve(a.id)
    with pytest.raises(openai.BadRequestError) as e:
        r.responses.create(model=GEMMA, input="x", previous_response_id=a.id)
    assert e.value.body["code"] == "previous_response_not_found"
    for body, param in (({"input": "x", "frobnicate": 1}, "frobnicate"),
                        ({"input": "x", "background": True}, "background"),
                        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": [{"type": "mystery"}]}, "input")):
        got = httpx.post(pd[0].base_url + "/responses", json={"model": GEMMA, **body},
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        assert got.status_code == 400, (body, got.text)
        assert got.json()["error"]["param"] == param, (body, got.text)


def test_reset_prefix_cache_through_the_router(pd):
    """The router's /reset_prefix_cache reaches both instances: each empties its own cache (a
    prompt the decode side had cached is not after), with their integrity checked."""
    router, prefill, decode = pd
    ids = [(i * 104729) % 7000 + 900 for i in range(300)]  # no other test's prefix

    def cached() -> int:
        r = completion(router, prompt=ids, max_tokens=2, temperature=0)
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    for srv in (prefill, decode):
        idle(srv)
    deadline = time.monotonic() + 10  # a side may still be closing its sample (then a 400)
    while (r := httpx.post(router.url + "/reset_prefix_cache", headers=router.headers(),
                           timeout=60)).status_code == 400 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.status_code == 200 and r.json() == {"reset": True}, r.text
    for srv in (prefill, decode):
        mem = httpx.get(srv.base_url + "/memory", headers=srv.headers(), timeout=10).json()
        assert mem["cache_pages"] == 0, mem
    assert cached() == 0
    assert httpx.post(router.url + "/flush_cache", timeout=30).status_code == 401  # the key


def test_pages_all_back_at_idle(pd):
    """Last: whatever ran above, nothing is held by a request on either side, and the cores
    (checking integrity after every step and side move) are alive."""
    router, prefill, decode = pd
    for srv in (prefill, decode):
        idle(srv)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert counter(decode, "kv_transfer_failures") == 0
    assert counter(prefill, "kv_transfer_failures") == 0


def _nixl_missing() -> str | None:
    from swaserve.disaggregation.transfer import check_transfer_backend

    try:
        check_transfer_backend("nixl")
    except ValueError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def pd_nixl(tmp_path_factory):
    """The same pair on the NIXL backend (UCX: cma for the pages, tcp on lo for control)."""
    why = _nixl_missing()
    if why is not None:
        pytest.skip(f"NIXL unusable: {why}")
    servers = start_pair(tmp_path_factory.mktemp("pd-nixl"), "nixl")
    try:
        yield servers
    finally:
        for s in reversed(servers):
            s.stop()


def test_nixl_pair_equals_single_and_moves_window_bytes(pd_nixl, single):
    router, prefill, decode = pd_nixl
    kw = dict(prompt=LONG + "The mill is", max_tokens=8, temperature=0, logprobs=2,
              extra_body={"return_token_ids": True})
    before = counter(decode, "kv_transfer_bytes")
    a, b = completion(router, **kw), completion(single, **kw)
    ca, cb = a["choices"][0], b["choices"][0]
    assert ca["token_ids"] == cb["token_ids"]
    same_logprobs(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"])
    same_top(ca["logprobs"]["top_logprobs"], cb["logprobs"]["top_logprobs"])
    n = a["usage"]["prompt_tokens"]
    assert n > 512
    assert counter(decode, "kv_transfer_bytes") - before == expected_bytes(n, 0)
    assert counter(prefill, "kv_transfer_bytes") == counter(decode, "kv_transfer_bytes")
    texts, _ = stream_text(router, "/completions", {"model": GEMMA, "prompt": "Once upon a time",
                                                    "n": 2, "temperature": 0.9, "seed": 3,
                                                    "max_tokens": 8})
    ref = completion(single, prompt="Once upon a time", n=2, temperature=0.9, seed=3,
                     max_tokens=8)
    assert [texts[0], texts[1]] == [c["text"] for c in ref["choices"]]
    for srv in (prefill, decode):
        idle(srv)
    assert counter(prefill, "kv_transfer_failures") == counter(decode, "kv_transfer_failures") == 0
