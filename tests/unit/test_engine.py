"""Offline Engine behaviour on the built-in models: API shape, sampling, seeds in mixed
batches, stop conditions, logprobs, bad input, and the memory benchmark CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from swaserve import Engine, SamplingParams
from swaserve.cli import main as cli_main


def test_generate_api_shape(gemma_engine):
    outs = gemma_engine.generate(
        ["The capital of France is"], SamplingParams(max_tokens=16, temperature=0)
    )
    out = outs[0]
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids[0] == 2  # <bos>
    assert len(out.token_ids) == 16 and out.outputs[0].finish_reason == "length"
    assert out.text == out.outputs[0].text and out.text.strip()
    again = gemma_engine.generate(
        prompt_token_ids=[out.prompt_token_ids], sampling_params=SamplingParams(
            max_tokens=16, temperature=0)
    )
    assert again[0].token_ids == out.token_ids and again[0].prompt is None


def test_chat_smollm(smollm_engine):
    outs = smollm_engine.chat(
        [[{"role": "user", "content": "What is the capital of France?"}]],
        SamplingParams(max_tokens=24, temperature=0),
    )
    assert "Paris" in outs[0].text


def test_chat_with_tools_offline(smollm_engine):
    """Engine.chat(tools=...) renders the tools as the server does: SmolLM2's template never
    reads them, so they go into a system message (no call format: its template implies none);
    a template that reads `tools` gets them itself; a malformed tool is a ValueError."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    text = smollm_engine.apply_chat_template(ask, tools=[weather])
    assert text.startswith("<|im_start|>system\nYou can call these tools") and "get_weather" in text
    assert "<tool_call>" not in text  # no format without a parser
    assert smollm_engine.apply_chat_template(ask) != text
    reads = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    assert smollm_engine.apply_chat_template(ask, reads, tools=[weather]) == (
        "[get_weather]Weather in Paris?")
    out = smollm_engine.chat(ask, SamplingParams(max_tokens=4, temperature=0), tools=[weather])
    assert out[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="tools"):
        smollm_engine.apply_chat_template(ask, tools=[{"type": "function"}])


def test_gemma_has_no_chat_template(gemma_engine):
    with pytest.raises(ValueError, match="chat template"):
        gemma_engine.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=2))


def test_seeded_sampling_same_alone_and_in_mixed_batch(gemma_engine):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = gemma_engine.generate(["A short story about a cat:"], p)[0].token_ids
    long_prompt = "Numbers: " + " ".join(str(i) for i in range(400))
    others = [
        SamplingParams(max_tokens=20, temperature=0.8),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99),
        SamplingParams(max_tokens=5, temperature=0),
    ]
    sched = gemma_engine.core.scheduler
    budget, sched.budget = sched.budget, 64  # the long prompt prefills in chunks beside decodes
    try:
        outs = gemma_engine.generate(
            [long_prompt, "Hello", "A short story about a cat:", "A short story about a cat:"],
            [others[0], others[1], p, others[2]],
        )
    finally:
        sched.budget = budget
    assert outs[2].token_ids == alone
    assert outs[1].token_ids != alone  # another seed, another sample


def test_n_and_seeds(gemma_engine):
    p = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7)
    out = gemma_engine.generate(["Colors of the rainbow:"], p)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = gemma_engine.generate(["Colors of the rainbow:"], p)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_offline_batch_queues_longest_first_and_returns_in_order_given(smollm_engine):
    """offline_order longest_first queues a batch by max_tokens, longest first (request ids
    count up in queue order), and arrival keeps the order given; outputs come back in the
    order given with the same greedy tokens either way."""
    prompts = ["One, two,", "Red, green,", "Monday, Tuesday,", "North, south,"]
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (2, 6, 2, 4)]
    sched, config = smollm_engine.core.scheduler, smollm_engine.config
    seqs, sched.max_num_seqs = sched.max_num_seqs, 1  # one at a time: queue order is run order
    try:
        longest = smollm_engine.generate(prompts, params)
        smollm_engine.config = dataclasses.replace(config, offline_order="arrival")
        arrival = smollm_engine.generate(prompts, params)
    finally:
        sched.max_num_seqs, smollm_engine.config = seqs, config

    def queue_order(outs):
        return sorted(range(len(outs)), key=lambda i: int(outs[i].request_id))

    assert queue_order(longest) == [1, 3, 0, 2]  # 6, 4, then the two 2s in the order given
    assert queue_order(arrival) == [0, 1, 2, 3]
    assert [len(o.token_ids) for o in longest] == [2, 6, 2, 4]
    assert [o.token_ids for o in longest] == [o.token_ids for o in arrival]
    assert [o.prompt for o in longest] == prompts


