"""`swaserve train-drafter` on CPU (issue 11): a few steps on a tiny target lower the loss; the
folder it writes loads in swaserve, in the `dflash` reference (`from_pretrained`, same
weights) and serves as `--speculative-draft-model`, losslessly; the CSV (with the held-out
evaluations: served-equivalent acceptance and mean block accept) and PNG are there, and the
last line printed is the final acceptance. Also the pieces: anchors, the block mask, the
position decay, several sequences in one drafter forward equal to each alone, batched target
features equal to per-sequence ones (and to Hugging Face's), the held-out split, parsing the
target's lists of users' messages."""

from __future__ import annotations

import csv
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from dflash.model import DFlashDraftModel

from swaserve import Engine, SamplingParams
from swaserve.cli import main as cli_main
from swaserve.speculative import drafter_data
from swaserve.speculative.dflash_config import dflash_config_from_dict
from swaserve.speculative.dflash_model import DFlashDrafter, load_dflash_drafter
from swaserve.speculative.drafter_data import answer, split_held_out
from swaserve.speculative.drafter_features import feature_batches, target_features
from swaserve.speculative.drafter_prompts import dedupe, parse_questions, question_requests
from swaserve.speculative.drafter_training import (
    build_batch,
    build_blocks,
    dflash_loss,
    sample_anchors,
)
from swaserve.speculative.train_drafter import drafter_config
from swaserve.weights.builtin import resolve_model
from tests.helpers import save_random_hf_model, tiny_gemma3_config


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


