"""vLLM's request extras through the real server and the official client: truncate_prompt_tokens
(completions and chat, with echo), chat's continue_final_message with echo (whole and
streamed, and through /tokenize), and stream_options.continuous_usage_stats."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

PROMPT = "The old mill stands by the river, and the bridge over it is made of"
PREFILL = [{"role": "user", "content": "Name a colour."},
           {"role": "assistant", "content": "My favourite colour is"}]  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=server.headers(),
                      timeout=120)  # fmt: skip


def sse(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.base_url + path, json={"model": MODEL, "stream": True,
                      **body}, headers=server.headers(), timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_truncate_prompt_tokens(client, server):
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    k = len(ids) - 6
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    echo=True, extra_body={"truncate_prompt_tokens": k})
    tail = client.completions.create(model=MODEL, prompt=ids[-k:], max_tokens=6, temperature=0)
    assert cut.usage.prompt_tokens == k
    echoed = post(server, "/detokenize", {"tokens": ids[-k:]}).json()["prompt"]
    assert cut.choices[0].text == echoed + tail.choices[0].text  # echo shows what was kept
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for k in (0, -2):
        r = post(server, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continue_final_message_with_echo(client, server):
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    ids = post(server, "/tokenize", {"messages": PREFILL, **extra}).json()["tokens"]
    ref = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=8,
                                           temperature=0, extra_body={**extra, "echo": True})
    answer = whole.choices[0].message.content
    assert answer == "My favourite colour is" + ref.choices[0].text
    assert whole.usage.prompt_tokens == len(ids)
    # add_generation_prompt defaults to false with continue_final_message
    plain = client.chat.completions.create(model=MODEL, messages=PREFILL, max_tokens=8,
                                           temperature=0,
                                           extra_body={"continue_final_message": True})
    assert plain.choices[0].message.content == ref.choices[0].text
    chunks = sse(server, "/chat/completions", {"messages": PREFILL, "max_tokens": 8,
                                                  "temperature": 0, "echo": True, **extra})
    assert chunks[1]["choices"][0]["delta"]["content"] == "My favourite colour is"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])  # fmt: skip
    assert text == answer
    r = post(server, "/v1/chat/completions", {"messages": PREFILL, "continue_final_message": True,
                                              "add_generation_prompt": True})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_continuous_usage_stats(server, path):
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": PROMPT} if path == "/completions" else
                {"messages": [{"role": "user", "content": PROMPT}]})  # fmt: skip
    chunks = sse(server, path, body)
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 12
    seen = [c["usage"] for c in chunks[:-1]]
    assert all(u is not None for u in seen)
    done = [u["completion_tokens"] for u in seen]
    assert done == sorted(done) and done[-1] == 12
    assert {u["prompt_tokens"] for u in seen} == {final["usage"]["prompt_tokens"]}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in seen)
    plain = sse(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain[:-1])


def test_bad_words(client, server):
    prompt = "Write about the Mississippi river and Massachusetts:"
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    words = ref.choices[0].text.split()
    word = next(w for w in words[1:] if w.isalpha())
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"bad_words": [word]})
    assert word not in out.choices[0].text.split() and out.choices[0].text != ref.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=4,
        temperature=0, extra_body={"bad_words": [word]})
    assert chat.choices[0].message.content is not None
    r = post(server, "/v1/completions", {"prompt": prompt, "bad_words": ["ok", " "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


def test_returned_message_appended_as_is(client):
    """The official client's multi-turn pattern: append the returned message object (with the
    session server's reasoning parser on, it carries reasoning_content) and ask again."""
    messages: list = [{"role": "user", "content": "Hi"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    messages += [first.choices[0].message, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert second.choices[0].message.content


def test_chat_prompt_logprobs(client, server):
    """vLLM's prompt_logprobs on chat: the rendered prompt's, as completions gives for the same
    ids (top-level in the response; in one chunk of a stream)."""
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                 "prompt_logprobs": 2}).json()  # fmt: skip
    ids = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": True}
               ).json()["tokens"]  # fmt: skip
    ref = client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                    extra_body={"prompt_logprobs": 2}).model_dump()
    plp = chat["prompt_logprobs"]
    assert len(plp) == chat["usage"]["prompt_tokens"] == len(ids) and plp[0] is None
    want = ref["choices"][0]["prompt_logprobs"]
    assert [sorted(x) for x in plp[1:]] == [sorted(x) for x in want[1:]]
    chunks = sse(server, "/chat/completions", {"messages": messages, "max_tokens": 2,
                                               "prompt_logprobs": 2})  # fmt: skip
    got = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
    assert len(got) == 1 and [sorted(x) for x in got[0][1:]] == [sorted(x) for x in plp[1:]]