def test_stop_conditions(smollm_engine):
    base = smollm_engine.generate(["1, 2, 3, 4,"], SamplingParams(max_tokens=16, temperature=0))
    text = base[0].text
    assert " 6" in text, text
    out = smollm_engine.generate(
        ["1, 2, 3, 4,"], SamplingParams(max_tokens=16, temperature=0, stop=[" 6"])
    )[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " 6"
    assert out.text == text[: text.index(" 6")]
    first = base[0].token_ids[0]
    out = smollm_engine.generate(
        ["1, 2, 3, 4,"], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[first])
    )[0]
    assert out.token_ids == [first] and out.outputs[0].finish_reason == "stop"


def test_logprobs_are_raw_log_softmax(smollm_engine):
    p = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=2)
    out = smollm_engine.generate(["The sky is"], p)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, lp in zip(out.token_ids, lps):
        assert lp.token_id == tok and lp.rank == 1  # greedy picks the top token
        assert len(lp.top) == 3 and lp.top[0][0] == tok
        assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert math.fsum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-4
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == len(out.prompt_token_ids)
    assert [x.token_id for x in pl[1:]] == out.prompt_token_ids[1:]
    assert all(x.logprob <= 0 and len(x.top) == 2 for x in pl[1:])


def test_bad_input_raises_and_engine_keeps_serving(gemma_engine):
    eng = gemma_engine
    with pytest.raises(ValueError, match="empty"):
        eng.generate([""], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="empty"):
        eng.generate(prompt_token_ids=[[]], sampling_params=SamplingParams(max_tokens=2))
    too_long = [2] + [651] * eng.core.max_model_len
    with pytest.raises(ValueError, match="context"):
        eng.generate(prompt_token_ids=[too_long], sampling_params=SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context"):
        eng.generate(["Hi"], SamplingParams(max_tokens=eng.core.max_model_len))
    for bad in (
        dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0), dict(n=0)
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="unknown model|not found|Unknown"):
        Engine(model="no-such-model-xyz", device="cpu")
    out = eng.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].token_ids) == 3
    idle = eng.memory_stats()  # idle: only the prefix cache holds pages
    assert idle["pages_free"] + idle["cache_pages"] == idle["pages_total"]
    assert idle["pages_held_by_requests"] == 0


def test_memory_stats_shape(gemma_engine):
    s = gemma_engine.memory_stats()
    assert s["page_size"] == 16 and s["pages_total"] > 0
    kinds = sorted((g["kind"], g["window"], len(g["layers"])) for g in s["groups"])
    assert kinds == [("full", None, 3)] + [("swa", 512, 3)] * 5


def test_preemption_under_memory_pressure():
    """A pool too small for every request at once preempts and recomputes; outputs equal the
    unpressured run and memory returns to empty."""
    prompts = [f"Count with me: {i}, {i + 1}," for i in range(6)]
    p = SamplingParams(max_tokens=24, temperature=0)
    roomy = Engine(model="smollm2-135m-instruct", device="cpu", kv_cache_gb=0.05)
    want = [o.token_ids for o in roomy.generate(prompts, p)]
    del roomy
    # 30 layers x 3 kv heads x 64 dims x 4 bytes x 2 x 16 tokens = 737 kB a page: 12 pages.
    # schedule_conservativeness=0: admit eagerly, so the pool runs short and preempts
    tight = Engine(model="smollm2-135m-instruct", device="cpu", kv_cache_gb=0.0085,
                   schedule_conservativeness=0)
    assert tight.memory_stats()["pages_total"] < 6 * 3
    got = [o.token_ids for o in tight.generate(prompts, p)]
    assert got == want
    assert tight.core.scheduler.num_preemptions > 0
    tight.core.memory.check_integrity()
    idle = tight.memory_stats()  # idle: only the prefix cache holds pages
    assert idle["pages_free"] + idle["cache_pages"] == idle["pages_total"]
    assert idle["pages_held_by_requests"] == 0


