"""`--help` of generate, serve and bench offline: every engine flag in its argument group, with
a one-line explanation, its default and its choices, all from one table beside EngineConfig
(`config.FLAGS`); a field added without an entry there fails here. A bad GGUF file is an
error naming the file."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from swaserve.cli import main
from swaserve.config import FLAGS, GROUPS, EngineConfig

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_every_field_has_help_a_group_and_checked_choices() -> None:
    assert set(FLAGS) == set(FIELDS), "every EngineConfig field needs a FLAGS entry (and back)"
    for name, info in FLAGS.items():
        assert info.group in GROUPS, name
        assert info.help and "\n" not in info.help and not info.help.endswith("."), name
        if FIELDS[name].default is None:  # None alone says nothing: --help tells what it means
            assert info.default, f"{name}: say what its default (None) means"
        for choice in info.choices or ():
            EngineConfig(**{name: choice})  # every listed choice is accepted
        if info.choices:
            with pytest.raises(ValueError, match=rf"^invalid {_flag(name)} 'bogus' .*must be"):
                EngineConfig(**{name: "bogus"})


def _help_sections(argv: list[str], capsys: pytest.CaptureFixture) -> dict[str, dict[str, str]]:
    """{group title: {flag: its whole help entry}} from `swaserve ARGV --help`."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    sections: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        lines = block.splitlines()
        if not lines or not lines[0].endswith(":") or lines[0].startswith(" "):
            continue
        entries: dict[str, str] = {}
        current = None
        for line in lines[1:]:
            m = re.match(r"^  (-[-\w]+)", line)
            if m:
                current = m.group(1)
                entries[current] = line
            elif current is not None:
                entries[current] += " " + line.strip()
        sections[lines[0][:-1]] = entries
    return sections


@pytest.mark.parametrize(
    "argv, own_group",
    [(["generate"], "generation"), (["chat"], "chat"), (["serve"], "server"),
     (["bench", "offline"], "benchmark")],
)
def test_help_lists_every_flag_in_its_group_with_default_and_choices(
    argv: list[str], own_group: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("SWASERVE_API_KEY", "sk-secret-never-shown")
    sections = _help_sections(argv, capsys)
    titles = [t for t in sections if t not in ("options", "positional arguments")]
    # the groups, in order, vLLM's flag names, then the command's own
    assert titles == [*GROUPS, "vLLM compatibility", own_group]
    for name, info in FLAGS.items():
        entry = sections[info.group].get(_flag(name))
        assert entry is not None, f"{_flag(name)} not under {info.group!r}"
        assert info.help in re.sub(r"(?<=-) ", "", entry), entry  # (unwrap "gpu-memory- util")
        assert "(default: " in entry, entry
        if info.choices:
            assert "{" + ",".join(info.choices) + "}" in entry, entry
    for entry in sections[own_group].values():
        assert "(default: " in entry, entry
    if own_group == "server":
        assert "--served-model-name" in sections["server"]
        assert "sk-secret" not in "".join(sections["server"].values())  # the key stays secret


def _bad_gguf_files(tmp_path: Path) -> list[Path]:
    from swaserve.weights.builtin import builtin_gguf

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 50)
    header_only = tmp_path / "header only.gguf"
    header_only.write_bytes(b"GGUF\x03\x00\x00\x00")
    truncated = tmp_path / "truncated.gguf"  # a real file cut inside its metadata
    with builtin_gguf("smollm2-135m-instruct").open("rb") as f:
        truncated.write_bytes(f.read(100_000))
    return [garbage, header_only, truncated]


def test_bad_gguf_error_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWASERVE_CACHE", str(tmp_path / "cache"))
    for path in _bad_gguf_files(tmp_path):
        assert main(["generate", "--model", str(path), "--device", "cpu", "--prompt", "hi"]) == 2
        # the one-time conversion's notice, then one line of error
        notice, *lines = capsys.readouterr().err.strip().splitlines()
        assert notice.startswith(f"swaserve: converting {path.name} into "), notice
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: not a readable GGUF"), lines
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]


def test_a_vllm_command_line_works(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`swaserve serve MODEL` with vLLM's common flags: the model as a positional argument,
    --enforce-eager, --no-enable-prefix-caching, --block-size, --kv-cache-dtype fp8 and the
    flags swaserve needs not, mapped to swaserve's own."""
    import swaserve.server.launch as launch

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda config, args: seen.update(config=config) or 0)
    assert main(["serve", "gemma-3-270m", "--enforce-eager", "--no-enable-prefix-caching",
                 "--block-size", "32", "--kv-cache-dtype", "fp8", "--trust-remote-code",
                 "--enable-chunked-prefill", "--disable-log-requests", "-tp", "1"]) == 0
    c = seen["config"]
    assert c.model == "gemma-3-270m" and c.page_size == 32 and c.kv_cache_dtype == "fp8_e4m3"
    assert c.cuda_graph_max_bs == 0 and c.piecewise_cuda_graph_max_tokens == 0
    assert c.disable_prefix_cache
    assert main(["serve", "--model", "gemma-3-270m", "--enable-prefix-caching"]) == 0
    assert seen["config"].model == "gemma-3-270m" and not seen["config"].disable_prefix_cache
    assert seen["config"].cuda_graph_max_bs is None  # the defaults, unless --enforce-eager
    assert main(["serve", "gemma-3-270m", "--model", "smollm2-135m"]) != 0
    assert "two models given" in capsys.readouterr().err
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    assert main(["serve", "--speculative-config", spec]) == 0
    c = seen["config"]
    assert (c.speculative_algorithm, c.speculative_num_draft_tokens, c.speculative_ngram_max) \
        == ("ngram", 3, 5)
    assert main(["serve", "--speculative-config", '{"method": "eagle"}']) != 0
    assert "speculative_algorithm" in capsys.readouterr().err  # the engine's check names it
    assert main(["serve", "--speculative-config", '{"draft_tensor_parallel_size": 1}']) != 0
    assert "unsupported key" in capsys.readouterr().err
