"""The OpenAI-compatible server, end to end: a real `swaserve serve` process on
smollm2-135m-instruct, driven by the official `openai` client (issue 3's done-when list)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve import SamplingParams
from tests.e2e.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def metric(server, name: str, labels: str = "", default: float | None = None) -> float:
    """One sample of /metrics (`name{labels}`), summed over label sets when labels is ''."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$", line)
        if m and m.group(1) == name and (not labels or m.group(2) == "{" + labels + "}"):
            total, found = total + float(m.group(3)), True
    if not found and default is not None:
        return default
    assert found, f"{name}{labels} not in /metrics"
    return total


def wait_idle(server, timeout: float = 20.0) -> None:
    """Until no request holds pages and none runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        held = metric(server, "swaserve:kv_pages_held_by_requests")
        busy = metric(server, "swaserve:num_requests_running") + metric(
            server, "swaserve:num_requests_waiting"
        )
        if held == 0 and busy == 0:
            return
        assert time.monotonic() < deadline, f"still {held} pages held, {busy} requests busy"
        time.sleep(0.2)


def extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def test_ipc_wire_roundtrip():
    """Core outputs cross the process boundary as msgpack of plain lists (no pickle)."""
    from swaserve.outputs import EngineCoreOutput, Logprob
    from swaserve.server.ipc import OUTPUTS, decode, encode, output_from_wire, output_to_wire

    out = EngineCoreOutput(
        "r-1",
        [5, 6],
        finish_reason="stop",
        stop_reason=6,
        new_logprobs=[Logprob(5, -0.5, 1, [(5, -0.5), (7, -1.5)]), Logprob(6, -2.0, 3)],
        prompt_logprobs=[None, Logprob(9, -3.25, 2, [(1, -0.1)])],
        num_cached_tokens=16,
    )
    kind, wires, stats = decode(encode([OUTPUTS, [output_to_wire(out)], {"num_running": 1}]))
    assert kind == OUTPUTS and stats == {"num_running": 1}
    assert output_from_wire(wires[0]) == out


# ---- correct answers through the official client ---------------------------------------------


def test_chat_paris(client):
    # No max_tokens: the rest of the context; the model stops by itself at EOS.
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_paris(client):
    stream = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    ids = [t for c in chunks if c.choices for t in (extra(c.choices[0], "token_ids") or [])]
    assert len(ids) == chunks[-1].usage.completion_tokens
    assert extra(chunks[0], "prompt_token_ids")


def test_completions_and_stream_agree(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    r = client.completions.create(**kw, extra_body={"return_token_ids": True})
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == r.choices[0].text and "Paris" in r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens == 8
    assert len(extra(r.choices[0], "token_ids")) == 8
    assert extra(r, "prompt_token_ids") == extra(r.choices[0], "prompt_token_ids")


def test_completion_logprobs_and_echo(client):
    prompt = "The capital of France is"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith(prompt)
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # Greedy: the chosen token is the best one.
    for val, top in zip(lp.token_logprobs[n_prompt:], lp.top_logprobs[n_prompt:]):
        assert max(top.values()) == pytest.approx(val, abs=1e-4)
    assert "".join(lp.tokens) == c.text


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": "Say hello"}],
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token


def test_stream_logprobs(client):
    stream = client.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        messages=[{"role": "user", "content": "Say hello"}],
    )
    entries = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 4


def test_n2(client):
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=2, temperature=1.0, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model=MODEL,
        n=2,
        max_tokens=5,
        temperature=0.8,
        seed=1,
        messages=[{"role": "user", "content": "Tell me a story"}],
    )
    assert len(chat.choices) == 2
    stream = client.chat.completions.create(
        model=MODEL,
        n=2,
        max_tokens=5,
        temperature=0.8,
        seed=1,
        stream=True,
        messages=[{"role": "user", "content": "Tell me a story"}],
    )
    texts = ["", ""]
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]  # same seeds, same samples


def test_multiple_prompts_and_token_ids(client):
    r = client.completions.create(
        model=MODEL, prompt=["Hello", "The sky is"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    r2 = client.completions.create(
        model=MODEL, prompt=[[1, 9690, 198]], max_tokens=3, temperature=0
    )
    assert r2.usage.prompt_tokens == 3


def test_sampling_extras(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Count: one, two,",
        max_tokens=12,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        stop=["five"],
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert "five" not in r.choices[0].text
    r2 = client.completions.create(
        model=MODEL,
        prompt="Count: one, two,",
        max_tokens=12,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        stop=["five"],
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert r2.choices[0].text == r.choices[0].text  # seeded
    greedy = client.completions.create(
        model=MODEL, prompt="Count: one, two,", max_tokens=12, temperature=0, stop=[" four"]
    )
    assert greedy.choices[0].finish_reason == "stop"
    assert greedy.choices[0].text == " three,"


def test_logit_bias(client):
    """OpenAI's logit_bias: +100 forces a token at every step, -100 bans the greedy choice;
    logprobs stay those of the raw logits."""
    prompt = "Count: one, two,"
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logit_bias={"28": 100},
        logprobs=1, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert extra(forced.choices[0], "token_ids") == [28] * 4
    assert all(lp < -1 for lp in forced.choices[0].logprobs.token_logprobs)  # raw, not biased
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body={"return_token_ids": True})  # fmt: skip
    first = extra(plain.choices[0], "token_ids")[0]
    banned = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(first): -100},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert first not in extra(banned.choices[0], "token_ids")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=3,
        temperature=0, logit_bias={"28": 100}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert extra(chat.choices[0], "token_ids") == [28] * 3
    allowed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=2,
        extra_body={"return_token_ids": True, "allowed_token_ids": [28, 29, 30]},
    )  # fmt: skip
    assert set(extra(allowed.choices[0], "token_ids")) <= {28, 29, 30}
    sampled = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=1,
        logit_bias={"28": 100}, extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert extra(sampled.choices[0], "token_ids") == [28] * 6


def test_response_format(client):
    """OpenAI's response_format (a JSON schema, any JSON object; streamed too) and vLLM's
    structured_outputs (a regex, a choice) hold the output to their grammar."""
    person = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    ask = [{"role": "user", "content": "Describe a person named Ann who is 31, as JSON."}]
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": person, "strict": True}},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    got = json.loads(r.choices[0].message.content)
    assert set(got) == {"name", "age"} and isinstance(got["age"], int)
    stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80,
                                            temperature=0, response_format={"type": "json_object"},
                                            stream=True)  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")
    r = client.completions.create(model=MODEL, prompt="My phone number is", max_tokens=12,
                                  temperature=0.8, seed=2,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=5,
        temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert r.choices[0].message.content in ("yes", "no")


def test_tokenize_and_detokenize(server, client, smollm_engine):
    """vLLM's /tokenize and /detokenize: the offline engine's tokenizer and chat template give
    the same ids; bad input is a 400, a missing key a 401."""
    h = {"Content-Type": "application/json", **server.headers()}

    def call(path: str, body: dict, headers: dict = h) -> httpx.Response:
        return httpx.post(server.url + path, json=body, headers=headers, timeout=30)

    text = "The capital of France is"
    r = call("/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    want = smollm_engine.tokenizer.encode(text)
    assert r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == 2048
    assert len(r["token_strs"]) == len(want)
    assert call("/detokenize", {"tokens": want}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "Hi"}]
    r = call("/tokenize", {"messages": messages}).json()
    chat = smollm_engine.apply_chat_template(messages)
    assert r["tokens"] == smollm_engine.tokenizer.encode(chat, add_special_tokens=False)
    for path, body, param in [("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
                              ("/detokenize", {"tokens": [49152]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:  # fmt: skip
        r = call(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    assert call("/tokenize", {"model": "gpt-4", "prompt": "a"}).status_code == 404
    if server.headers():
        assert call("/tokenize", {"prompt": "a"}, {}).status_code == 401


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "kv_pages_used",
        "kv_pages_held_by_requests",
        "kv_pages_held_by_cache",
        "prefix_cache_hit_tokens_total",
        "prefix_cache_queries_tokens_total",
    ):
        assert f"swaserve:{name}" in text, name
    assert 'swaserve:kv_pages_used{group="0:full"}' in text
    assert metric(server, "swaserve:generation_tokens_total") > 0


# ---- HTTP output equals the offline Engine ---------------------------------------------------


def test_greedy_matches_offline_engine(client, smollm_engine):
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for p in prompts:  # one at a time on both sides: the same batch shapes
        offline = smollm_engine.generate([p], sp)[0]
        r = client.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert extra(r.choices[0], "token_ids") == offline.token_ids, p
        assert r.choices[0].text == offline.text
    conv = [{"role": "user", "content": "Name three colors."}]
    offline = smollm_engine.chat([conv], SamplingParams(max_tokens=16, temperature=0))[0]
    r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == offline.text


# ---- load, disconnects ---------------------------------------------------------------------


def test_64_concurrent_streams(server):
    async def one(ac: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await ac.completions.create(
            model=MODEL,
            prompt=f"Request {i}: the story begins",
            max_tokens=8,
            temperature=0.5,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        ids, usage, finish = 0, -1, None
        async for c in stream:
            if c.usage is not None:
                usage = c.usage.completion_tokens
            for ch in c.choices:
                ids += len(extra(ch, "token_ids") or [])
                finish = ch.finish_reason or finish
        return ids, usage, finish

    async def main() -> list:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=300
        ) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert results == [(8, 8, "length")] * 64
    wait_idle(server)
    print(f"64 streams in {time.monotonic() - t0:.1f} s")


def test_disconnect_frees_pages(server):
    aborted_before = metric(
        server, "swaserve:request_success_total", 'finished_reason="abort"', default=0.0
    )

    held_while_streaming: list[float] = []

    async def drop_after_3(ac: httpx.AsyncClient, i: int, barrier: asyncio.Barrier) -> int:
        body = {
            "model": MODEL,
            "prompt": f"Stream {i} goes on and on",
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        }
        n = 0
        async with ac.stream("POST", server.base_url + "/completions", json=body) as r:
            assert r.status_code == 200
            # The line iterator is held until the block ends: breaking out of an `async for`
            # drops it, and its finalizer closes the connection at once (the server then
            # aborts the request before the gauges below are read).
            lines = r.aiter_lines()
            while n < 3:
                if (await anext(lines)).startswith("data: "):
                    n += 1
            if await barrier.wait() == 0:  # all 10 are mid-stream: their pages are held
                # The gauges follow the core's steps: on a loaded machine, read them until the
                # last admission shows (a few seconds at most), keeping what was seen.
                deadline = time.monotonic() + 5
                while True:
                    m = await ac.get(server.url + "/metrics")
                    seen = {
                        name: sum(
                            float(x.split()[-1])
                            for x in m.text.splitlines()
                            if x.startswith(f"swaserve:{name} ")
                        )
                        for name in ("kv_pages_held_by_requests", "num_requests_running",
                                     "num_requests_waiting", "num_preemptions_total")
                    }
                    if seen["kv_pages_held_by_requests"] >= 10 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                held_while_streaming.append(seen)
            await barrier.wait()
        return n  # leaving the block closed the connection mid-stream

    async def main() -> list[int]:
        barrier = asyncio.Barrier(10)
        async with httpx.AsyncClient(headers=server.headers(), timeout=120) as ac:
            return await asyncio.gather(*(drop_after_3(ac, i, barrier) for i in range(10)))

    assert asyncio.run(main()) == [3] * 10
    seen = held_while_streaming[0]
    assert seen["kv_pages_held_by_requests"] >= 10, seen  # at least a page each
    wait_idle(server, timeout=15)
    aborted = metric(server, "swaserve:request_success_total", 'finished_reason="abort"')
    assert aborted - aborted_before == 10


def test_tokenizing_does_not_block_other_requests(server):
    """A 3.6 MB prompt takes seconds to tokenize (then a 400: far beyond the context); a
    /health sent meanwhile answers first, because tokenizing runs off the event loop."""
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 80000,
            "max_tokens": 1}
    done: list[tuple[str, int]] = []

    async def long_prompt(ac: httpx.AsyncClient) -> None:
        r = await ac.post(server.base_url + "/completions", json=body)
        done.append(("long", r.status_code))

    async def health(ac: httpx.AsyncClient) -> None:
        await asyncio.sleep(1.0)  # the long prompt is being tokenized by now
        r = await ac.get(server.url + "/health")
        done.append(("health", r.status_code))

    async def main() -> None:
        async with httpx.AsyncClient(headers=server.headers(), timeout=120) as ac:
            await asyncio.gather(long_prompt(ac), health(ac))

    asyncio.run(main())
    assert done == [("health", 200), ("long", 400)], done


def test_non_stream_disconnect_aborts(server):
    body = {"model": MODEL, "prompt": "A long answer", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.base_url + "/completions", json=body, headers=server.headers(), timeout=1.0
        )
    wait_idle(server, timeout=15)


def test_bench_serve_cli(server, tmp_path):
    """`swaserve bench serve` against the running server writes the keys peers report."""
    import subprocess
    import sys

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": f"Question {i}?", "max_tokens": 3}) for i in range(3))
    )
    for dataset in ("random", str(data)):
        out = tmp_path / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "swaserve.cli",
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--api-key",
            API_KEY,
            "--dataset",
            dataset,
            "--num-prompts",
            "8",
            "--max-concurrency",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--result-file",
            str(out),
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "TTFT" in p.stdout
        result = json.loads(out.read_text())
        assert result["completed"] == 8 and result["failed"] == 0
        assert result["total_output_tokens"] == (32 if dataset == "random" else 24)
        for key in ("request_throughput", "output_throughput", "total_token_throughput"):
            assert result[key] > 0
        for name in ("ttft", "itl", "e2el"):
            for kind in ("mean", "median", "p99"):
                assert result[f"{kind}_{name}_ms"] > 0, (name, kind)
    # structured outputs: every chat answer held to a JSON object, the share that parses
    out = tmp_path / "json.json"
    p = subprocess.run([sys.executable, "-m", "swaserve.cli", "bench", "serve", "--base-url",
                        server.url, "--api-key", API_KEY, "--endpoint-type", "chat",
                        "--response-format", "json_object", "--num-prompts", "4",
                        "--max-concurrency", "4", "--input-len", "8", "--output-len", "48",
                        "--result-file", str(out)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Valid JSON outputs (share):" in p.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and 0 <= result["json_valid_rate"] <= 1


# ---- errors ---------------------------------------------------------------------------------


def post(server, path: str, body, headers=None, raw: bytes | None = None) -> httpx.Response:
    h = {"Content-Type": "application/json", **server.headers(), **(headers or {})}
    content = raw if raw is not None else json.dumps(body)
    return httpx.post(server.base_url + path, content=content, headers=h, timeout=120)


ERROR_CASES = [
    ("/completions", None, b"{not json", 400, None),
    ("/completions", {}, None, 400, "prompt"),
    ("/chat/completions", {"model": MODEL}, None, 400, "messages"),
    ("/completions", {"prompt": "hi", "max_tokens": "5"}, None, 400, "max_tokens"),
    ("/completions", {"prompt": "hi", "temperature": -1}, None, 400, "temperature"),
    ("/completions", {"prompt": "hi", "top_p": 0}, None, 400, "top_p"),
    ("/completions", {"prompt": "hi", "n": 5}, None, 400, "n"),
    ("/completions", {"prompt": "hi", "n": 0}, None, 400, "n"),
    ("/completions", {"prompt": "hi", "logprobs": 50}, None, 400, "logprobs"),
    ("/completions", {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ("/completions", {"prompt": "hi", "max_tokens": 5000}, None, 400, "max_tokens"),
    ("/completions", {"prompt": [5] * 2048, "max_tokens": 1}, None, 400, "prompt"),
    ("/completions", {"prompt": [10**6], "max_tokens": 1}, None, 400, "prompt"),
    ("/completions", {"prompt": "", "max_tokens": 1}, None, 400, "prompt"),
    ("/completions", {"prompt": "hi", "suffix": "x"}, None, 400, "suffix"),
    ("/completions", {"prompt": "hi", "logit_bias": {"49152": 1}}, None, 400, "logit_bias"),
    ("/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, None, 400, "logit_bias"),
    ("/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, None, 400, "logit_bias"),
    ("/completions", {"prompt": "hi", "logit_bias": {"5": "1"}}, None, 400, "logit_bias"),
    ("/completions", {"prompt": "hi", "allowed_token_ids": [49152]}, None, 400,
     "allowed_token_ids"),
    ("/completions", {"prompt": "hi", "allowed_token_ids": []}, None, 400, "allowed_token_ids"),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": []},
        None,
        400,
        "tools",
    ),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "type": "nonsense"}}}},
        None,
        400,
        "response_format",
    ),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        None,
        400,
        "response_format",
    ),
    ("/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, None, 400,
     "response_format"),
    ("/completions", {"prompt": "hi", "structured_outputs": {"regex": "("}}, None, 400,
     "structured_outputs"),
    ("/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     None, 400, "structured_outputs"),
    ("/completions", {"prompt": "hi", "structured_outputs": {"regex": "a"},
                      "response_format": {"type": "json_object"}}, None, 400, "response_format"),
    (
        "/chat/completions",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        None,
        400,
        "messages",
    ),
    ("/chat/completions", {"messages": []}, None, 400, "messages"),
    (
        "/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        None,
        400,
        "top_logprobs",
    ),
    ("/completions", {"prompt": "hi", "model": "gpt-4"}, None, 404, "model"),
    ("/completions", None, b'{"prompt": "\\udc80", "max_tokens": 1}', 400, None),
    ("/completions", None, b'{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 1}', 400, None),
    ("/completions", None, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("/completions", None, b'{"prompt": "hi", "n": ' + b"9" * 5000 + b"}", 400, None),
    (
        "/completions",
        {"prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}},
        None,
        400,
        "stream_options",
    ),
]


@pytest.mark.parametrize("path,body,raw,status,param", ERROR_CASES)
def test_error_statuses(server, path, body, raw, status, param):
    r = post(server, path, body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


def test_context_error_names_the_limit(server):
    r = post(server, "/completions", {"prompt": "hi", "max_tokens": 5000})
    message = r.json()["error"]["message"]
    assert "2048" in message and "max_model_len" in message
    r = post(server, "/completions", {"prompt": "hi", "max_tokens": 5000, "stream": True})
    assert r.status_code == 400


def test_unsupported_fields_are_named(server):
    r = post(
        server,
        "/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "functions": [], "best_of": 2},
    )
    assert r.status_code == 400
    assert "'functions'" in r.json()["error"]["message"]
    assert "'best_of'" in r.json()["error"]["message"]


def test_api_key(server, client):
    assert (
        post(server, "/completions", {"prompt": "hi"}, headers={"Authorization": ""}).status_code
        == 401
    )
    bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # open, like /metrics


# ---- fuzz -----------------------------------------------------------------------------------

_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=12),
    st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2),
    st.lists(st.integers(-3, 60000), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
# Sampling fields with plausible values (in and near their ranges).
_COMMON = {
    "model": st.sampled_from([MODEL, MODEL, "other-model"]),
    "n": st.integers(0, 3),
    "temperature": st.floats(0, 2.5),
    "top_p": st.floats(0, 1),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "seed": st.integers(-(2**64), 2**65),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "presence_penalty": st.floats(-2.5, 2.5),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "top_k": st.integers(-2, 60000),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0, 3),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 2),
    "stop_token_ids": st.lists(st.integers(0, 50000), max_size=3),
    "allowed_token_ids": st.lists(st.integers(-1, 50000), max_size=3),
    "logit_bias": st.dictionaries(
        st.one_of(st.integers(-1, 50000).map(str), st.text(max_size=3)),
        st.floats(-120, 120), max_size=3,
    ),
    "response_format": st.sampled_from([
        {"type": "text"}, {"type": "json_object"}, {"type": "xml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}},
    ]),
    "structured_outputs": st.sampled_from([
        {"regex": "[a-c]+"}, {"choice": ["x", "y"]}, {"regex": "("}, {"json": "[]"}, {},
    ]),
    "return_token_ids": st.booleans(),
    "user": st.text(max_size=5),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.one_of(
            st.text(max_size=30),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}),
                max_size=2,
            ),
        ),
    },
    optional={"name": st.text(max_size=5)},
)
_COMPLETION = st.fixed_dictionaries(
    {
        "prompt": st.one_of(
            st.text(min_size=1, max_size=40),
            st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2),
            st.lists(st.integers(0, 49151), min_size=1, max_size=8),
        ),
        "max_tokens": st.integers(1, 3),
    },
    optional={
        **_COMMON,
        "echo": st.booleans(),
        "logprobs": st.integers(0, 5),
        "prompt_logprobs": st.integers(0, 3),
    },
)
_CHAT = st.fixed_dictionaries(
    {
        "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
        "max_completion_tokens": st.integers(1, 3),
    },
    optional={
        **_COMMON,
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "add_generation_prompt": st.booleans(),
        "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}}}}}]),
        "tool_choice": st.sampled_from(
            ["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
        "parallel_tool_calls": st.booleans(),
    },
)
_UNSUPPORTED = [
    "suffix",
    "best_of",
    "functions",
    "function_call",
    "x",
]


@st.composite
def _mutated(draw, base: st.SearchStrategy) -> dict:
    """A plausible body with 1-2 fields replaced by junk, deleted, or an unknown field added."""
    body = draw(base)
    for _ in range(draw(st.integers(1, 2))):
        how = draw(st.sampled_from(["junk", "drop", "extra"]))
        if how == "extra":
            body[draw(st.sampled_from(_UNSUPPORTED))] = draw(_JUNK)
        else:
            key = draw(st.sampled_from(sorted(body)))
            if how == "junk":
                body[key] = draw(_JUNK)
            elif key not in ("max_tokens", "max_completion_tokens"):  # keep generation short
                del body[key]
    # Junk that happens to be a big valid max_tokens (or null: the rest of the context) would
    # generate for minutes.
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key, 0)
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and 3 < v <= 2048):
            body[key] = 3
    return body


# 300 cases take ~15 s on an idle 2-core machine; the cap only guards a very loaded one.
_FUZZ_SECONDS = float(os.environ.get("SWASERVE_FUZZ_SECONDS", "240"))


def test_fuzz_no_5xx(server):
    """A few hundred generated requests, valid and not; none may get a 5xx. Capped in time."""
    deadline = time.monotonic() + _FUZZ_SECONDS
    stats = {"cases": 0, "2xx": 0}
    http = httpx.Client(
        headers={**server.headers(), "Content-Type": "application/json"}, timeout=60
    )

    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        case=st.one_of(
            st.tuples(st.just("/completions"), _COMPLETION),
            st.tuples(st.just("/chat/completions"), _CHAT),
            st.tuples(st.just("/completions"), _mutated(_COMPLETION)),
            st.tuples(st.just("/chat/completions"), _mutated(_CHAT)),
            st.tuples(st.sampled_from(["/completions", "/chat/completions"]), _JUNK),
        )
    )
    def run(case):
        if time.monotonic() > deadline:
            return
        path, body = case
        # A chat without max_completion_tokens uses max_tokens: keep generation bounded.
        if isinstance(body, dict) and path == "/chat/completions":
            body.setdefault("max_tokens", 2)
        with http.stream("POST", server.base_url + path, content=json.dumps(body)) as r:
            content = r.read()
        stats["cases"] += 1
        assert r.status_code < 500, (body, r.status_code, content[:500])
        if r.status_code >= 400:
            err = json.loads(content)["error"]
            assert err["message"] and err["type"]
        else:
            stats["2xx"] += 1
            if isinstance(body, dict) and body.get("stream") is True:
                text = content.decode()
                assert text.rstrip().endswith("data: [DONE]"), text[-300:]
                assert '"error"' not in text, text[:500]

    run()
    http.close()
    print(f"fuzz: {stats}")
    assert stats["cases"] >= 50 and stats["2xx"] > 0, stats
    assert httpx.get(server.url + "/health").status_code == 200
    wait_idle(server)


# ---- tiny servers: no chat template, full queue, core death --------------------------------


def test_no_chat_template_and_full_queue(tiny_server_factory):
    srv = tiny_server_factory("--max-num-seqs", "1", "--max-queue", "1")
    model = httpx.get(srv.base_url + "/models").json()["data"][0]["id"]
    c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="chat template"):
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    streams = [
        c.completions.create(
            model=model, prompt="x", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
        )
        for _ in range(2)
    ]
    next(iter(streams[0]))  # both are in flight (headers came back): one runs, one waits
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=model, prompt="x", max_tokens=2)
    assert e.value.status_code == 503
    for s in streams:
        s.close()


def test_chat_template_file_then_kill_the_core(tiny_server_factory, tiny_model_folder, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<<{{ m.role }}: {{ m.content }}>>{% endfor %}")
    srv = tiny_server_factory("--chat-template", str(template))
    model = httpx.get(srv.base_url + "/models").json()["data"][0]["id"]
    c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=30)
    r = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        extra_body={"return_token_ids": True},
    )
    from swaserve.engine.engine import load_tokenizer

    tok = load_tokenizer(tiny_model_folder)
    assert extra(r, "prompt_token_ids") == tok.encode("<<user: hello>>", add_special_tokens=False)

    # Kill the core with a stream in flight.
    stream = c.completions.create(
        model=model, prompt="x", max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)
    t0 = time.monotonic()
    os.kill(srv.core_pid(), signal.SIGKILL)
    with pytest.raises(openai.APIError):  # the live stream ends with an error event
        for _ in it:
            pass
    statuses = set()
    while srv.proc.poll() is None and time.monotonic() - t0 < 15:
        try:
            statuses.add(
                httpx.post(
                    srv.base_url + "/completions", timeout=5, json={"prompt": "hi", "max_tokens": 1}
                ).status_code
            )
        except httpx.TransportError:
            statuses.add("refused")
        time.sleep(0.1)
    elapsed = time.monotonic() - t0
    assert srv.proc.wait(timeout=1) != 0
    assert elapsed < 10, elapsed
    assert statuses <= {503, "refused"} and 503 in statuses, statuses
    assert "engine core is gone" in srv.log() and "SIGKILL" in srv.log()


def test_bench_serve_shared_prefix_multi_turn_reports_hits(server, tmp_path):
    """shared-prefix, multi-turn: later turns resend earlier prompts, so the server's prefix
    cache serves part of every prompt and the benchmark reports the hit rate and TTFT."""
    import subprocess
    import sys

    out = tmp_path / "shared.json"
    cmd = [
        sys.executable, "-m", "swaserve.cli", "bench", "serve", "--base-url", server.url,
        "--api-key", API_KEY, "--dataset", "shared-prefix", "--num-prompts", "8",
        "--num-turns", "2", "--num-prefixes", "2", "--prefix-len", "120", "--input-len", "8",
        "--output-len", "2", "--max-concurrency", "2", "--result-file", str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Prefix cache hit rate" in p.stdout and "TTFT" in p.stdout
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_cached_tokens"] > 0 and 0 < result["prefix_cache_hit_rate"] < 1
    wait_idle(server)


# ---- fresh-clone items (issue 10): the pool caps the context, a busy port fails first --------


def test_context_capped_by_the_kv_pool_is_a_400(tiny_server_factory):
    """A pool too small for the model's 4096 tokens caps the context (a warning in the log);
    prompt + max_tokens beyond it is a 400 saying how much fits; an omitted max_tokens runs
    to the capped end."""
    srv = tiny_server_factory("--kv-cache-gb", "0.0001")
    limit = httpx.get(srv.base_url + "/models").json()["data"][0]["max_model_len"]
    assert 16 < limit < 4096
    log = srv.log()
    assert f"max_model_len capped from 4096 to {limit} tokens" in log
    assert re.search(r"serving .* on http://127\.0\.0\.1:\d+", log)
    for stream in (False, True):
        r = post(srv, "/completions", {"prompt": "hi", "max_tokens": limit, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == "max_tokens"
        assert f"{limit} tokens that fit in the KV pool" in err["message"], err
    ids = [5 + i % 100 for i in range(limit - 12)]
    r = post(srv, "/completions", {"prompt": ids, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 12


def test_busy_port_fails_before_loading(tmp_path):
    """The port is bound before anything loads: a busy one fails at once with a one-line
    error naming it (the model name is not even looked up)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cmd = [sys.executable, "-m", "swaserve.cli", "serve", "--port", str(port),
               "--model", "no-such-model-xyz", "--device", "cpu"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot bind 127.0.0.1:{port}"), p.stderr


def test_max_model_len_above_the_model_fails_in_one_line(tiny_model_folder, tmp_path):
    """--max-model-len above max_position_embeddings: the core stops before the weights load
    and the server exits non-zero, logging one line (no traceback)."""
    from tests.e2e.conftest import RunningServer

    srv = RunningServer(["--model", str(tiny_model_folder), "--device", "cpu",
                         "--max-model-len", "5000"], tmp_path / "too-long.log")
    try:
        assert srv.proc.wait(timeout=120) != 0
    finally:
        srv.stop()
    log = srv.log()
    assert "--max-model-len 5000 is above the model's maximum context of 4096 tokens" in log
    assert "Traceback" not in log, log


# ---- issue 15: /v1/models/{id}, --served-model-name, /metrics as Prometheus expects ---------


def test_model_retrieve_200_and_404(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and extra(card, "max_model_len") == 2048
    r = httpx.get(server.base_url + "/models/no-such-model", headers=server.headers())
    assert r.status_code == 404
    err = r.json()["error"]
    assert err == {"message": err["message"], "type": "invalid_request_error", "param": "model",
                   "code": "model_not_found"}
    assert "'no-such-model' does not exist" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(server.base_url + f"/models/{MODEL}").status_code == 401  # the key rule


def _scrape(server) -> tuple[str, dict[str, float], dict[str, str]]:
    """(text, {series: value}, {family: type}) of one /metrics scrape."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            types[family] = kind
        elif line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return text, samples, types


def _monotonic(series: str, types: dict[str, str]) -> bool:
    """A counter's sample, or a histogram's bucket, count or sum."""
    name = series.split("{")[0]
    if types.get(name) == "counter":
        return True
    base = re.sub(r"_(bucket|count|sum)$", "", name)
    return base != name and types.get(base) == "histogram"


def test_metrics_counters_grow_and_latency_histograms(server, client):
    text, before, types = _scrape(server)
    assert "_created" not in text
    counters = {f for f, kind in types.items() if kind == "counter"}
    assert all(f.endswith("_total") for f in counters), counters
    for name in ("num_preemptions_total", "prefix_cache_evictions_total",
                 "prefix_cache_host_loads_total", "prompt_tokens_total"):
        assert f"swaserve:{name}" in counters, name
    for name in ("e2e_request_latency_seconds", "time_per_output_token_seconds",
                 "request_queue_time_seconds"):
        assert types.get(f"swaserve:{name}") == "histogram", name
    assert types.get("swaserve:kv_cache_usage_perc") == "gauge"

    for i in range(2):
        client.completions.create(model=MODEL, prompt=f"Metrics {i}: one, two,", max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    wait_idle(server)
    _, after, _ = _scrape(server)
    for series, value in before.items():
        if _monotonic(series, types):
            assert after[series] >= value, (series, value, after[series])
    grew = {n: after[f"swaserve:{n}"] - before[f"swaserve:{n}"] for n in (
        "e2e_request_latency_seconds_count", "time_per_output_token_seconds_count",
        "request_queue_time_seconds_count", "generation_tokens_total")}
    assert grew["e2e_request_latency_seconds_count"] >= 2, grew
    assert grew["time_per_output_token_seconds_count"] >= 2, grew
    assert grew["request_queue_time_seconds_count"] >= 2, grew
    assert grew["generation_tokens_total"] >= 8, grew
    usage, held = after["swaserve:kv_cache_usage_perc"], after["swaserve:kv_pages_held_by_requests"]
    assert 0 <= usage <= 1 and usage == pytest.approx(held / after["swaserve:kv_pages_total"])
    # The startup log and the metrics count the pool's pages the same way (no NULL page).
    logged = re.search(r"KV pool: (\d+) pages of", server.log())
    assert logged and int(logged.group(1)) == after["swaserve:kv_pages_total"]


def test_metrics_counters_follow_core_totals_and_queue_times():
    """Core totals feed counters by their growth; the core reports a queue time for each
    request once, when first scheduled (running, or done within the step), none if rejected."""
    from types import SimpleNamespace

    from swaserve.engine.request import RequestStatus
    from swaserve.server.core_process import first_scheduled
    from swaserve.server.metrics import Metrics

    m = Metrics()
    for preempted, evicted in ((0, 0), (2, 5), (3, 5)):
        m.update_core_stats({"num_preemptions": preempted,
                             "memory": {"evictions": evicted, "pages_total": 8,
                                        "pages_held_by_requests": 2}})
    text = m.render().decode()
    assert "swaserve:num_preemptions_total 3.0" in text
    assert "swaserve:prefix_cache_evictions_total 5.0" in text
    assert "swaserve:kv_cache_usage_perc 0.25" in text and "_created" not in text

    def req(status: RequestStatus, outputs: list[int]) -> SimpleNamespace:
        return SimpleNamespace(status=status, output_token_ids=outputs, arrival_time=10.0)

    queued = {"wait": req(RequestStatus.WAITING, []), "run": req(RequestStatus.RUNNING, []),
              "done": req(RequestStatus.FINISHED, [7]), "rejected": req(RequestStatus.FINISHED, [])}
    assert first_scheduled(queued, 10.5) == [0.5, 0.5]
    assert list(queued) == ["wait"]


def test_served_model_name_and_generation_defaults(tiny_server_factory, tiny_model_folder):
    srv = tiny_server_factory("--served-model-name", "tiny-test", "--override-generation-config",
                              '{"temperature": 0, "max_new_tokens": 3}')  # fmt: skip
    models = httpx.get(srv.base_url + "/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [("tiny-test", str(tiny_model_folder))]
    assert httpx.get(srv.base_url + "/models/tiny-test").json()["id"] == "tiny-test"
    assert httpx.get(srv.base_url + f"/models/{tiny_model_folder}").json()["id"] == "tiny-test"
    assert httpx.get(srv.base_url + "/models/smollm2-135m-instruct").status_code == 404
    for name in ("tiny-test", str(tiny_model_folder)):  # the served name, or --model's
        r = post(srv, "/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny-test", r.text
    r = post(srv, "/completions", {"model": "other", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "serving tiny-test on http://" in srv.log()
    # the model's defaults (sampling/generation_defaults.py) for fields a request leaves out:
    # greedy, and max_new_tokens caps a request without max_tokens
    assert "sampling defaults from the model's generation config" in srv.log()
    body = {"model": "tiny-test", "prompt": "hi", "ignore_eos": True}
    left_out = post(srv, "/completions", body).json()
    assert left_out["usage"]["completion_tokens"] == 3
    assert left_out["choices"][0]["finish_reason"] == "length"
    greedy = post(srv, "/completions", {**body, "temperature": 0, "max_tokens": 3}).json()
    assert greedy["choices"][0]["text"] == left_out["choices"][0]["text"]


def test_stream_interval_sends_tokens_in_groups(tiny_server_factory):
    """`--stream-interval 3`: a streamed sample's first token goes at once, then deltas of
    three tokens, the rest with its finish; what arrives equals the unstreamed completion."""
    srv = tiny_server_factory("--stream-interval", "3")
    model = httpx.get(srv.base_url + "/models").json()["data"][0]["id"]
    c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
    kw = dict(model=model, prompt="Once upon", max_tokens=11, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    whole = c.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
    sizes = [len(ch.logprobs.tokens) for ch in chunks]
    # deltas of 1, 3, 3, 3, 1 tokens; a stream that fell behind merges what waits (_coalesce),
    # so a chunk may hold more, never fewer
    assert sum(sizes) == 11 and all(n >= 3 for n in sizes[1:-1]) and len(sizes) <= 5, sizes
    assert "".join(ch.text for ch in chunks) == whole.text
    assert [t for ch in chunks for t in extra(ch, "token_ids")] == extra(whole, "token_ids")
    assert [ch.finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    from swaserve.cli import main as cli_main

    assert cli_main(["serve", "--stream-interval", "0"]) == 2  # refused before anything starts


def test_chat_cli_through_the_server(server):
    """`swaserve chat --url` streams each answer from the server and keeps the conversation;
    a wrong key is an error naming the status."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "swaserve.cli", "chat", "--url", server.url, "--max-tokens",
           "12", "--system", "Be brief."]  # fmt: skip
    r = subprocess.run([*cmd, "--api-key", API_KEY], capture_output=True, text=True, timeout=120,
                       input="What is the capital of France?\nAnd of Italy?\n")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "Paris" in lines[0] and "Rome" in lines[1], lines
    if server.api_key:
        r = subprocess.run([*cmd, "--api-key", "wrong"], capture_output=True, text=True,
                           timeout=120, input="Hi\n")  # fmt: skip
        assert r.returncode == 1 and "401" in r.stderr, r.stderr


def test_reasoning_content(client):
    """--reasoning-parser qwen3 (the session server's): an answer that opens with <think> has
    its reasoning in reasoning_content and the rest in content, streamed or not (a choice
    grammar makes SmolLM2 think); other answers stay whole content."""
    answer = "<think>France's capital is Paris.</think>\n\nParis"
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
              max_tokens=30, temperature=0)  # fmt: skip
    forced = {"structured_outputs": {"choice": [answer]}}
    msg = client.chat.completions.create(extra_body=forced, **kw).choices[0].message
    assert msg.reasoning_content == "France's capital is Paris." and msg.content == "Paris"
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(extra_body=forced, stream=True, **kw):
        for ch in chunk.choices:
            reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (reasoning, content) == ("France's capital is Paris.", "Paris")
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content is None and msg.content