def test_bench_memory_cli(capsys):
    rc = cli_main(
        ["bench", "memory", "--model", "gemma-3-270m", "--context", "8192", "--kv-cache-gb", "2"]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("bytes_per_request", "bytes_per_request_all_full", "max_concurrent",
                "max_concurrent_all_full", "ratio"):
        assert key in result
    assert result["ratio"] >= 4, result


def test_generate_cli(capsys):
    rc = cli_main(["generate", "--model", "smollm2-135m-instruct", "--device", "cpu",
                   "--prompt", "The capital of France is", "--max-tokens", "4",
                   "--kv-cache-gb", "0.05"])
    assert rc == 0
    assert capsys.readouterr().out.strip()


def test_chat_cli(capsys, monkeypatch):
    """`swaserve chat` with lines piped in: each a user turn of one conversation, answered as
    chat_stream streams it (the second turn sees the first), /reset starts over."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(
        "What is the capital of France?\nAnd of Italy?\n/reset\n\nSay hi.\n/exit\nnot read\n"))
    rc = cli_main(["chat", "--model", "smollm2-135m-instruct", "--device", "cpu",
                   "--kv-cache-gb", "0.05", "--max-tokens", "12", "--system", "Be brief."])
    assert rc == 0
    answers = capsys.readouterr().out.splitlines()
    assert len(answers) == 3 and "Paris" in answers[0], answers
    assert "Rome" in answers[1], answers  # the conversation went on


def test_generate_cli_structured_outputs(capsys, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps({"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}}))
    base = ["generate", "--model", "smollm2-135m-instruct", "--device", "cpu", "--chat",
            "--kv-cache-gb", "0.05", "--max-tokens", "40"]
    assert cli_main([*base, "--prompt", "Describe Ann, 31, as JSON.",
                     "--json-schema", f"@{schema}"]) == 0
    person = json.loads(capsys.readouterr().out)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert cli_main([*base, "--prompt", "Red or blue?", "--choice", "red", "--choice",
                     "blue"]) == 0
    assert capsys.readouterr().out.strip() in ("red", "blue")


def test_torch_attend_sinks_formula():
    """Sinks: one extra logit per head in the softmax denominator, with no value."""
    from swaserve.attention.torch_backend import attend

    g = torch.Generator().manual_seed(0)
    n, h, hkv, d, L = 3, 4, 2, 8, 5
    q, k, v = (torch.randn(x, generator=g) for x in ((n, h, d), (L, hkv, d), (L, hkv, d)))
    sinks = torch.randn(h, generator=g)
    mask = torch.ones(n, L, dtype=torch.bool)
    mask[0, 3:] = False
    got = attend(q, k, v, mask, 0.5, None, sinks)
    for i in range(n):
        for j in range(h):
            kv = j // (h // hkv)
            s = (k[:, kv] @ q[i, j]) * 0.5
            s = s.masked_fill(~mask[i], float("-inf"))
            w = torch.exp(s) / (torch.exp(s).sum() + torch.exp(sinks[j]))
            assert torch.allclose(got[i, j], w @ v[:, kv], atol=1e-5)


def test_torch_attend_softcap_formula():
    from swaserve.attention.torch_backend import attend

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 2, 4, generator=g) * 4, torch.randn(3, 1, 4, generator=g) * 4, \
        torch.randn(3, 1, 4, generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    got = attend(q, k, v, mask, 1.0, 2.0)
    s = torch.einsum("nhd,ld->nhl", q, k[:, 0])
    w = torch.softmax(torch.tanh(s / 2.0) * 2.0, dim=-1)
    assert torch.allclose(got, torch.einsum("nhl,ld->nhd", w, v[:, 0]), atol=1e-5)


def test_chat_stream_equals_chat_and_aborts_when_closed(smollm_engine):
    """Engine.chat_stream gives chat()'s text piece by piece; closing it early aborts the
    request (the fixture then finds nothing unfinished and the pool consistent)."""
    ask = [{"role": "user", "content": "Name three colours."}]
    greedy = SamplingParams(max_tokens=24, temperature=0, stop=["\n\n"])
    pieces = list(smollm_engine.chat_stream(ask, greedy))
    assert len(pieces) > 3 and "".join(pieces) == smollm_engine.chat(ask, greedy)[0].text
    stream = smollm_engine.chat_stream(ask, SamplingParams(max_tokens=200, temperature=0))
    next(stream)
    stream.close()
    assert not smollm_engine.core.has_unfinished()
    with pytest.raises(ValueError, match="n = 1"):
        next(smollm_engine.chat_stream(ask, SamplingParams(n=2)))


def test_reset_prefix_cache(smollm_engine):
    """vLLM's LLM.reset_prefix_cache: a prompt cached before is not after; refused (False,
    nothing dropped) while a request is unfinished."""
    eng = smollm_engine
    prompt = "The old mill stands by the river. " * 8
    p = SamplingParams(max_tokens=2, temperature=0)
    eng.generate(prompt, p)
    assert eng.generate(prompt, p)[0].num_cached_tokens > 0
    stream = eng.chat_stream([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=4))
    next(stream)  # a request now runs
    assert eng.reset_prefix_cache() is False
    assert eng.memory_stats()["cache_pages"] > 0
    stream.close()
    assert eng.reset_prefix_cache() is True
    assert eng.memory_stats()["cache_pages"] == 0
    eng.core.memory.check_integrity()
    assert eng.generate(prompt, p)[0].num_cached_tokens == 0
    assert eng.get_tokenizer() is eng.tokenizer
