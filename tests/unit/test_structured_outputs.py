"""Structured outputs (sampling/structured.py): the spec's validation, the bitmask against
xgrammar's own, and the built-in chat model held to JSON schemas, any JSON, a regex, a choice
and an EBNF grammar: greedy tokens equal transformers' with xgrammar's mask applied by
xgrammar, every output replayed through a fresh matcher, seeded requests alike alone and in a
batch, and n-gram speculation beside them lossless. The server's side:
tests/e2e/test_server.py::test_response_format."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from swaserve import Engine, SamplingParams
from swaserve.sampling.structured import apply_token_bitmask, check_syntax, normalise

TIE = 1e-3
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"],
}  # fmt: skip
ASK = "Give me a JSON object describing a person named Ann who is 31."


def test_spec_is_validated():
    assert normalise({"json": PERSON}) == {"json": json.dumps(PERSON)}
    assert normalise({"json": '{"type": "object"}', "regex": None}) == {
        "json": '{"type": "object"}'}  # fmt: skip
    assert normalise({"choice": ["x", "y"]}) == {"choice": ["x", "y"]}
    assert normalise(None) is None
    for bad, what in [({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
                      ({"xml": "a"}, "one of"), ({"json": "{not json"}, "not valid JSON"),
                      ({"choice": []}, "non-empty list"), ({"regex": ""}, "non-empty string"),
                      ({"json_object": "yes"}, "must be true"), ("a+", "an object")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"structured_outputs.*{what}"):
            normalise(bad)
    for spec in ({"json": {"type": "nonsense"}}, {"regex": "("}, {"grammar": "root ::= "}):
        with pytest.raises(ValueError, match="structured_outputs .* cannot be used: "):
            check_syntax(normalise(spec))
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": 3})


def test_nesting_is_bounded():
    """A schema nested past MAX_JSON_DEPTH is refused before xgrammar sees it (its compile time
    grows steeply with depth), as a dict, as JSON text past Python's recursion limit, and
    inside a structural tag."""
    from swaserve.sampling.structured import MAX_JSON_DEPTH, json_depth

    def nested(n: int) -> dict:
        s: dict = {"type": "integer"}
        for _ in range(n):
            s = {"type": "array", "items": s}
        return s

    assert json_depth(nested(3)) == 4 and json_depth(5) == 0 and json_depth([[], {}]) == 2
    check_syntax(normalise({"json": nested(MAX_JSON_DEPTH - 1)}))
    for spec in ({"json": nested(MAX_JSON_DEPTH)}, {"json": nested(5000)},
                 {"json": "[" * 5000 + "]" * 5000},
                 {"structural_tag": {"format": nested(MAX_JSON_DEPTH)}}):  # fmt: skip
        with pytest.raises(ValueError, match=f"nests deeper than {MAX_JSON_DEPTH} levels"):
            normalise(spec)


def test_bitmask_equals_xgrammars():
    gen = torch.Generator().manual_seed(0)
    V = 1000  # not a multiple of 32
    logits = torch.randn(5, V, generator=gen)
    rows = torch.tensor([0, 2, 3])
    words = xgr.get_bitmask_shape(1, V)[1]
    bitmask = torch.randint(-(2**31), 2**31, (5, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)  # xgrammar: row i's mask for logits row i
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows.tolist())
    got = logits.clone()
    apply_token_bitmask(got, rows, bitmask[rows])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isinf(got[0]).sum() > 400 and not torch.isinf(got[1]).any()


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(
        engine.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
    )


def _replays(engine: Engine, spec: dict, tokens: list[int]) -> bool:
    """Every token accepted by a fresh matcher of the spec; True when it then is complete."""
    matcher = engine.core.grammars.matcher(normalise(spec))
    for t in tokens:
        assert matcher.accept_token(t), f"token {t} breaks {spec}"
    return matcher.is_terminated()


SPECS = [
    {"json": PERSON},
    {"json_object": True},
    {"regex": r"(\d{3})-(\d{4})"},
    {"choice": ["red", "green", "blue"]},
    {"grammar": 'root ::= "Answer: " ("yes" | "no") "."'},
]


def test_outputs_keep_to_the_grammar(smollm_engine):
    engine = smollm_engine
    prompts = [_ids(engine, ASK), _ids(engine, "Pick a colour."), _ids(engine, "Say hi.")]
    params = []
    for spec in SPECS:
        params.append(SamplingParams(max_tokens=48, temperature=0, structured_outputs=spec))
        params.append(SamplingParams(max_tokens=48, temperature=0.9, seed=5,
                                     structured_outputs=spec))  # fmt: skip
    params.append(SamplingParams(max_tokens=8, temperature=0))  # unconstrained beside them
    ids = [prompts[i % 3] for i in range(len(params))]
    outs = engine.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
    for p, o in zip(params, outs):
        c = o.outputs[0]
        if p.structured_outputs is None:
            continue
        done = _replays(engine, p.structured_outputs, c.token_ids)
        assert done == (c.finish_reason == "stop"), (p.structured_outputs, c.text)
        kind, value = next(iter(p.structured_outputs.items()))
        if kind == "json" and done:
            person = json.loads(c.text)
            assert isinstance(person["name"], str) and isinstance(person["age"], int)
            assert set(person["tags"]) <= {"a", "b"}
        elif kind == "json_object" and done:
            assert isinstance(json.loads(c.text), dict)
        elif kind == "choice":
            assert done and c.text in value
        elif kind == "grammar":
            assert done and c.text in ("Answer: yes.", "Answer: no.")
    first_json = outs[0].outputs[0]
    assert first_json.finish_reason == "stop" and json.loads(first_json.text)["age"] == 31
    # a seeded structured request gives the same tokens alone as in the batch above
    alone = engine.generate(prompt_token_ids=[ids[1]], sampling_params=params[1],
                            use_tqdm=False)  # fmt: skip
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


@torch.no_grad()
def _hf_masked_greedy(model, engine: Engine, prompt: list[int], spec: dict, n: int):
    """transformers' greedy tokens with xgrammar's mask applied by xgrammar; per step the
    masked logits (for the tie rule)."""
    from transformers import DynamicCache

    matcher = engine.core.grammars.matcher(normalise(spec))
    V = model.config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, V)
    cache = DynamicCache(config=model.config)
    inp = torch.tensor([prompt])
    tokens, steps = [], []
    for _ in range(n):
        logits = model(input_ids=inp, past_key_values=cache, use_cache=True).logits[:, -1]
        logits = logits.float().contiguous()
        matcher.fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        t = int(logits[0].argmax())
        tokens.append(t)
        steps.append(logits[0])
        assert matcher.accept_token(t)
        if matcher.is_terminated():
            break
        inp = torch.tensor([[t]])
    return tokens, steps


def test_greedy_equals_transformers_with_xgrammars_mask(smollm_engine):
    from transformers import AutoModelForCausalLM

    engine = smollm_engine
    ref = AutoModelForCausalLM.from_pretrained(
        str(engine.folder), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cases = [(ASK, {"json": PERSON}), ("Write a phone number.", {"regex": r"\d{3}-\d{4}"}),
             ("Is water wet?", SPECS[4])]  # fmt: skip
    for text, spec in cases:
        prompt = _ids(engine, text)
        want, logits = _hf_masked_greedy(ref, engine, prompt, spec, 40)
        got = engine.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            max_tokens=40, temperature=0, structured_outputs=spec), use_tqdm=False)
        got = got[0].outputs[0].token_ids
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                top2 = logits[i].topk(2).values
                assert float(top2[0] - top2[1]) < TIE, (spec, i, g, w)
                break
        else:
            assert got == want, spec


def test_drafts_stop_where_the_grammar_would_refuse_or_complete(smollm_engine):
    """valid_prefix cuts drafts before a token the grammar refuses and before the stop token
    that would complete it (a complete matcher has no mask for the row after); bitmasks then
    gives one mask per verify row and leaves the matcher where it was."""
    grammars = smollm_engine.core.grammars
    matcher = grammars.matcher(normalise({"regex": "ab"}))
    a, b = (smollm_engine.tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    eos = grammars.stop_token_ids[0]
    assert grammars.valid_prefix(matcher, [a, b, eos, a]) == [a, b]
    assert grammars.valid_prefix(matcher, [a, a]) == [a]
    masks = grammars.bitmasks(matcher, [a, b])
    assert masks.shape[0] == 3
    allowed = [{t for t in (a, b, eos) if masks[i, t // 32] >> (t % 32) & 1} for i in range(3)]
    assert allowed == [{a}, {b}, {eos}]
    assert matcher.accept_token(a) and not matcher.is_terminated()  # where it began


def test_compiled_grammars_are_a_bounded_lru(smollm_engine, monkeypatch):
    """The compiled grammars an engine keeps are bounded (least recently used dropped); one
    dropped is compiled again when asked for, and a cached one is the same object."""
    import swaserve.sampling.structured as structured

    monkeypatch.setattr(structured, "MAX_CACHED_GRAMMARS", 3)
    shared = smollm_engine.core.grammars  # a fresh cache: other tests filled the engine's
    grammars = structured.Grammars(shared._load_tokenizer, shared.vocab_size,
                                   shared.stop_token_ids)  # fmt: skip
    specs = [normalise({"regex": f"x{i}"}) for i in range(4)]
    first = [grammars.compile(s) for s in specs[:3]]
    assert grammars.compile(specs[0]) is first[0]  # specs[0] is now the most recent
    grammars.compile(specs[3])  # drops specs[1], the least recently used
    keys = [json.dumps(s, sort_keys=True) for s in specs]
    assert keys[1] not in grammars._compiled and len(grammars._compiled) == 3
    assert grammars.compile(specs[0]) is first[0]
    assert grammars.compile(specs[1]) is not first[1]  # compiled again


def test_ngram_speculation_with_structured_requests():
    """Structured requests draft too (n-gram), their drafts cut where the grammar refuses and
    each verify row masked for the drafts before it: greedy outputs equal speculation off
    beside an unstructured request; a seeded one keeps to the grammar and gives the same
    tokens alone as in the batch (rejection sampling draws differently from a plain step:
    equal in distribution, not token for token); all accepted drafts."""
    tags = {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 12}}}
    ask = "Give me a JSON object with a list of tags, alternating a and b."
    repeat = "one two three four five six seven eight " * 6
    kw = dict(model="smollm2-135m-instruct", device="cpu", kv_cache_gb=0.2)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=60, temperature=0, structured_outputs={"json": tags}),
              SamplingParams(max_tokens=60, temperature=0.7, seed=4,
                             structured_outputs={"json": tags})]  # fmt: skip
    with Engine(**kw) as off:
        prompts = [repeat, *[off.apply_chat_template([{"role": "user", "content": ask}])] * 2]
        want = off.generate(prompts, params, use_tqdm=False)
    with Engine(speculative_algorithm="ngram", disable_adaptive_speculation=True, **kw) as on:
        got = on.generate(prompts, params, use_tqdm=False)
        alone = on.generate(prompts[2:], params[2:], use_tqdm=False)
        assert _replays(on, params[2].structured_outputs, got[2].outputs[0].token_ids)
    assert [o.outputs[0].token_ids for o in got[:2]] == [o.outputs[0].token_ids for o in want[:2]]
    assert alone[0].outputs[0].token_ids == got[2].outputs[0].token_ids
    assert all(o.spec_decoding["spec_accepted_drafts"] > 0 for o in got), [
        o.spec_decoding for o in got]
    assert json.loads(got[1].outputs[0].text)["tags"]


def test_a_bad_grammar_is_refused_before_anything_is_added(smollm_engine):
    engine = smollm_engine
    with pytest.raises(ValueError, match="structured_outputs regex cannot be used"):
        engine.generate(["hi", "there"], [SamplingParams(max_tokens=2),
                                          SamplingParams(structured_outputs={"regex": "("})])
    out = engine.generate(["hi"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# A structural tag: free text, and a <person> block once it is opened, in the new form and the
# legacy one (vLLM's and SGLang's `structures` and `triggers`).
PERSON_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<person>"],
    "tags": [{"type": "tag", "begin": "<person>", "end": "</person>",
              "content": {"type": "json_schema", "json_schema": PERSON}}]}}  # fmt: skip
PERSON_LEGACY = {"type": "structural_tag", "triggers": ["<person>"],
                 "structures": [{"begin": "<person>", "schema": PERSON, "end": "</person>"}]}


def test_structural_tag_spec_is_validated():
    """Both forms normalise to one value (xgrammar's form as JSON text), from a dict or its text
    and from response_format alike; a bad shape is refused by normalise, a bad format by
    check_syntax, each naming `structured_outputs structural_tag`."""
    from swaserve.server import protocol as P

    want = {"structural_tag": json.dumps(PERSON_TAG)}
    assert normalise({"structural_tag": PERSON_TAG}) == want
    assert normalise({"structural_tag": json.dumps(PERSON_TAG)}) == want
    assert normalise({"structural_tag": PERSON_LEGACY}) == want
    assert normalise({"structural_tag": {"format": PERSON_TAG["format"]}}) == want
    for body in (PERSON_TAG, PERSON_LEGACY):
        rf = P.ResponseFormat.model_validate(body)
        assert normalise(rf.structured_outputs()) == want
    with pytest.raises(ValueError, match="format is only for type structural_tag"):
        P.ResponseFormat.model_validate({"type": "json_object", "format": {}}).structured_outputs()
    what = "structured_outputs structural_tag"
    legacy = dict(PERSON_LEGACY)
    bad = [("{oops", "is not valid JSON"), (["x"], "must be an object"),
           ({"type": "json_schema", "format": {}}, 'type must be "structural_tag"'),
           ({"type": "structural_tag"}, 'takes "format"'),
           ({**PERSON_TAG, "triggers": ["<p"]}, 'takes "format"'),  # both forms at once
           ({"format": "const_string"}, "format must be an object"),
           ({**legacy, "triggers": []}, "triggers must be a non-empty list"),
           ({**legacy, "triggers": "<person>"}, "triggers must be a non-empty list"),
           ({**legacy, "structures": []}, "structures must be a non-empty list"),
           ({**legacy, "structures": [{"begin": "<p>", "schema": "x", "end": "</p>"}]},
            "structures must be"),
           ({**legacy, "structures": [{"begin": "<p>", "end": "</p>"}]}, "structures must be"),
           ]  # fmt: skip
    for value, says in bad:
        with pytest.raises(ValueError, match=f"{what} {says}"):
            normalise({"structural_tag": value})
    # a format xgrammar does not know; a tag that no trigger starts
    for value in ({"format": {"type": "nonsense"}}, {**legacy, "triggers": ["<other>"]}):
        with pytest.raises(ValueError, match=f"{what} cannot be used: "):
            check_syntax(normalise({"structural_tag": value}))


def test_structural_tag_holds_what_it_opens(smollm_engine):
    """The compiled tag lets free text through and holds an opened block to its schema; through
    the engine, a tag that is the whole output (`<person>` JSON `</person>`) is kept to."""
    engine = smollm_engine
    eos = engine.core.grammars.stop_token_ids[0]
    spec = normalise({"structural_tag": PERSON_LEGACY})

    def accepts(text: str) -> bool:
        matcher = engine.core.grammars.matcher(spec)
        return matcher.accept_string(text) and matcher.accept_token(eos) and (
            matcher.is_terminated())

    ann = '{"name": "Ann", "age": 31, "tags": ["a"]}'
    assert accepts(f"Here: <person>{ann}</person> and more text.")
    assert accepts("No person at all.")
    assert not accepts('Here: <person>{"name": "Ann", "age": "31", "tags": []}</person>')
    assert not accepts(f"Here: <person>{ann}")  # an opened block must close

    whole = {"structural_tag": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<person>", "end": "</person>",
        "content": {"type": "json_schema", "json_schema": PERSON}}}}  # fmt: skip
    params = SamplingParams(max_tokens=48, temperature=0, structured_outputs=whole)
    out = engine.generate(prompt_token_ids=[_ids(engine, ASK)], sampling_params=params,
                          use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and _replays(engine, whole, out.token_ids), out.text
    assert out.text.startswith("<person>") and out.text.endswith("</person>"), out.text
    person = json.loads(out.text.removeprefix("<person>").removesuffix("</person>"))
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
