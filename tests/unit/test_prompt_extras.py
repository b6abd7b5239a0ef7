"""vLLM's prompt-shaping request fields, offline: truncate_prompt_tokens (left truncation, -1
for the context) and chat's continue_final_message (an assistant prefill continued), against
the same request written out by hand on the real smollm2 engine."""

from __future__ import annotations

import pytest

from swaserve.engine.limits import truncate_prompt
from swaserve.sampling.params import SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("k", [0, -2, 1.5, "3", True])
def test_truncate_prompt_tokens_rejects_bad_values(k):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=k)


def test_truncate_prompt_keeps_the_last_k():
    ids = list(range(10))
    assert truncate_prompt(ids, SamplingParams(), 4) is ids
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=3), 100) == [7, 8, 9]
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=20), 100) is ids
    assert truncate_prompt(ids, SamplingParams(truncate_prompt_tokens=-1), 4) == [6, 7, 8, 9]


def test_truncated_prompt_generates_as_its_tail(smollm_engine):
    eng = smollm_engine
    ids = eng.tokenizer.encode("The old mill stands by the river, and the bridge is made of")
    k = len(ids) - 5
    cut = eng.generate("The old mill stands by the river, and the bridge is made of",
                       SamplingParams(truncate_prompt_tokens=k, **GREEDY))[0]
    tail = eng.generate(prompt_token_ids=[ids[-k:]], sampling_params=SamplingParams(**GREEDY))[0]
    assert cut.prompt_token_ids == ids[-k:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = eng.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        truncate_prompt_tokens=len(ids) + 3, **GREEDY))[0]  # fmt: skip
    assert whole.prompt_token_ids == ids


def test_continue_final_message(smollm_engine):
    eng = smollm_engine
    conv = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "My favourite colour is"}]
    prompt = eng.apply_chat_template(conv, add_generation_prompt=False,
                                     continue_final_message=True)
    assert prompt.endswith("My favourite colour is")  # the turn is left open
    closed = eng.apply_chat_template(conv, add_generation_prompt=False)
    assert closed.rstrip().endswith("<|im_end|>")
    out = eng.chat(conv, SamplingParams(**GREEDY), add_generation_prompt=False,
                   continue_final_message=True)[0]
    ref = eng.generate(prompt_token_ids=[eng.tokenizer.encode(prompt, add_special_tokens=False)],
                       sampling_params=SamplingParams(**GREEDY))[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="continue_final_message"):
        eng.apply_chat_template(conv, continue_final_message=True)


def test_documents_reach_the_chat_template(smollm_engine):
    """vLLM's `documents` field goes to the template (retrieval-augmented templates read it);
    the server's renderer, with a template that lists them."""
    from types import SimpleNamespace

    from swaserve.server import protocol as P
    from swaserve.server.app import APIError, _render_chat

    template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    state = SimpleNamespace(tokenizer=smollm_engine.tokenizer, chat_template=template,
                            model_name="m")
    body = P.ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Where?"}],
        "documents": [{"title": "Mill", "text": "by the river"}]})
    assert _render_chat(state, body) == "[Mill: by the river]<user>Where?"
    both = P.ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
        "add_generation_prompt": True})
    with pytest.raises(APIError) as e:
        _render_chat(state, both)
    assert e.value.status == 400 and e.value.param == "continue_final_message"


def test_returned_message_goes_back_as_is(smollm_engine):
    """A client that appends the returned assistant message (the official client sends its
    set fields: reasoning_content, refusal, annotations, ...) gets the next turn, and the
    reasoning reaches the template as reasoning_content (Qwen3's template renders it); vLLM's
    newer `reasoning` name too. A legacy function_call is refused."""
    from types import SimpleNamespace

    from pydantic import ValidationError

    from swaserve.server import protocol as P
    from swaserve.server.app import _render_chat

    template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}"
                "[{{ m.reasoning_content }}]{% endif %}{{ m.content }}{% endfor %}")
    state = SimpleNamespace(tokenizer=smollm_engine.tokenizer, chat_template=template,
                            model_name="m")
    for key in ("reasoning_content", "reasoning"):
        body = P.ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", key: "greet back", "refusal": None,
             "annotations": [], "audio": None, "function_call": None, "tool_calls": None},
            {"role": "user", "content": "And?"}]})  # fmt: skip
        assert _render_chat(state, body) == "<user>Hi<assistant>[greet back]Hello<user>And?"
    with pytest.raises(ValidationError):
        P.ChatCompletionRequest.model_validate({"messages": [
            {"role": "assistant", "content": None, "function_call": {"name": "f"}}]})


def test_top_logprobs_errors_name_top_logprobs():
    from swaserve.server import protocol as P

    body = P.ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50})
    with pytest.raises(ValueError, match=r"^top_logprobs must be in \[0, 20\], got 50"):
        body.sampling_params()
