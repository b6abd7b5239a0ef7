"""`swaserve bench serve` without a server: the metric math (percentiles, TPOT, goodput,
peaks), the SSE parsing of both endpoints, the datasets and the flag errors."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from swaserve.bench import datasets as D
from swaserve.bench import serve as S
from swaserve.bench.offline import run_offline_bench
from swaserve.cli import main as cli_main


def args_for(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    S.add_args(p)
    return p.parse_args(list(argv))


def done(
    ttft: float,
    e2e: float,
    out: int,
    itl: list[float] | None = None,
    start: float = 0.0,
    prompt: int = 10,
) -> S.Result:
    return S.Result(
        ok=True,
        prompt_tokens=prompt,
        output_tokens=out,
        ttft=ttft,
        e2e=e2e,
        itl=itl or [],
        start=start,
    )


# ---- metric math ----------------------------------------------------------------------------


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.random() for _ in range(n)]
        for p in (1, 25, 50, 90, 95, 99, 99.9, 100):
            assert S.percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    assert S.percentile([], 99) == 0.0


def test_distribution_keys_and_values():
    xs = [0.001, 0.002, 0.003, 0.010]
    d = S.distribution("ttft", xs, [50, 90, 99.9])
    assert set(d) == {
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p50_ttft_ms",
        "p90_ttft_ms",
        "p99.9_ttft_ms",
    }
    assert d["mean_ttft_ms"] == pytest.approx(4.0)
    assert d["std_ttft_ms"] == pytest.approx(np.std(xs) * 1000)
    assert d["median_ttft_ms"] == d["p50_ttft_ms"] == pytest.approx(2.5)
    assert d["p50_ttft_ms"] <= d["p90_ttft_ms"] <= d["p99.9_ttft_ms"] <= 10.0
    assert all(v == 0.0 for v in S.distribution("itl", [], [99]).values())


def test_tpot_excludes_one_token_requests():
    assert done(0.1, 0.5, 5).tpot == pytest.approx(0.1)  # (0.5 - 0.1) / 4
    assert done(0.1, 0.1, 1).tpot is None
    results = [done(0.1, 0.5, 5), done(0.2, 0.2, 1), done(0.1, 0.3, 3), S.Result(error="x")]
    m = S.compute_metrics(results, 2.0, [50, 99])
    assert m["completed"] == 3 and m["failed"] == 1 and m["errors"] == ["x"]
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # both multi-token requests: 0.1 s
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == 1.5 and m["output_throughput"] == 4.5
    assert m["input_throughput"] == 15.0 and m["total_token_throughput"] == 19.5
    assert m["mean_ttft_ms"] == pytest.approx(400 / 3)
    assert m["request_goodput"] is None and "goodput_targets_ms" not in m


def test_goodput_counts_requests_meeting_every_target():
    fast = done(0.05, 0.45, 5)  # TPOT 100 ms
    slow_start = done(0.50, 0.90, 5)  # TPOT 100 ms
    slow_decode = done(0.05, 1.65, 5)  # TPOT 400 ms
    one_token = done(0.05, 0.05, 1)  # no TPOT: counts as 0 for goodput (as vLLM)
    results = [fast, slow_start, slow_decode, one_token]
    m = S.compute_metrics(results, 2.0, [99], {"ttft": 100, "tpot": 150})
    assert m["good_requests"] == 2 and m["request_goodput"] == 1.0
    assert m["goodput_targets_ms"] == {"ttft": 100, "tpot": 150}
    assert S.compute_metrics(results, 2.0, [99], {"e2el": 1000})["good_requests"] == 3
    assert S.is_good(fast, {"ttft": 50}) and not S.is_good(fast, {"ttft": 49.9})


def test_peaks_tokens_per_second_and_in_flight():
    a = done(0.5, 2.5, 3, itl=[0.1, 1.0], start=10.0)  # tokens at 10.5, 10.6, 11.6
    b = done(0.2, 1.0, 2, itl=[0.1], start=10.6)  # tokens at 10.8, 10.9; ends 11.6
    c = done(0.1, 0.2, 1, start=12.5)  # starts after a ended (12.5): never three at once
    assert S.peaks([a, b, c]) == (4.0, 2)
    assert S.peaks([]) == (0.0, 0)


def test_format_summary_reads_like_vllms_table():
    results = [done(0.01 * i, 0.05 + 0.01 * i, 4, itl=[0.01] * 3) for i in range(1, 6)]
    s = S.compute_metrics(results, 1.0, [50, 90, 95, 99], {"ttft": 30})
    s.update(endpoint_type="chat", max_concurrency=4, request_rate=None)
    text = S.format_summary(s)
    for line in (
        "Serving Benchmark Result",
        "Request goodput (req/s):",
        "Goodput targets (ms):",
        "Time per Output Token (excl. 1st token)",
        "P95 TPOT (ms):",
        "P50 ITL (ms):",
        "P99 E2EL (ms):",
        "Endpoint:",
        "/v1/chat/completions",
    ):
        assert line in text, line
    assert "Successful requests:                     5" in text and "Median" not in text
    s["metric_percentiles"] = [99]
    assert "Median ITL (ms):" in S.format_summary(s)
    json.dumps(s, allow_nan=False)  # the JSON result is strict


# ---- flags ----------------------------------------------------------------------------------


def test_parse_goodput():
    assert S.parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert S.parse_goodput(["e2el:1000,ttft:0"]) == {"e2el": 1000.0, "ttft": 0.0}
    assert S.parse_goodput(None) == {}
    for bad, why in [
        ("itl:5", "KEY one of ttft, tpot, e2el"),
        ("ttft", "KEY:MS"),
        ("ttft:fast", "not milliseconds"),
        ("tpot:-1", ">= 0"),
        ("ttft:inf", ">= 0"),
    ]:
        with pytest.raises(ValueError, match=why) as e:
            S.parse_goodput([bad])
        assert str(e.value).startswith(f"--goodput {bad!r}") and "\n" not in str(e.value)


def test_parse_percentiles():
    assert S.parse_percentiles("99,50,90,50") == [50.0, 90.0, 99.0]
    for bad in ("", "0", "101", "p99", "50;90"):
        with pytest.raises(ValueError, match="^--metric-percentiles"):
            S.parse_percentiles(bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--dataset", "nope"],
            "error: --dataset 'nope': not one of random, shared-prefix, "
            "jsonl, sharegpt (nor an existing file)",
        ),
        (["--dataset", "sharegpt"], "error: --dataset sharegpt needs --dataset-path FILE"),
        (
            ["--dataset", "jsonl", "--dataset-path", "/no/such.jsonl"],
            "error: --dataset-path /no/such.jsonl: no such file",
        ),
        (
            ["--goodput", "ttft=5"],
            "error: --goodput 'ttft=5': expected KEY:MS with KEY one of ttft, tpot, e2el",
        ),
        (
            ["--metric-percentiles", "x"],
            "error: --metric-percentiles 'x': expected numbers in (0, 100], e.g. 50,90,99",
        ),
        (["--burstiness", "0"], "error: --burstiness must be > 0"),
    ],
)
def test_bad_flags_fail_before_connecting(argv, message, capsys):
    # Port 9 (discard) on localhost: nothing is contacted, the flags fail first.
    rc = cli_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", *argv])
    assert rc == 2
    assert capsys.readouterr().err.strip() == message


# ---- the streaming client -------------------------------------------------------------------


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + (
        b"data: [DONE]\n\n"
    )


def _fetch(body: dict, payload: bytes) -> S.Result:
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, content=payload)

    async def go() -> S.Result:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await S._one(c, "http://x/v1/any", body, 5.0)

    res = asyncio.run(go())
    assert seen["body"] == body
    return res


def test_chat_stream_counts_tokens_not_the_role_chunk():
    req = D.BenchRequest("Hi there", 3)
    body = S.request_body(req, "m", "chat", ignore_eos=True)
    assert body["messages"] == [{"role": "user", "content": "Hi there"}]
    assert body["max_completion_tokens"] == 3 and body["stream_options"]["include_usage"]
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    res = _fetch(
        body,
        _sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "A"}, "token_ids": [5]}]},
            {"choices": [{"index": 0, "delta": {"content": "BC"}, "token_ids": [6, 7]}]},
            {"choices": [], "usage": usage},
        ),
    )
    assert res.ok and res.error == ""
    assert (res.prompt_tokens, res.output_tokens, res.cached_tokens) == (7, 3, 4)
    assert res.streamed_tokens == 3 and len(res.itl) == 2 and res.itl[0] == res.itl[1]
    assert 0 < res.ttft <= res.e2e and res.tpot is not None


def test_completions_stream_without_token_ids_or_usage():
    body = S.request_body(D.BenchRequest([1, 2, 3], 2), "m", "completions", ignore_eos=False)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 2 and not body["ignore_eos"]
    res = _fetch(
        body,
        _sse(
            {"choices": [{"index": 0, "text": "x"}]},
            {"choices": [{"index": 0, "text": ""}]},
            {"choices": [{"index": 0, "text": "y"}]},
        ),
    )
    assert res.ok and res.output_tokens == 2 and res.prompt_tokens == 3 and len(res.itl) == 1


def test_stream_error_chunk_fails_the_request():
    body = S.request_body(D.BenchRequest("x", 2), "m", "completions", ignore_eos=True)
    res = _fetch(body, _sse({"error": {"message": "boom"}}))
    assert not res.ok and "boom" in res.error


# ---- datasets -------------------------------------------------------------------------------


def test_jsonl_format(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "Hello", "max_tokens": 5},
        {"prompt": [1, 2, 3]},
        {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi!"}]},
    ]
    path.write_text("\n".join(map(json.dumps, lines[:2])) + "\n\n" + json.dumps(lines[2]) + "\n")
    items = D.load_jsonl(path, default_max_tokens=9)
    assert [(r.prompt, r.max_tokens, r.messages) for r in items] == [
        ("Hello", 5, None),
        ([1, 2, 3], 9, None),
        ("Hi", 9, [{"role": "user", "content": "Hi!"}]),
    ]
    args = args_for("--dataset", "jsonl", "--dataset-path", str(path), "--num-prompts", "5")
    convs = D.build_dataset(args)
    assert [c[0].prompt for c in convs] == ["Hello", [1, 2, 3], "Hi", "Hello", [1, 2, 3]]
    legacy = D.build_dataset(args_for("--dataset", str(path), "--num-prompts", "2"))
    assert [c[0].prompt for c in legacy] == ["Hello", [1, 2, 3]]


@pytest.mark.parametrize(
    "line, chat, why",
    [
        ("{not json", False, "line 2: not JSON"),
        ('["a"]', False, "line 2: expected a JSON object"),
        ('{"max_tokens": 3}', False, 'line 2: needs "prompt"'),
        ('{"prompt": ""}', False, 'line 2: "prompt" must be non-empty'),
        ('{"prompt": "a", "max_tokens": 0}', False, 'line 2: "max_tokens" must be a positive'),
        ('{"messages": [{"role": "user", "content": "a"}]}', False, "need --endpoint-type chat"),
        ('{"prompt": [1, 2]}', True, "token ids cannot go to the chat endpoint"),
        ('{"messages": "hi"}', True, '"messages" must be a non-empty list'),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, line, chat, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match="^--dataset-path .*bad.jsonl") as e:
        D.load_jsonl(path, 4, chat)
    assert why in str(e.value)


def _sharegpt(tmp_path, convs: list) -> str:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    return str(path)


def test_sharegpt_first_human_turn_and_reply_length(tmp_path):
    long = "one two three four five"
    convs = [
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "what is a cat really ok"},
                {"from": "gpt", "value": long + " six"},
                {"from": "human", "value": "later turn"},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": long}]},
        {
            "conversations": [
                {"from": "human", "value": "a b c d e"},
                {"from": "gpt", "value": "too short"},
            ]
        },
        {"conversations": [{"from": "gpt", "value": long}]},
        {"id": "no conversations"},
    ]
    path = _sharegpt(tmp_path, convs)
    args = args_for("--dataset", "sharegpt", "--dataset-path", path, "--num-prompts", "3")
    convs_out = D.build_dataset(args)  # words: only the first pair passes the filters
    assert [(c[0].prompt, c[0].max_tokens) for c in convs_out] == [
        ("what is a cat really ok", 6)
    ] * 3
    over = args_for(
        "--dataset",
        "sharegpt",
        "--dataset-path",
        path,
        "--sharegpt-output-len",
        "2",
        "--num-prompts",
        "2",
    )
    got = sorted((c[0].prompt, c[0].max_tokens) for c in D.build_dataset(over))
    assert got == [("a b c d e", 2), ("what is a cat really ok", 2)]
    chars = D.load_sharegpt(tmp_path / "sg.json", count=len)  # a counter in characters
    assert {r.prompt for r in chars} == {"what is a cat really ok", "a b c d e"}


def test_sharegpt_errors(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text("{broken")
    with pytest.raises(ValueError, match="^--dataset-path .*sg.json: not JSON"):
        D.load_sharegpt(path, len)
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="expected a JSON list"):
        D.load_sharegpt(path, len)
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}]))
    with pytest.raises(ValueError, match="no usable ShareGPT conversation"):
        D.load_sharegpt(path, len)


def test_text_counter_falls_back_to_words():
    count, unit = D.text_counter("/no/such/model")
    assert unit == "words" and count("a b  c") == 3
    assert D.text_counter(None)[1] == "words"


def test_random_and_shared_prefix_unchanged():
    convs = D.build_dataset(args_for("--num-prompts", "3", "--input-len", "5"))
    assert len(convs) == 3 and all(len(c[0].prompt.split()) == 5 for c in convs)
    sp = D.build_dataset(
        args_for(
            "--dataset",
            "shared-prefix",
            "--num-prompts",
            "4",
            "--num-turns",
            "2",
            "--prefix-len",
            "6",
            "--input-len",
            "2",
        )
    )
    assert [len(c) for c in sp] == [2, 2]
    assert sp[0][1].prompt.startswith(sp[0][0].prompt)


# ---- bench offline's progress bar -----------------------------------------------------------


def test_bench_offline_shows_progress_on_the_workload_only():
    calls = []

    class FakeEngine:
        core = SimpleNamespace(
            hf_config=SimpleNamespace(vocab_size=1000), device=SimpleNamespace(type="cpu")
        )

        def generate(self, prompt_token_ids, sampling_params, use_tqdm):
            calls.append((len(prompt_token_ids), use_tqdm))

    run_offline_bench(FakeEngine(), 5, (3, 4), (2, 3))
    assert calls == [(1, False), (1, False), (1, False), (5, True)]
    calls.clear()
    run_offline_bench(FakeEngine(), 5, (3, 4), (2, 3), progress=False)
    assert calls[-1] == (5, False)


def test_response_format_json_object_counts_valid_answers():
    body = S.request_body(D.BenchRequest("Hi", 8), "m", "chat", ignore_eos=True,
                          response_format="json_object")  # fmt: skip
    assert body["response_format"] == {"type": "json_object"}
    assert "response_format" not in S.request_body(D.BenchRequest("Hi", 8), "m", "chat", True)
    whole = _fetch(body, _sse(
        {"choices": [{"index": 0, "delta": {"content": '{"a": '}, "token_ids": [5, 6]}]},
        {"choices": [{"index": 0, "delta": {"content": "1}"}, "token_ids": [7]}]},
    ))  # fmt: skip
    cut = _fetch(body, _sse(
        {"choices": [{"index": 0, "delta": {"content": '{"a": '}, "token_ids": [5, 6]}]},
    ))  # fmt: skip
    assert "".join(whole.text) == '{"a": 1}'
    m = S.compute_metrics([whole, cut], 1.0, [50], structured=True)
    assert m["json_valid_rate"] == 0.5
    assert "Valid JSON outputs (share):" in S.format_summary({**m, "max_concurrency": 1})
    assert "json_valid_rate" not in S.compute_metrics([whole], 1.0, [50])
