"""`swaserve serve --speculative-algorithm dflash` on the built-in default model, with no
drafter flag (issue 11): the shipped drafter serves a chat completion through the official
client, with the same answer as the session's server without speculation, and the response's
`spec_decoding` shows verify steps (the gate's warm-up always drafts; how many drafts are
accepted is tested with the gate off, in tests/unit/test_builtin_drafter.py)."""

from __future__ import annotations

import openai


def test_serve_dflash_with_no_other_flag(server, tmp_path):
    from tests.e2e.conftest import RunningServer

    # only what a CPU test machine needs besides the flag under test
    srv = RunningServer(["--speculative-algorithm", "dflash", "--device", "cpu",
                         "--kv-cache-gb", "0.25"], tmp_path / "server.log")
    try:
        srv.wait_ready()
        ask = dict(temperature=0, max_tokens=40,
                   messages=[{"role": "user", "content": "How does a bill become a law?"}])
        c = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=c.models.list().data[0].id, **ask)
        plain = openai.OpenAI(base_url=server.base_url, api_key=server.api_key, max_retries=0,
                              timeout=120)
        want = plain.chat.completions.create(model=plain.models.list().data[0].id, **ask)
        assert r.choices[0].message.content == want.choices[0].message.content
        spec = r.model_extra["spec_decoding"]
        assert spec["spec_verify_ct"] > 0 and spec["spec_accept_length"] >= 1
    finally:
        srv.stop()
