"""vLLM's bad_words: the token sequences spelling each word (with and without a leading
space), the sampler banning the token that would complete one, and greedy generation on the
real smollm2 engine that avoids a word it wrote before: a one-token word never appears, a
two-token word stops exactly where its second token would have come, and everything before is
unchanged."""

from __future__ import annotations

import pytest
import torch

from swaserve.sampling.bad_words import banned_tokens, resolve_bad_words, word_token_ids
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.sampler import SamplingRow, SamplingTensors, apply_penalties


def test_banned_tokens():
    words = [[5], [7, 8], [1, 2, 3]]
    assert banned_tokens(words, []) == {5}
    assert banned_tokens(words, [9, 7]) == {5, 8}
    assert banned_tokens(words, [1, 2]) == {5, 3}
    assert banned_tokens(words, [2, 1]) == {5}


@pytest.mark.parametrize("bad", [[""], ["  "], "word", [3]])
def test_bad_words_must_be_words(bad):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=bad)


def test_sampler_bans_the_completing_token():
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[4], [2, 3]])
    rows = [SamplingRow(p, None, [0], [1, 2]), SamplingRow(p, None, [0], [2, 1])]
    t = SamplingTensors.from_rows(rows, 6, "cpu")
    logits = torch.zeros(2, 6)
    apply_penalties(logits, t)
    assert logits[0].isinf().nonzero().flatten().tolist() == [3, 4]
    assert logits[1].isinf().nonzero().flatten().tolist() == [4]


def test_word_token_ids_and_resolve(smollm_engine):
    tok = smollm_engine.tokenizer
    ids = word_token_ids(["Paris"], tok)
    assert tok.encode("Paris", add_special_tokens=False) in ids
    assert tok.encode(" Paris", add_special_tokens=False) in ids
    p = resolve_bad_words(SamplingParams(bad_words=["Paris"]), tok)
    assert p.bad_words_token_ids == ids and p.edits_logits
    with pytest.raises(ValueError, match="tokenizer"):
        resolve_bad_words(SamplingParams(bad_words=["Paris"]), None)


def test_generation_avoids_the_words(smollm_engine):
    eng, tok = smollm_engine, smollm_engine.tokenizer
    prompt = "Write about the Mississippi river and Massachusetts:"
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = eng.generate(prompt, SamplingParams(**greedy))[0].outputs[0].token_ids
    # a two-token phrase the answer wrote (" River is", " a vital", ...), from its 2nd token
    i = next(i for i in range(1, len(ref) - 1) if tok.decode([ref[i]]).startswith(" ")
             and [ref[i], ref[i + 1]] in word_token_ids([tok.decode(ref[i:i + 2])], tok))
    word = tok.decode(ref[i:i + 2]).strip()
    out = eng.generate(prompt, SamplingParams(bad_words=[word], **greedy))[0].outputs[0]
    assert out.token_ids[: i + 1] == ref[: i + 1]  # the word's first token is still allowed
    assert out.token_ids[i + 1] != ref[i + 1]  # its second is not
    for w in word_token_ids([word], tok):
        n = len(w)
        assert all(out.token_ids[j:j + n] != w for j in range(len(out.token_ids)))
    one = next(w for w in (tok.decode([t]).strip() for t in ref) if w.isalpha())
    # a one-token word: never written
    out = eng.generate(prompt, SamplingParams(bad_words=[one], **greedy))[0].outputs[0]
    banned = {w[0] for w in word_token_ids([one], tok) if len(w) == 1}
    assert banned and not banned & set(out.token_ids)


def test_unsatisfiable_masks_are_refused(smollm_engine):
    """Rules that leave no token at some step are refused when the request is added (a 400
    through the server), not sampled from a row of -inf: min_tokens with allowed_token_ids
    that all end the request, and bad words banning every allowed token."""
    from swaserve.engine.limits import PromptError, check_satisfiable

    eos = smollm_engine.core.eos_token_ids
    with pytest.raises(ValueError, match="min_tokens 2 cannot be met"):
        smollm_engine.generate("Hi", SamplingParams(allowed_token_ids=list(eos), min_tokens=2))
    check_satisfiable(SamplingParams(allowed_token_ids=list(eos), min_tokens=2,
                                     ignore_eos=True), eos)  # fmt: skip
    check_satisfiable(SamplingParams(allowed_token_ids=[5, 6], min_tokens=2,
                                     stop_token_ids=[5]), eos)  # fmt: skip
    with pytest.raises(PromptError, match="min_tokens") as e:
        check_satisfiable(SamplingParams(allowed_token_ids=[5, 6], min_tokens=1,
                                         stop_token_ids=[5, 6]), eos)  # fmt: skip
    assert e.value.param == "min_tokens"
    with pytest.raises(PromptError, match="bad_words ban every one"):
        check_satisfiable(SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[5]]), eos)


def test_min_tokens_lets_a_complete_grammar_end():
    """A grammar whose mask allows only an end token (it is complete) keeps that token under
    min_tokens (no row of -inf); one that allows more still has the end tokens banned."""
    from swaserve.sampling.sampler import _allows_other

    V, eos = 70, 2
    only_end = torch.zeros(3, dtype=torch.int32)
    only_end[0] = 1 << eos
    more = only_end.clone()
    more[1] = 1 << (40 - 32)
    top = torch.zeros(3, dtype=torch.int32)
    top[1] = torch.tensor([-(2**31)], dtype=torch.int32)  # token 63: bit 31, the sign bit
    assert not _allows_other(only_end, {eos}) and _allows_other(more, {eos})
    assert _allows_other(top, {eos}) and not _allows_other(top, {63})
    p = SamplingParams(temperature=0.0, min_tokens=3)
    rows = [SamplingRow(p, None, [0], [1], only_end), SamplingRow(p, None, [0], [1], more)]
    t = SamplingTensors.from_rows(rows, V, "cpu", eos_token_ids=[eos])
    logits = torch.zeros(2, V)
    apply_penalties(logits, t)
    assert logits[0].isfinite().nonzero().flatten().tolist() == [eos]  # the grammar's end
    assert logits[1, eos].item() == float("-inf")
