"""load_tokenizer loads a folder's tokenizer once per process (every Engine of the folder shares
it) and again once the folder's tokenizer files change."""

from __future__ import annotations

import json
import os
import shutil

from swaserve.engine.engine import load_tokenizer, resolve_folder


def test_one_load_per_folder_state(tmp_path):
    src = resolve_folder("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, tmp_path / name)
    first = load_tokenizer(tmp_path)
    assert first.chat_template
    assert load_tokenizer(tmp_path) is first
    assert load_tokenizer(tmp_path / ".." / tmp_path.name) is first  # the same folder

    (tmp_path / "chat_template.jinja").unlink()  # a file gone
    second = load_tokenizer(tmp_path)
    assert second is not first and not second.chat_template
    assert second.encode("hello world") == first.encode("hello world")

    cfg_path = tmp_path / "tokenizer_config.json"  # a file changed (even within a clock tick)
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = 77
    cfg_path.write_text(json.dumps(cfg))
    st = cfg_path.stat()
    os.utime(cfg_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    third = load_tokenizer(tmp_path)
    assert third is not second and third.model_max_length == 77


def test_no_tokenizer_files(tmp_path):
    assert load_tokenizer(tmp_path) is None
