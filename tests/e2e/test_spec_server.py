"""Speculative decoding through a real server (n-gram drafter, tiny random Llama): the
`spec_decoding` object in responses and in a stream's last chunk, the fallback for a request
with no verify step, the Prometheus counters, and `bench serve`'s acceptance length."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from swaserve.cli import main as cli_main

PROMPT = "one two three four one two three four one two three four one two three"
COUNTERS = (
    "swaserve:spec_decode_num_drafts_total",
    "swaserve:spec_decode_num_draft_tokens_total",
    "swaserve:spec_decode_num_accepted_tokens_total",
)


def _counters(srv) -> dict[str, float]:
    text = httpx.get(srv.url + "/metrics").text
    out = {}
    for line in text.splitlines():
        name = line.split(" ")[0].split("{")[0]
        if name in COUNTERS or name.startswith("swaserve:spec_decode_num_accepted_tokens_per_pos"):
            key = line.rsplit(" ", 1)[0]
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def spec_server(tiny_model_folder, tmp_path_factory):
    from tests.e2e.conftest import RunningServer

    args = ["--model", str(tiny_model_folder), "--device", "cpu", "--kv-cache-gb", "0.05",
            "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "3",
            "--disable-adaptive-speculation"]  # every step drafts: the counters are checked
    srv = RunningServer(args, tmp_path_factory.mktemp("spec") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_spec_decoding_in_responses_streams_and_metrics(spec_server):
    srv = spec_server
    model = httpx.get(srv.base_url + "/models").json()["data"][0]["id"]
    c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
    before = _counters(srv)
    r = c.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                             extra_body={"ignore_eos": True})
    spec = r.model_extra["spec_decoding"]
    assert spec["spec_verify_ct"] > 0 and spec["spec_proposed_drafts"] > 0
    h = spec["spec_accept_histogram"]
    assert sum(h) == spec["spec_verify_ct"]
    assert sum(i * n for i, n in enumerate(h)) == spec["spec_accepted_drafts"]
    n = spec["spec_verify_ct"]
    assert spec["spec_accept_length"] == pytest.approx((spec["spec_accepted_drafts"] + n) / n)
    # the same request streamed: the counters come in the last chunk before [DONE]
    chunks = list(c.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].model_extra["spec_decoding"] == spec
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    # The fallback: one token, no verify step, null ratios (never a made-up 1.0).
    one = c.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0)
    fallback = one.model_extra["spec_decoding"]
    assert fallback["spec_verify_ct"] == 0 and fallback["spec_accept_length"] is None
    assert fallback["spec_accept_histogram"] == []
    after = _counters(srv)
    for name in COUNTERS:
        assert after[name] >= before.get(name, 0.0)
    drafts = "swaserve:spec_decode_num_drafts_total"
    assert after[drafts] - before.get(drafts, 0.0) == 2 * n  # the two 24-token requests


def test_bench_serve_reports_the_acceptance_length(spec_server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": PROMPT, "max_tokens": 12}) for _ in range(3)))
    out = tmp_path / "result.json"
    rc = cli_main(["bench", "serve", "--base-url", spec_server.url, "--dataset", "jsonl",
                   "--dataset-path", str(data), "--num-prompts", "3", "--max-concurrency", "2",
                   "--result-file", str(out), "--disable-tqdm"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["spec_verify_steps"] > 0 and result["spec_accept_length"] >= 1.0
    assert "acceptance length" in capsys.readouterr().out