def test_train_drafter_lowers_loss_and_writes_a_loadable_drafter(target, tmp_path, capsys):
    out = tmp_path / "drafter"
    rc = cli_main([
        "train-drafter", "--target", target, "--out", str(out), "--device", "cpu",
        "--num-prompts", "8", "--question-max-tokens", "16", "--max-new-tokens", "40",
        "--steps", "40", "--warmup-steps", "4", "--lr", "3e-3", "--anchors", "8",
        "--block-size", "4", "--kv-cache-gb", "0.01", "--save-dtype", "float32",
        "--batch-sequences", "4", "--micro-batch-sequences", "2", "--eval-every", "10",
    ])
    assert rc == 0
    with open(out / "loss.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) >= 30
    held = [r for r in rows if r["heldout_loss"]]
    assert len(held) == 4  # steps 10, 20, 30, 40
    for r in held:
        assert 1.0 <= float(r["heldout_mean_block_accept"]) <= 4.0
        assert 1.0 <= float(r["heldout_accept_length"]) <= 4.0
    assert held[-1]["heldout_accept_sequences"] == "1"  # the final one: every held-out sequence
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    accept = float(held[-1]["heldout_accept_length"])
    assert last_line.startswith(f"train-drafter: held-out accept length {accept:.2f} "
                                "(served-equivalent, 1 sequences), mean block accept"), last_line
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


def test_generate_in_one_call_and_train_in_another(target, tmp_path, capsys):
    """--generate-only --save-sequences, twice with other seeds; then --sequences trains on
    both files (a sequence in both counts once); bad flag combinations and files are errors."""
    common = ["--target", target, "--device", "cpu", "--kv-cache-gb", "0.01",
              "--question-max-tokens", "16", "--max-new-tokens", "24"]
    files = [tmp_path / "a.npz", tmp_path / "b.npz"]
    for seed, f in zip((1, 2), files):
        assert cli_main(["train-drafter", *common, "--num-prompts", "6", "--seed", str(seed),
                         "--generate-only", "--save-sequences", str(f)]) == 0
    out = capsys.readouterr().out
    assert "saved 6 sequences" in out and not (tmp_path / "drafter").exists()
    drafter = tmp_path / "drafter"
    assert cli_main(["train-drafter", *common, "--out", str(drafter), "--steps", "4",
                     "--anchors", "4", "--block-size", "4", "--save-dtype", "float32",
                     "--sequences", str(files[0]), str(files[1]), str(files[0])]) == 0
    out = capsys.readouterr().out
    assert "loaded 12 sequences" in out and "0 of 6 sequences new" in out
    assert (drafter / "model.safetensors").exists() and (drafter / "loss.csv").exists()
    # errors: a flag combination that makes no sense, a file that is not one, foreign ids
    assert cli_main(["train-drafter", *common, "--generate-only"]) == 2
    assert cli_main(["train-drafter", *common, "--num-prompts", "2"]) == 2  # no --out
    (tmp_path / "bad.npz").write_bytes(b"not a file of sequences")
    assert cli_main(["train-drafter", *common, "--out", str(drafter),
                     "--sequences", str(tmp_path / "bad.npz")]) == 2
    from swaserve.speculative.sequence_file import save_sequences

    save_sequences(tmp_path / "big.npz", [([1, 2, 10**7], 1)], {"target": "other"})
    assert cli_main(["train-drafter", *common, "--out", str(drafter),
                     "--sequences", str(tmp_path / "big.npz")]) == 2
    err = capsys.readouterr().err
    assert "--generate-only needs --save-sequences" in err and "--out DIR is needed" in err
    assert "not a train-drafter sequence file" in err and "outside the target's vocab" in err


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


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny random Gemma 3 (sliding layers of window 24, one full) as a CPU float32 engine,
    and its Hugging Face model."""
    folder = tmp_path_factory.mktemp("gemma_target")
    hf = save_random_hf_model(tiny_gemma3_config(), folder)
    return Engine(model=str(folder), device="cpu", dtype="float32", kv_cache_gb=0.01), hf


def test_batched_target_features_equal_one_sequence_at_a_time(gemma):
    engine, hf = gemma
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(3, 256, (n,), generator=gen).tolist(), 2) for n in (5, 61, 30, 17)]
    layers = (0, 2)  # a sliding layer and the last (final-normed) one
    assert [list(b) for b in feature_batches([5, 61, 30, 17], 70)] == [[0, 1], [2, 3]]
    for budget in (10_000, 70):  # all in one forward; two forwards
        batched = target_features(engine.core, seqs, layers, max_batch_tokens=budget)
        assert batched.features.dtype == torch.float32 and batched.offsets == [0, 5, 66, 96, 113]
        assert batched.prompt_lens == [2] * 4
        for i, (ids, _) in enumerate(seqs):
            alone = target_features(engine.core, [(ids, 2)], layers).features
            rows = slice(batched.offsets[i], batched.offsets[i + 1])
            torch.testing.assert_close(batched.features[rows], alone, atol=1e-5, rtol=1e-5)
            assert batched.tokens[rows].tolist() == ids
    ids = seqs[1][0]  # longer than the window: and equal to Hugging Face's hidden states
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[i + 1][0] for i in layers], dim=-1)
    got = target_features(engine.core, [(ids, 2)], layers).features
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_several_sequences_in_one_forward_equal_each_alone(target):
    """build_batch's mask keeps sequences apart: each block's logits and the loss equal those
    of its sequence's own forward."""
    hf = transformers.AutoConfig.from_pretrained(target)
    args = SimpleNamespace(target_layers=None, intermediate_size=None, num_layers=2,
                           block_size=4)
    cfg = dflash_config_from_dict(drafter_config(hf, args, 7), hf, source="test")
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.2)
    emb, head = torch.randn(hf.vocab_size, 32), torch.randn(hf.vocab_size, 32)
    lens, width = (20, 33, 12), len(cfg.target_layer_ids) * 32
    tokens = torch.randint(10, 1000, (sum(lens),))
    feats = torch.randn(sum(lens), width)
    offs, anchors = (0, 20, 53), ([1, 5, 16], [3, 4, 20, 29], [8])
    spans = list(zip(offs, lens))
    batch = build_batch(tokens, spans, anchors, 4, 7, 2.0)
    assert batch.ctx_rows.tolist() == list(range(sum(lens)))
    assert batch.ctx_positions.tolist() == [p for n in lens for p in range(n)]
    got = dflash_loss(drafter, feats[batch.ctx_rows], batch, emb, head)
    losses, n_blocks = [], 0
    for (o, n), a in zip(spans, anchors):
        one = build_blocks(tokens[o : o + n], a, 4, 7, 2.0)
        r = dflash_loss(drafter, feats[o : o + n], one, emb, head)
        losses.append(r.loss * r.num_blocks)
        n_blocks += r.num_blocks
    assert got.num_blocks == n_blocks == 8
    torch.testing.assert_close(got.loss, sum(losses) / n_blocks, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def small_engine(target) -> Engine:
    # max_num_seqs 2: seven prompts stream through, two at a time
    return Engine(model=target, device="cpu", dtype="float32", kv_cache_gb=0.01, max_num_seqs=2)


def _reference_answers(engine: Engine, prompts: list[list[int]], params) -> list[list[int]]:
    return [o.outputs[0].token_ids
            for o in engine.generate(prompt_token_ids=prompts, sampling_params=params)]


def _assert_idle(engine: Engine) -> None:
    core = engine.core
    assert not core.has_unfinished() and not core.has_in_flight() and not core.requests
    core.memory.check_integrity()


def test_answers_stream_through_the_engine_in_prompt_order(small_engine):
    """Prompts added as others finish (in bursts, never more than max_num_seqs in the engine)
    give each prompt the answer `generate` gives it, in prompt order, and leave the engine
    idle."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 5000, (3 + 2 * i,), generator=gen).tolist() for i in range(7)]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, detokenize=False)
    want = _reference_answers(small_engine, prompts, params)
    core = small_engine.core
    add = core.add_request
    most = [0]

    def counting_add(*a, **k):
        add(*a, **k)
        most[0] = max(most[0], len(core.requests))

    core.add_request = counting_add
    try:
        seqs = answer(small_engine, prompts, params)
    finally:
        core.add_request = add
    assert most[0] == 2  # max_num_seqs: nothing waits in the queue
    assert seqs == [(p + w, len(p)) for p, w in zip(prompts, want)]
    _assert_idle(small_engine)


def test_answers_cut_short_by_the_time_limit_keep_what_they_got(small_engine, monkeypatch):
    """When --max-generate-seconds runs out mid-way: nothing more is added, the running
    answers are aborted and kept (from MIN_PARTIAL_TOKENS) as prefixes of their full answers,
    queued prompts are dropped, and the engine is left idle."""
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(10, 5000, (4 + i,), generator=gen).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False)
    want = _reference_answers(small_engine, prompts, params)
    ticks = iter(range(10**6))  # a clock that moves one second per look
    monkeypatch.setattr(drafter_data, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    monkeypatch.setattr(drafter_data, "MIN_PARTIAL_TOKENS", 2)
    seqs = answer(small_engine, prompts, params, max_seconds=8)
    monkeypatch.undo()
    _assert_idle(small_engine)
    assert 0 < len(seqs) < len(prompts)
    lengths = []
    for seq, plen in seqs:
        i = next(j for j, p in enumerate(prompts) if len(p) == plen)
        assert seq[:plen] == prompts[i]
        got = seq[plen:]
        assert got == want[i][: len(got)] and len(got) >= 2
        lengths.append(len(got))
    assert min(lengths) < 12  # some answer was cut short and kept
    # the engine still answers in full afterwards
    assert _reference_answers(small_engine, prompts[:2], params) == want[:2]


def test_held_out_split_is_disjoint_and_covers_every_sequence():
    for n, k in ((1, 5), (2, 5), (9, 3), (100, 5), (100, 50), (5000, 256)):
        train, held = split_held_out(n, k, seed=3)
        assert not set(train) & set(held)
        assert sorted(train + held) == list(range(n))
        assert len(held) == (0 if n < 2 else min(k, max(1, n // 10)))
        assert split_held_out(n, k, seed=3) == (train, held)  # seeded
    # built-in prompts are deduplicated, so a held-out sequence's prompt is never trained on
    prompts = dedupe(["Why is the sky blue?", "why is the sky blue", "What is DNA?"])
    assert prompts == ["Why is the sky blue?", "What is DNA?"]


def test_users_messages_are_parsed_from_the_targets_lists():
    reply = " visit Japan?\n2. No, I'm not interested.\n3. What is sushi made of?\n\nThese are"
    assert parse_questions(reply, "Should I") == ["Should I visit Japan?",
                                                  "What is sushi made of?"]
    reply = ('Here are five:\n\n1. "What is the best way to send an email?"\n   This is about.'
             '\n2. **Write a poem about the sea.** - a request\n3. 🌟🌉🌊🌊🌊🌊\n4. Rome:')
    assert parse_questions(reply) == ["What is the best way to send an email?",
                                      "Write a poem about the sea."]
    reqs = question_requests(50, seed=1)
    assert reqs == question_requests(50, seed=1) and len({r.text for r in reqs}) > 40
    assert all(r.text.endswith("1. " + r.opener) for r in reqs if not r.chat)
