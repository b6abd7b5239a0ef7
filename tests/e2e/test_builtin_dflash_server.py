"""`swaserve serve --speculative-algorithm dflash` on the built-in default model, with no
drafter flag (issue 11): the shipped drafter serves a chat completion through the official
client, and the response's `spec_decoding` shows drafts accepted."""

from __future__ import annotations

import openai


def test_serve_dflash_with_no_other_flag(tmp_path):
    from tests.e2e.conftest import RunningServer

    # only what a CPU test machine needs besides the flag under test
    srv = RunningServer(["--speculative-algorithm", "dflash", "--device", "cpu",
                         "--kv-cache-gb", "0.25"], tmp_path / "server.log")
    try:
        srv.wait_ready()
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)
        r = c.chat.completions.create(
            model=c.models.list().data[0].id, temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "How does a bill become a law?"}])
        assert r.choices[0].message.content
        spec = r.model_extra["spec_decoding"]
        assert spec["spec_verify_ct"] > 0
        assert spec["spec_accepted_drafts"] > 0 and spec["spec_accept_length"] > 1
    finally:
        srv.stop()
