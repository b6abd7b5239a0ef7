"""`swaserve bench serve` against the real server (the session's `server` fixture), on both
endpoints: the JSON's token counts are the server's usage, its percentiles are ordered, TPOT
is there, goodput follows its targets and the progress bar goes to stderr."""

from __future__ import annotations

import json

import httpx

from swaserve.cli import main as cli_main
from tests.e2e.conftest import API_KEY, MODEL

LATENCIES = ("ttft", "tpot", "itl", "e2el")


def bench(server, tmp_path, capsys, *argv: str) -> tuple[dict, str, str]:
    out = tmp_path / "result.json"
    rc = cli_main(
        [
            "bench",
            "serve",
            "--base-url",
            server.url,
            "--api-key",
            API_KEY,
            "--save-detailed",
            "--max-concurrency",
            "2",
            "--result-file",
            str(out),
            *argv,
        ]
    )
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    return json.loads(out.read_text()), cap.out, cap.err


def usage(server, path: str, body: dict) -> dict:
    body = {"model": MODEL, "max_tokens": 1, **body}
    r = httpx.post(server.base_url + path, json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def check_common(result: dict, n: int) -> None:
    assert result["completed"] == n and result["failed"] == 0, result["errors"]
    assert result["output_lens"] == result["streamed_lens"]  # usage == tokens streamed
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    for name in LATENCIES:
        ps = [result[f"p{p}_{name}_ms"] for p in (50, 90, 95, 99)]
        assert 0 < ps[0] <= ps[1] <= ps[2] <= ps[3], (name, ps)
        assert result[f"mean_{name}_ms"] > 0 and result[f"std_{name}_ms"] >= 0
        assert result[f"median_{name}_ms"] == ps[0]
    assert result["mean_tpot_ms"] <= result["mean_e2el_ms"]
    assert result["request_throughput"] > 0 and result["input_throughput"] > 0
    assert result["max_concurrent_requests"] in (1, 2)


def test_completions_jsonl(server, tmp_path, capsys):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Water boils at"]
    lengths = [3, 4, 5, 6]
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "max_tokens": m}) + "\n" for p, m in zip(prompts, lengths))
    )
    result, out, err = bench(
        server,
        tmp_path,
        capsys,
        "--dataset",
        "jsonl",
        "--dataset-path",
        str(data),
        "--num-prompts",
        "4",
        "--goodput",
        "ttft:600000",
        "tpot:600000",
    )
    check_common(result, 4)
    assert result["output_lens"] == lengths  # ignore_eos: exactly max_tokens, in order
    assert result["input_lens"] == [
        usage(server, "/completions", {"prompt": p})["prompt_tokens"] for p in prompts
    ]
    assert result["request_goodput"] == result["request_throughput"]
    assert "Time per Output Token (excl. 1st token)" in out and "Request goodput" in out
    assert "bench serve" in err and "4/4" in err  # the progress bar


def test_chat_sharegpt(server, tmp_path, capsys):
    from swaserve.bench.datasets import text_counter

    convs = [
        ("Name three colours of the rainbow.", "Red, orange and yellow are three."),
        ("What is the opposite of cold?", "The opposite of cold is hot."),
        ("Say hello in French, please.", "Bonjour! That is hello in French."),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                for q, a in convs
            ]
        )
    )
    result, out, _ = bench(
        server,
        tmp_path,
        capsys,
        "--endpoint-type",
        "chat",
        "--dataset",
        "sharegpt",
        "--dataset-path",
        str(path),
        "--num-prompts",
        "3",
        "--goodput",
        "ttft:0",
        "--disable-tqdm",
    )
    check_common(result, 3)
    assert result["endpoint_type"] == "chat" and result["sharegpt_length_unit"] == "tokens"
    count, _ = text_counter(MODEL)  # the served model's tokenizer: replies set max_tokens
    assert sorted(result["output_lens"]) == sorted(count(a) for _, a in convs)
    expected_in = [
        usage(server, "/chat/completions", {"messages": [{"role": "user", "content": q}]})[
            "prompt_tokens"
        ]
        for q, _ in convs
    ]
    assert sorted(result["input_lens"]) == sorted(expected_in)
    assert result["request_goodput"] == 0.0 and result["good_requests"] == 0
    assert "/v1/chat/completions" in out
