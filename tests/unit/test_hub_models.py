"""Models named by a Hugging Face Hub id: resolved through the Hub's own cache (offline here:
a snapshot laid out as huggingface_hub keeps it), loaded like any folder; without a cached copy
and no network, a clear error naming the model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from swaserve import Engine
from swaserve.weights.builtin import resolve_model
from swaserve.weights.hub import is_hub_id
from tests.helpers import engine_prompt_logits, save_random_hf_model

REPO = "tiny-org/tiny-qwen2"


def _fake_hub(root: Path) -> tuple[Path, object]:
    """huggingface_hub's cache layout (refs/main -> snapshots/<commit>) holding a tiny Qwen2."""
    commit = "0" * 40
    repo = root / "models--tiny-org--tiny-qwen2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    return snap, save_random_hf_model(cfg, snap)


def test_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_hub_id("Qwen/Qwen2.5-1.5B-Instruct") and is_hub_id(REPO)
    assert not is_hub_id("smollm2-135m-instruct") and not is_hub_id("a/b/c")
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("owner/name")  # a local folder of that name wins


def test_model_from_the_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    snap, ref = _fake_hub(tmp_path / "hub")
    # HF_HUB_CACHE and HF_HUB_OFFLINE=1, as huggingface_hub read them at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model(REPO) == snap
    engine = Engine(model=REPO, device="cpu", dtype="float32", kv_cache_gb=0.01)
    try:
        ids = list(range(3, 40))
        got = engine_prompt_logits(engine, ids)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        assert (got - want).abs().max().item() < 1e-4
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="'tiny-org/not-cached'.*Hugging Face cache"):
        resolve_model("tiny-org/not-cached")
