"""Structured outputs after a reasoning block (sampling/reasoning_gate.py): the grammar holds
the answer, not the reasoning, as vLLM's does with a reasoning parser.

smollm2 does not think, so the markers here are tokens it writes anyway: greedy decoding of a
prompt gives t0, t1, ...; "open" is t0 and "close" a later token, first seen at position k.
A gated request must then output t0..tk unconstrained (the same prefix as without a grammar)
and keep to the grammar after tk."""

from __future__ import annotations

import pytest
import torch

from swaserve import Engine, SamplingParams
from swaserve.sampling.reasoning_gate import ReasoningGate
from swaserve.server.reasoning import DeepSeekR1Parser, Qwen3Parser, grammar_markers

COLOURS = {"choice": ["red", "green", "blue"]}
ASK = "Tell me about the sea."


def _plain(engine: Engine, prompt: list[int], n: int = 24) -> list[int]:
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return engine.generate(prompt_token_ids=[prompt], sampling_params=p,
                           use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip


def _close_at(tokens: list[int], first: int, min_k: int) -> int:
    """The first position k >= min_k whose token is new since `first` (and is not t0)."""
    for k in range(max(min_k, first + 1), len(tokens)):
        if tokens[k] not in tokens[first:k] and tokens[k] != tokens[0]:
            return k
    raise AssertionError(f"no fresh token in {tokens}")


def _prompt(engine: Engine, text: str = ASK) -> list[int]:
    return engine.tokenizer.encode(engine.apply_chat_template([{"role": "user", "content": text}]),
                                   add_special_tokens=False)  # fmt: skip


def _gated(engine, prompt, markers, started=False, **kw):
    p = SamplingParams(max_tokens=40, temperature=0, structured_outputs=COLOURS,
                       reasoning_markers=markers, reasoning_started=started, **kw)
    return engine.generate(prompt_token_ids=[prompt], sampling_params=p,
                           use_tqdm=False)[0].outputs[0]  # fmt: skip


def test_the_grammar_starts_after_the_block(smollm_engine):
    engine = smollm_engine
    prompt = _prompt(engine)
    t = _plain(engine, prompt)
    k = _close_at(t, 1, 3)
    out = _gated(engine, prompt, [t[0], t[k]])
    assert out.token_ids[: k + 1] == t[: k + 1], (out.token_ids, t)
    answer = engine.tokenizer.decode(out.token_ids[k + 1:], skip_special_tokens=True)
    assert answer in COLOURS["choice"] and out.finish_reason == "stop", out.token_ids
    # the prompt opened the block: the grammar waits for close from the first token
    k0 = _close_at(t, 0, 2)
    out = _gated(engine, prompt, [t[0] + 1, t[k0]], started=True)
    assert out.token_ids[: k0 + 1] == t[: k0 + 1]
    answer = engine.tokenizer.decode(out.token_ids[k0 + 1:], skip_special_tokens=True)
    assert answer in COLOURS["choice"]


def test_no_opening_token_means_the_grammar_from_the_start(smollm_engine):
    """A first token other than open: the whole output keeps to the grammar, the same tokens
    as a plain structured request, and open is allowed only as the first token."""
    engine = smollm_engine
    prompt = _prompt(engine, "Pick a colour.")
    plain = engine.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(max_tokens=40, temperature=0, structured_outputs=COLOURS),
        use_tqdm=False,
    )[0].outputs[0]
    t = _plain(engine, prompt)
    # open: a token the model would not write first, banned later by the grammar anyway
    not_first = next(x for x in range(1000, 2000) if x != t[0] and x not in plain.token_ids)
    out = _gated(engine, prompt, [not_first, not_first + 1])
    assert out.token_ids == plain.token_ids and out.text in COLOURS["choice"]
    # forced by a bias, open is taken as the first token: the reasoning runs unconstrained
    out = _gated(engine, prompt, [not_first, t[3]], logit_bias={not_first: 100})
    assert out.token_ids[0] == not_first


def test_drafts_stop_short_of_the_close_under_speculation(smollm_engine):
    """n-gram drafts on a repeating text, close the last token of the first draft block: the
    drafts stop short of it (else the row after close would sample without the grammar's
    mask), so the tokens equal speculation off; drafts were accepted before it."""
    text = "The cat sat on the mat. " * 6
    prompt = smollm_engine.tokenizer.encode(text)
    t = _plain(smollm_engine, prompt, 12)
    k = _close_at(t, 1, 5)
    assert k == 5, t  # the drafts after t1 ("The") are t2..t5, from the prompt
    want = _gated(smollm_engine, prompt, [t[0], t[k]])
    assert smollm_engine.tokenizer.decode(want.token_ids[k + 1:], skip_special_tokens=True) \
        in COLOURS["choice"]
    with Engine(model="smollm2-135m-instruct", device="cpu", kv_cache_gb=0.2,
                speculative_algorithm="ngram", speculative_num_draft_tokens=4,
                disable_adaptive_speculation=True) as spec:
        p = SamplingParams(max_tokens=40, temperature=0, structured_outputs=COLOURS,
                           reasoning_markers=[t[0], t[k]])  # fmt: skip
        got = spec.generate(prompt_token_ids=[prompt], sampling_params=p, use_tqdm=False)[0]
        spec.core.memory.check_integrity()
    assert got.outputs[0].token_ids == want.token_ids
    assert got.spec_decoding["spec_accepted_drafts"] > 0, got.spec_decoding


def test_open_bit_sets_in_the_sign_word():
    """allow_open on the first row only, bit 31 of an int32 word included."""
    masks = torch.zeros(2, 4, dtype=torch.int32)

    class R:
        output_token_ids: list[int] = []
        grammar = object()

    for token in (31, 33, 127):
        ReasoningGate([token, 5], started=False).allow_open(R(), masks)
    assert masks[0].tolist() == [-(2**31), 2, 0, -(2**31)] and masks[1].tolist() == [0] * 4
    R.output_token_ids = [7]  # past the first token: nothing more
    ReasoningGate([64, 5], started=False).allow_open(R(), masks)
    assert masks[0, 2] == 0


@pytest.mark.parametrize("bad", [[1], [3, 3], [1, -2], "ab", [1, 2.0]])
def test_markers_are_validated(bad):
    with pytest.raises(ValueError, match="reasoning_markers"):
        SamplingParams(reasoning_markers=bad)


def test_the_server_reads_the_markers_from_the_prompt(smollm_engine):
    """grammar_markers: single-token markers only; a prompt that closed the block (thinking
    off) means the grammar from the start, one that opened it (DeepSeek-R1) means started."""
    import copy

    tok = copy.deepcopy(smollm_engine.tokenizer)
    assert grammar_markers(Qwen3Parser(), "hi", tok) == (None, False)  # no single tokens
    tok.add_tokens(["<think>", "</think>"])
    ids = [tok.convert_tokens_to_ids(m) for m in ("<think>", "</think>")]
    assert grammar_markers(Qwen3Parser(), "<|im_start|>assistant\n", tok) == (ids, False)
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert grammar_markers(Qwen3Parser(), closed, tok) == (None, False)
    assert grammar_markers(Qwen3Parser(), "<|Assistant|><think>\n", tok) == (ids, True)
    assert grammar_markers(DeepSeekR1Parser(), "<|Assistant|>", tok) == (ids, True)
    # an earlier turn's block does not count: only the prompt's end does
    assert grammar_markers(Qwen3Parser(), "<think>a</think>b<|im_start|>assistant\n",
                           tok) == (ids, False)  # fmt: skip
