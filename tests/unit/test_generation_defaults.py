"""The model's sampling defaults from its generation_config.json (vLLM's `--generation-config
auto`): read, overridden, checked at start, and applied to the fields a request leaves out, by
the server (protocol) and offline (Engine.default_sampling_params, the max_new_tokens cap)."""

from __future__ import annotations

import json

import pytest

from swaserve import Engine, SamplingParams
from swaserve.sampling.generation_defaults import generation_defaults, sampling_fields
from swaserve.server import protocol as P

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2,
         "max_new_tokens": 300}  # fmt: skip


def _folder(tmp_path, config: dict):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_read_override_and_off(tmp_path):
    folder = _folder(tmp_path, QWEN3)
    got = generation_defaults(folder)
    assert got == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 300}
    assert sampling_fields(got) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(folder, "vllm") == {} == generation_defaults(folder, "none")
    assert generation_defaults(None) == {}  # no folder: nothing to read
    # HF's names and SamplingParams' both, over the file's values
    assert generation_defaults(folder, override='{"temperature": 0.1, "max_tokens": 9}') == {
        "temperature": 0.1, "top_p": 0.95, "top_k": 20, "max_tokens": 9}
    assert generation_defaults(folder, "vllm", {"max_new_tokens": 4}) == {"max_tokens": 4}
    (tmp_path / "other").mkdir()
    other = _folder(tmp_path / "other", {"min_p": 0.1})
    assert generation_defaults(folder, str(other)) == {"min_p": 0.1}


@pytest.mark.parametrize("config, override, words", [
    ({"temperature": -1}, None, "generation_config.json: temperature"),
    ({}, '{"temprature": 1}', "unknown key"),
    ({}, "{nope", "not JSON"),
    ({}, "[1]", "JSON object"),
    ({}, {"top_p": 2}, "top_p"),
])  # fmt: skip
def test_bad_values_are_errors_naming_their_source(tmp_path, config, override, words):
    with pytest.raises(ValueError, match=words):
        generation_defaults(_folder(tmp_path, config), override=override)


def test_a_folder_without_the_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="--generation-config .* no generation_config.json"):
        generation_defaults(tmp_path, str(tmp_path / "missing"))


def test_requests_take_the_defaults_for_fields_they_leave_out():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    chat = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = chat.sampling_params(defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    mine = P.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                   temperature=0.0, top_k=None)  # fmt: skip
    p = mine.sampling_params(defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 0.95, 20)  # null: the default
    p = P.CompletionRequest(prompt="x", top_p=0.5).sampling_params(defaults)
    assert (p.temperature, p.top_p) == (0.6, 0.5)
    assert P.CompletionRequest(prompt="x").sampling_params().temperature == 1.0  # no defaults


def test_offline_defaults_and_the_max_new_tokens_cap():
    """The override reaches the offline Engine: default params greedy, and max_new_tokens caps
    a request without max_tokens (but not one that gives it)."""
    with Engine(model="smollm2-135m-instruct", device="cpu", kv_cache_gb=0.1,
                override_generation_config='{"temperature": 0, "max_new_tokens": 5}') as engine:
        assert engine.default_sampling_params().greedy
        prompt = "Write a long story about a dragon who"
        capped = engine.generate(prompt, use_tqdm=False)[0].outputs[0]
        explicit = engine.generate(prompt, SamplingParams(max_tokens=9, temperature=0,
                                                          ignore_eos=True), use_tqdm=False)
        assert len(capped.token_ids) == 5 and capped.finish_reason == "length"
        assert explicit[0].outputs[0].token_ids[:5] == capped.token_ids
        assert len(explicit[0].outputs[0].token_ids) == 9
