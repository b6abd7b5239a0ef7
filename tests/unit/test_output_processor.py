"""IncrementalDetokenizer and OutputProcessor on tiny hub-free tokenizers (CPU, fast)."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.engine.output_processor import (
    OutputProcessor,
    find_stop_string,
    make_core_request_ids,
)
from swaserve.outputs import EngineCoreOutput, Logprob, merge_deltas
from swaserve.sampling.params import SamplingParams

SPECIALS = ["<s>", "</s>", "<|im_end|>"]

# ---- tokenizers --------------------------------------------------------------------------


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama/Gemma-style: SentencePiece "▁" words, characters outside the vocab as <0xXX>."""
    vocab = {"<unk>": 0}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-\n▁é中"
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("S", "T"), ("ST", "O")]
    for c in chars:
        vocab.setdefault(c, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2-style byte-level BPE, trained here on a few lines."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog. STOP here", "héllo wörld 中文 😀"] * 8
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


BF = _byte_fallback_tokenizer()
BL = _byte_level_tokenizer()
TOKENIZERS = {"byte_fallback": BF, "byte_level": BL}


def _gpt2_byte_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_B2U = _gpt2_byte_to_unicode()


def byte_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per UTF-8 byte of `text` (multi-byte characters split across tokens)."""
    if tok is BF:
        return [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]
    return [tok.convert_tokens_to_ids(_B2U[b]) for b in text.encode()]


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def full_decode(tok: PreTrainedTokenizerFast, ids: list[int], skip_special: bool = True) -> str:
    return tok.backend_tokenizer.decode(ids, skip_special_tokens=skip_special)


# A piece of output: normal text, the same split into byte tokens, or a special token.
ALPHABET = "ab zé中😀ж€\n.!"
_piece = st.one_of(
    st.tuples(st.just("text"), st.text(ALPHABET, min_size=1, max_size=6)),
    st.tuples(st.just("bytes"), st.text(ALPHABET, min_size=1, max_size=3)),
    st.tuples(st.just("special"), st.sampled_from(SPECIALS)),
)


def _ids_from_pieces(tok: PreTrainedTokenizerFast, pieces: list[tuple[str, str]]) -> list[int]:
    ids: list[int] = []
    for kind, s in pieces:
        if kind == "text":
            ids += encode(tok, s)
        elif kind == "bytes":
            ids += byte_ids(tok, s)
        else:
            ids.append(tok.convert_tokens_to_ids(s))
    return ids


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Splits ids into steps of the given sizes (cycled), as a core with spec decoding would."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


# ---- detokenizer -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("skip_special", [True, False])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(_piece, max_size=4),
    pieces=st.lists(_piece, min_size=1, max_size=12),
    sizes=st.lists(st.integers(1, 4), max_size=5),
)
def test_deltas_concatenate_to_full_decode(name, skip_special, prompt, pieces, sizes):
    tok = TOKENIZERS[name]
    prompt_ids = _ids_from_pieces(tok, [p for p in prompt if p[0] != "bytes"])
    ids = _ids_from_pieces(tok, pieces)
    full = full_decode(tok, prompt_ids + ids, skip_special)
    prompt_text = full_decode(tok, prompt_ids, skip_special)
    assert "\ufffd" not in full and full.startswith(prompt_text)

    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special)
    deltas = [detok.add(chunk) for chunk in _chunks(ids, sizes)]
    deltas.append(detok.flush())
    assert not any("\ufffd" in d for d in deltas)
    # The prompt's context gives the first token its leading space: prompt + deltas = all.
    assert prompt_text + "".join(deltas) == full
    assert detok.text == "".join(deltas)
    if not prompt_ids:
        assert detok.text == full_decode(tok, ids, skip_special)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_multibyte_char_is_held_until_complete(name):
    tok = TOKENIZERS[name]
    detok = IncrementalDetokenizer(tok, encode(tok, "hi"))
    ids = byte_ids(tok, "😀")
    assert len(ids) == 4
    assert [detok.add([t]) for t in ids] == ["", "", "", "😀"]
    # An unfinished character at the end is only released by flush (at finish).
    assert detok.add(byte_ids(tok, "中")[:2]) == ""
    assert detok.flush().strip("\ufffd") == "" and detok.text.startswith("😀\ufffd")


def test_first_token_keeps_its_leading_space():
    # "▁world" alone decodes to "world" (SentencePiece strips the first space); after a
    # prompt it is " world".
    out = [BF.convert_tokens_to_ids(t) for t in ["▁w", "o", "r", "l", "d"]]
    assert BF.decode(out) == "world"
    detok = IncrementalDetokenizer(BF, encode(BF, "Hello"))
    assert detok.add(out[:1]) == " w"
    assert detok.add(out[1:]) == "orld"
    assert IncrementalDetokenizer(BF, []).add(out) == "world"


def test_long_sequence_window_stays_small():
    tok = BL
    detok = IncrementalDetokenizer(tok, [])
    ids = encode(tok, "the quick brown fox 中文 😀 " * 200)
    for t in ids:
        detok.add([t])
        # O(1) per token: the decode window never spans more than a few tokens.
        assert len(detok._ids) - detok._prefix_offset <= 8
    assert detok.text + detok.flush() == full_decode(tok, ids)


def test_spaces_between_special_tokens_off():
    ids = [BF.convert_tokens_to_ids(s) for s in ["<s>", "</s>"]] + encode(BF, "a")
    detok = IncrementalDetokenizer(BF, [], skip_special_tokens=False)
    assert detok.add(ids) + detok.flush() == full_decode(BF, ids, False)
    tight = IncrementalDetokenizer(
        BF, [], skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert tight.add(ids[:2]).replace(" ", "") == "<s></s>"
    assert "<s></s>" in tight.text


# ---- output processor helpers ------------------------------------------------------------


def sp(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def out(cid: str, ids: list[int], finish: str | None = None, stop_reason=None, **kw):
    return EngineCoreOutput(cid, list(ids), finish_reason=finish, stop_reason=stop_reason, **kw)


def run_steps(proc: OutputProcessor, steps: list[list[EngineCoreOutput]]):
    ros, aborts = [], []
    for step in steps:
        r, a = proc.process(step)
        ros += r
        aborts += a
    return ros, aborts


# ---- stop strings ------------------------------------------------------------------------


def test_find_stop_string_earliest_completion_wins():
    assert find_stop_string("xxabcd", 4, ["cd", "abc"], False) == ("abc", 2)
    assert find_stop_string("xxabcd", 4, ["cd", "abc"], True) == ("abc", 5)
    assert find_stop_string("xxabc", 4, ["c", "abc"], False) == ("abc", 2)  # same end: longer
    assert find_stop_string("abab", 3, ["ab"], False) == ("ab", 2)  # old text not re-searched
    assert find_stop_string("abab", 4, ["ab"], False) is None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(include):
    tok = BL
    ids = byte_ids(tok, "Hello world again")
    proc = OutputProcessor(tok)
    proc.add_request(
        "r", "p", encode(tok, "p"), sp(stop=["lo w"], include_stop_str_in_output=include), ["r"]
    )
    steps = [[out("r", ids[i : i + 2])] for i in range(0, len(ids), 2)]
    ros, aborts = run_steps(proc, steps)
    assert aborts == ["r"]
    final = ros[-1]
    assert final.finished and not proc.has_unfinished()
    co = final.outputs[0]
    assert co.text == ("Hello w" if include else "Hel")
    assert (co.finish_reason, co.stop_reason) == ("stop", "lo w")
    # Token ids up to and including the one that completed the stop string ("w", index 6).
    assert co.token_ids == ids[:7]
    # Later outputs for the aborted core request (already in flight) are ignored.
    assert proc.process([out("r", ids[7:8])]) == ([], [])


def test_stop_string_in_first_token():
    tok = BL
    first = encode(tok, "the")
    assert len(first) == 1
    proc = OutputProcessor(tok)
    proc.add_request("r", None, encode(tok, "a"), sp(stop=["he"]), ["r"])
    ros, aborts = proc.process([out("r", first + encode(tok, " fox"))])
    assert aborts == ["r"]
    (ro,) = ros
    assert ro.finished and ro.text == "t" and ro.token_ids == first
    assert ro.outputs[0].stop_reason == "he"


def test_stop_string_in_text_of_finishing_output_wins_without_abort():
    proc = OutputProcessor(BL)
    proc.add_request("r", None, [], sp(stop=["fox"]), ["r"])
    (ro,), aborts = proc.process([out("r", byte_ids(BL, "a fox!"), finish="length")])
    assert aborts == []  # the core already finished it
    co = ro.outputs[0]
    assert (co.text, co.finish_reason, co.stop_reason) == ("a ", "stop", "fox")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_hidden_unless_include(include):
    eos_like = BL.convert_tokens_to_ids("!")
    proc = OutputProcessor(BL)
    proc.add_request("r", None, [], sp(include_stop_str_in_output=include), ["r"])
    ids = encode(BL, "the dog") + [eos_like]
    (ro,), _ = proc.process([out("r", ids, finish="stop", stop_reason=eos_like)])
    assert ro.text == ("the dog!" if include else "the dog")
    assert ro.token_ids == ids
    assert (ro.outputs[0].finish_reason, ro.outputs[0].stop_reason) == ("stop", eos_like)


def test_min_tokens_ignores_early_stop_strings():
    ids = byte_ids(BL, "abab")
    proc = OutputProcessor(BL)
    proc.add_request("r", None, [], sp(stop=["ab"], min_tokens=2), ["r"])
    ros, aborts = run_steps(proc, [[out("r", [t])] for t in ids])
    assert aborts == ["r"] and ros[-1].text == "ab" and ros[-1].token_ids == ids


def test_stream_never_shows_text_a_stop_string_cuts():
    ids = byte_ids(BL, "one two STOP three")
    proc = OutputProcessor(BL)
    proc.add_request("r", None, [], sp(stop=["STOP", "zz"]), ["r"], stream=True)
    ros, _ = run_steps(proc, [[out("r", [t])] for t in ids])
    shown = "".join(ro.outputs[0].text for ro in ros)
    assert shown == "one two "
    assert ros[-1].finished and ros[-1].outputs[0].finish_reason == "stop"


# ---- n > 1, stream vs cumulative, abort --------------------------------------------------


def test_n2_children_map_to_indices_and_parent_waits_for_both():
    ids = make_core_request_ids("req", 2)
    assert ids == ["req-0", "req-1"] and make_core_request_ids("x", 1) == ["x"]
    proc = OutputProcessor(BF)
    proc.add_request("req", "hi", encode(BF, "hi"), sp(n=2, stop=["!"]), ids)
    a, b, bang = (BF.convert_tokens_to_ids(t) for t in ["▁the", "▁w", "!"])
    (ro,), _ = proc.process([out("req-1", [b]), out("req-0", [a])])
    assert [c.index for c in ro.outputs] == [0, 1] and not ro.finished
    assert [c.text for c in ro.outputs] == [" the", " w"]
    (ro,), aborts = proc.process([out("req-0", [bang])])
    assert aborts == ["req-0"] and not ro.finished and proc.has_unfinished()
    assert ro.outputs[0].finish_reason == "stop" and ro.outputs[1].finish_reason is None
    (ro,), aborts = proc.process([out("req-0", [a]), out("req-1", [a], finish="length")])
    assert aborts == [] and ro.finished and not proc.has_unfinished()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in ro.outputs] == [
        (0, " the", [a, bang], "stop"),
        (1, " w the", [b, a], "length"),
    ]


def test_abort_returns_unfinished_core_ids():
    proc = OutputProcessor(BF)
    proc.add_request("r", None, [], sp(n=3), make_core_request_ids("r", 3))
    proc.process([out("r-1", [5], finish="length")])
    assert proc.abort_request("r") == ["r-0", "r-2"]
    assert not proc.has_unfinished() and proc.abort_request("r") == []
    assert proc.process([out("r-0", [5])]) == ([], [])
    proc.add_request("r", None, [], sp(), ["r"])  # the id is free again


def test_duplicate_ids_rejected():
    proc = OutputProcessor(BF)
    proc.add_request("r", None, [], sp(), ["c"])
    with pytest.raises(ValueError):
        proc.add_request("r", None, [], sp(), ["d"])
    with pytest.raises(ValueError):
        proc.add_request("s", None, [], sp(), ["c"])


def _lp(t: int) -> Logprob:
    return Logprob(token_id=t, logprob=-float(t % 7), rank=1 + t % 3, top=[(t, -1.0)])


_gen = st.lists(st.one_of(_piece, st.just(("stopword", "STOP"))), min_size=1, max_size=10)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gens=st.lists(_gen, min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    stop=st.lists(st.sampled_from(["STOP", "中😀", "a b", "\n."]), max_size=2),
    include=st.booleans(),
    finish_len=st.booleans(),
)
def test_stream_deltas_concatenate_to_cumulative(name, gens, sizes, stop, include, finish_len):
    tok = TOKENIZERS[name]
    n = len(gens)
    core_ids = make_core_request_ids("r", n)
    params = sp(n=n, stop=stop, include_stop_str_in_output=include, logprobs=1)
    prompt = encode(tok, "Q:")
    procs = {mode: OutputProcessor(tok) for mode in ("stream", "cum", "final")}
    procs["stream3"] = OutputProcessor(tok, stream_interval=3)  # --stream-interval 3
    procs["stream"].add_request("r", "Q:", prompt, params, core_ids, stream=True)
    procs["stream3"].add_request("r", "Q:", prompt, params, core_ids, stream=True)
    procs["cum"].add_request("r", "Q:", prompt, params, core_ids)
    procs["final"].add_request("r", "Q:", prompt, params, core_ids, final_only=True)

    # Interleave the children's steps; a child's last step carries the core's finish.
    child_steps = [
        _chunks(_ids_from_pieces(tok, [(k if k != "stopword" else "text", s) for k, s in g]), sizes)
        for g in gens
    ]
    results = {m: [] for m in procs}
    aborted: set[str] = set()
    step = 0
    while any(step < len(cs) for cs in child_steps):
        batch = []
        for cid, cs in zip(core_ids, child_steps, strict=True):
            if step < len(cs) and cid not in aborted:
                last = step == len(cs) - 1
                finish = ("length" if finish_len else "abort") if last else None
                batch.append(out(cid, cs[step], finish, new_logprobs=[_lp(t) for t in cs[step]]))
        aborts = None
        for m, p in procs.items():
            ros, a = p.process(batch)
            results[m] += ros
            assert aborts is None or a == aborts
            aborts = a
        aborted |= set(aborts)
        step += 1
    for cid, cs in zip(core_ids, child_steps, strict=True):  # children that never produced a token
        if not cs:
            for m, p in procs.items():
                results[m] += p.process([out(cid, [], "length")])[0]

    for p in procs.values():
        assert not p.has_unfinished()
    cum = results["cum"]
    assert len(results["final"]) == 1 and results["final"][0] == cum[-1]
    final = cum[-1]
    assert final.finished and sum(ro.finished for ro in cum) == 1
    assert [c.index for c in final.outputs] == list(range(n))
    # Cumulative text only grows: nothing shown is ever taken back.
    for ro in cum:
        for c in ro.outputs:
            assert final.outputs[c.index].text.startswith(c.text)
            assert "\ufffd" not in c.text
    for mode in ("stream", "stream3"):
        stream = results[mode]
        assert stream[-1].finished and sum(ro.finished for ro in stream) == 1
        # the deltas merged as a stream that fell behind merges them (server/app.py)
        merged = functools.reduce(merge_deltas, stream)
        assert merged.finished and merged.outputs == final.outputs
        for i, fc in enumerate(final.outputs):
            parts = [c for ro in stream for c in ro.outputs if c.index == i]
            assert "".join(c.text for c in parts) == fc.text
            assert [t for c in parts for t in c.token_ids] == fc.token_ids
            assert [lp for c in parts for lp in c.logprobs] == fc.logprobs
            assert parts[-1].finish_reason == fc.finish_reason
            assert parts[-1].stop_reason == fc.stop_reason
            assert all(c.finish_reason is None for c in parts[:-1])
            if mode == "stream3":  # after the first, a delta waits for 3 tokens or the end
                assert all(len(c.token_ids) >= 3 for c in parts[1:-1]), parts
    for fc in final.outputs:
        assert [lp.token_id for lp in fc.logprobs] == fc.token_ids
        event(f"finish_reason={fc.finish_reason}")
        # A stop string ends the text (include) or is cut off; no other one got through.
        if fc.finish_reason == "stop":
            assert fc.stop_reason in stop
            assert fc.text.endswith(fc.stop_reason) == include
        before_stop = fc.text[:-1] if include and fc.finish_reason == "stop" else fc.text
        assert not any(s in before_stop for s in stop)


def test_logprobs_prompt_logprobs_and_cached_tokens_pass_through():
    plp = [None, _lp(3)]
    for stream in (False, True):
        proc = OutputProcessor(BL)
        proc.add_request("r", None, [1, 3], sp(logprobs=0, prompt_logprobs=0), ["r"], stream=stream)
        first = out("r", [5], new_logprobs=[_lp(5)], prompt_logprobs=plp, num_cached_tokens=2)
        (r1,), _ = proc.process([first])
        (r2,), _ = proc.process([out("r", [6], "length", new_logprobs=[_lp(6)])])
        assert r1.prompt_logprobs == plp and r1.num_cached_tokens == 2
        assert r2.num_cached_tokens == 2
        assert r2.prompt_logprobs == (None if stream else plp)  # a stream sends them once
        want = [_lp(6)] if stream else [_lp(5), _lp(6)]
        assert r2.outputs[0].logprobs == want
    proc = OutputProcessor(BL)
    proc.add_request("r", None, [], sp(), ["r"])
    (ro,), _ = proc.process([out("r", [5], "length", new_logprobs=[_lp(5)])])
    assert ro.outputs[0].logprobs is None


def test_unfinished_character_is_flushed_at_finish():
    part = byte_ids(BL, "中")[:2]
    for stream in (False, True):
        proc = OutputProcessor(BL)
        proc.add_request("r", None, [], sp(), ["r"], stream=stream)
        (r1,), _ = proc.process([out("r", encode(BL, "the") + part[:1])])
        assert r1.text == "the"
        (r2,), _ = proc.process([out("r", part[1:], "length")])
        assert r2.finished and r2.text.startswith("" if stream else "the")
        assert r2.text.endswith("\ufffd")


def test_detokenize_false_gives_ids_without_text():
    """detokenize=False (vLLM's): token ids and finish reasons pass through, no text is made,
    and stop strings (found in the text) are refused when the params are built."""
    proc = OutputProcessor(BL)
    ids = encode(BL, "the dog ran")
    proc.add_request("r", None, [], sp(detokenize=False), ["r"])
    ros, _ = run_steps(proc, [[out("r", ids[:2])], [out("r", ids[2:], finish="length")]])
    co = ros[-1].outputs[0]
    assert co.token_ids == ids and co.text == "" and co.finish_reason == "length"
    assert proc._requests == {}  # noqa: SLF001 - finished and forgotten
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["dog"], detokenize=False)
    assert SamplingParams.from_dict(sp(detokenize=False).to_dict()).detokenize is False
