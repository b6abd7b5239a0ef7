"""`swaserve train-drafter` on CPU (issue 11): a few steps on a tiny target lower the loss; the
folder it writes loads in swaserve, in the `dflash` reference (`from_pretrained`, same
weights) and serves as `--speculative-draft-model`, losslessly; the CSV and PNG are there.
Also the objective's pieces: anchors, the block mask, the position decay."""

from __future__ import annotations

import csv
import shutil

import pytest
import torch
import transformers
from dflash.model import DFlashDraftModel

from swaserve import Engine, SamplingParams
from swaserve.cli import main as cli_main
from swaserve.speculative.dflash_model import load_dflash_drafter
from swaserve.speculative.drafter_training import build_blocks, sample_anchors
from swaserve.weights.builtin import resolve_model
from tests.helpers import save_random_hf_model


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """A tiny random Qwen3 with smollm2's tokenizer (train-drafter prompts are text)."""
    tok_dir = resolve_model("smollm2-135m-instruct")
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("train_target")
    save_random_hf_model(cfg, folder)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "vocab.json":
            shutil.copy(f, folder / f.name)
    return str(folder)


def test_train_drafter_lowers_loss_and_writes_a_loadable_drafter(target, tmp_path):
    out = tmp_path / "drafter"
    rc = cli_main([
        "train-drafter", "--target", target, "--out", str(out), "--device", "cpu",
        "--num-prompts", "6", "--max-new-tokens", "40", "--steps", "40", "--warmup-steps", "4",
        "--lr", "3e-3", "--anchors", "8", "--block-size", "4", "--kv-cache-gb", "0.01",
        "--save-dtype", "float32",
    ])
    assert rc == 0
    with open(out / "loss.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) >= 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    target_cfg = transformers.AutoConfig.from_pretrained(target)
    ours = load_dflash_drafter(out, target_cfg, "cpu", torch.float32)
    ref = DFlashDraftModel.from_pretrained(str(out)).eval()
    assert ref.block_size == ours.cfg.block_size == 4
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p, theirs[name]), name

    # and it serves: lossless against speculation off
    prompts = [[5, 6, 7, 8, 9, 10], [100, 200, 300]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    off = Engine(model=target, device="cpu", dtype="float32", kv_cache_gb=0.01)
    on = Engine(model=target, device="cpu", dtype="float32", kv_cache_gb=0.01,
                speculative_algorithm="dflash", speculative_draft_model=str(out))
    want = [o.token_ids for o in off.generate(prompt_token_ids=prompts, sampling_params=params)]
    got = on.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in got] == want
    assert all(o.spec_decoding["spec_verify_ct"] > 0 for o in got)


def test_blocks_see_their_context_and_their_own_rows_only():
    tokens = torch.arange(100, 120)
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(5, len(tokens), 4, 3, gen)
    assert len(anchors) == 3 and all(5 <= a <= 16 for a in anchors)
    assert sample_anchors(18, len(tokens), 4, 3, gen) == []  # no room for a block
    b = build_blocks(tokens, anchors, 4, mask_id=7, decay=2.0)
    assert b.token_ids.view(3, 4)[:, 0].tolist() == [100 + a for a in anchors]
    assert (b.token_ids.view(3, 4)[:, 1:] == 7).all()
    assert b.targets.view(3, 3).tolist() == [[100 + a + i for i in (1, 2, 3)] for a in anchors]
    assert b.weights[:3].tolist() == pytest.approx([1.0, 0.6065307, 0.3678794])
    for j, a in enumerate(anchors):
        for i in range(4):
            row = b.visible[4 * j + i]
            assert row[:20].tolist() == [k < a for k in range(20)]  # context before a_j
            assert row[20:].tolist() == [r // 4 == j for r in range(12)]  # its own block
