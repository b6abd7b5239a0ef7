"""Reasoning parsers (server/reasoning.py): the split of an answer into reasoning and content
for each parser, and the same split however the answer streams in, with no piece of a tag
sent early; chat_template_kwargs reaching the template (server/app.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from swaserve.server.reasoning import get_reasoning_parser

QWEN3 = {
    "<think>\nThe user asks.\n</think>\n\nParis.": ("\nThe user asks.\n", "Paris."),
    "  <think>x</think>y": ("x", "y"),
    "Plain answer, thinking off.": (None, "Plain answer, thinking off."),
    "<think>cut by max_tokens": ("cut by max_tokens", None),
    "<think></think>\n\nOnly content": (None, "Only content"),
    "<thinking is not the tag": (None, "<thinking is not the tag"),
    "Answer with </think> inside": (None, "Answer with </think> inside"),
    "<think>a</think>b</think>c": ("a", "b</think>c"),
    "": (None, None),
}
R1 = {
    "Let me think.</think>\n\nParis.": ("Let me think.", "Paris."),
    "<think>Let me think.</think>Paris.": ("Let me think.", "Paris."),
    "All reasoning, cut by max_tokens": ("All reasoning, cut by max_tokens", None),
    "</think>Just content": (None, "Just content"),
}

GPTOSS = {  # harmony (more in test_harmony.py)
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
    "4.<|return|>": ("Easy.", "4."),
    "<|channel|>analysis<|message|>cut by max_tokens": ("cut by max_tokens", None),
    '{"answer": 4}': (None, '{"answer": 4}'),  # no header: under a grammar from the start
}


@pytest.mark.parametrize(("name", "cases"),
                         [("qwen3", QWEN3), ("deepseek_r1", R1), ("openai_gptoss", GPTOSS)])
def test_split_and_stream_agree(name, cases):
    parser = get_reasoning_parser(name)
    rng = random.Random(0)
    for text, want in cases.items():
        assert parser.split(text) == want, text
        cuts_list = [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]
        cuts_list += [sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
                      for _ in range(10)]  # fmt: skip
        for cuts in cuts_list:
            stream, prev, pieces = parser.stream(), 0, []
            for c in [*cuts, len(text)]:
                pieces += stream.feed(text[prev:c])
                prev = c
            pieces += stream.finish()
            got = tuple("".join(t for k, t in pieces if k == kind) or None
                        for kind in ("reasoning", "content"))  # fmt: skip
            assert got == want, (text, cuts)
            assert all(t for _, t in pieces)  # no empty piece


def test_no_piece_of_a_tag_goes_out_early():
    stream = get_reasoning_parser("qwen3").stream()
    text = "<think>ab</think>\n\ncd"
    sent = [p for ch in text for p in stream.feed(ch)]
    assert all("<" not in t for _, t in sent), sent
    assert sent[0] == ("reasoning", "a")  # reasoning streams as it comes


def test_unknown_parser():
    with pytest.raises(ValueError, match="deepseek_r1"):
        get_reasoning_parser("granite")


def test_chat_template_kwargs_reach_the_template(smollm_engine):
    from swaserve.server import protocol as P
    from swaserve.server.app import APIError, _render_chat

    state = SimpleNamespace(tokenizer=smollm_engine.tokenizer, model_name="m",
                            chat_template="{% if enable_thinking %}T{% else %}F{% endif %}"
                                          "{{ messages[0].content }}")  # fmt: skip
    body = P.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}],
         "chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    assert _render_chat(state, body) == "Thi"
    body.chat_template_kwargs = None
    assert _render_chat(state, body) == "Fhi"
    body.chat_template_kwargs = {"tokenize": True}
    with pytest.raises(APIError) as e:
        _render_chat(state, body)
    assert e.value.param == "chat_template_kwargs"


def test_reasoning_effort_reaches_the_template(smollm_engine):
    """OpenAI's reasoning_effort goes to the template (gpt-oss's reads it); chat_template_kwargs
    setting it too wins."""
    from swaserve.server import protocol as P
    from swaserve.server.app import _render_chat

    state = SimpleNamespace(tokenizer=smollm_engine.tokenizer, model_name="m",
                            chat_template="{{ reasoning_effort | default('unset') }}")  # fmt: skip
    msgs = [{"role": "user", "content": "hi"}]
    ask = P.ChatCompletionRequest.model_validate
    assert _render_chat(state, ask({"messages": msgs})) == "unset"
    assert _render_chat(state, ask({"messages": msgs, "reasoning_effort": "low"})) == "low"
    both = ask({"messages": msgs, "reasoning_effort": "low",
                "chat_template_kwargs": {"reasoning_effort": "high"}})  # fmt: skip
    assert _render_chat(state, both) == "high"
    with pytest.raises(ValueError):
        ask({"messages": msgs, "reasoning_effort": "extreme"})
