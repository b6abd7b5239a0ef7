"""train-drafter's served-equivalent held-out acceptance (speculative/drafter_walk.py): the
greedy walk on hand-built drafts (full, partial and no acceptance, the sequence's end cutting
blocks short), how the every-position drafts are split into forwards, and, on a tiny target
with a briefly trained drafter, the walk's tokens and verify steps equal to what serving the
same prompts through the engine's DFlash path commits and verifies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from swaserve.ops.cpu_linear import dense_weight
from swaserve.speculative.dflash_config import dflash_config_from_dict
from swaserve.speculative.dflash_model import DFlashDrafter
from swaserve.speculative.drafter_features import SequenceSet, target_features
from swaserve.speculative.drafter_trainer import DrafterTrainer, TrainPlan
from swaserve.speculative.drafter_walk import (
    WalkTotals,
    answer_positions,
    greedy_walk,
    plan_forwards,
    prefix_within,
    walk_sequences,
)
from swaserve.speculative.train_drafter import drafter_config, save_drafter
from tests.helpers import save_random_hf_model

TOKENS = list(range(100, 112))  # n = 12
WRONG = [0, 0, 0]


def right(c: int) -> list[int]:
    """K = 3 correct drafts from position c (past the end: padding, as the trainer's)."""
    return (TOKENS[c + 1 : c + 4] + WRONG)[:3]


def test_walk_accepts_every_draft():
    p = 2
    drafts = [right(c) for c in range(p, 10)]
    # c=2: 3 drafts + bonus -> c=6: 3 + 1 -> c=10: k = min(3, 12 - 10 - 2) = 0: x_11 by decode
    assert greedy_walk(drafts, TOKENS, p, 3) == (8, 2)


def test_walk_accepts_no_draft():
    # one token a verify step from c=2 to c=9; x_11 by a plain decode
    assert greedy_walk([WRONG] * 8, TOKENS, 2, 3) == (8, 8)


def test_walk_accepts_part_of_a_block():
    p = 2
    drafts = [WRONG] * 8
    drafts[2 - p] = [103, 0, 105]  # c=2: one accepted (the third, right, is behind a miss)
    drafts[4 - p] = [105, 106, 0]  # c=4: two
    drafts[7 - p] = right(7)  # c=7: k = min(3, 12 - 7 - 2) = 3, all: commits x_8..x_11
    assert greedy_walk(drafts, TOKENS, p, 3) == (2 + 3 + 4, 3)


def test_walk_end_of_sequence_cuts_the_last_block_short():
    p = 4
    drafts = [right(c) for c in range(p, 10)]
    # c=4: 4 tokens -> c=8: k = min(3, 12 - 8 - 2) = 2 (the third draft, for x_11, right as
    # it is, is never proposed: max_tokens would be passed) -> 3 tokens -> c=11: done
    assert right(8) == [109, 110, 111]
    assert greedy_walk(drafts, TOKENS, p, 3) == (7, 2)
    # the same cut with larger K: K caps nothing, the end does
    assert greedy_walk([d + [0] * 4 for d in drafts], TOKENS, p, 7) == (7, 2)


def test_walk_with_no_verify_step():
    assert greedy_walk([], TOKENS, 10, 3) == (0, 0)  # x_10 by prefill, x_11 by decode
    assert WalkTotals(0, 0, 1).accept_length is None  # no made-up 1.0
    assert WalkTotals(9, 3, 1).accept_length == 3.0


def test_every_answer_position_is_drafted_once_within_the_forward_limits():
    lens, prompts = [12, 30, 4, 9], [2, 3, 2, 8]
    offsets = [0, 12, 42, 46, 55]
    data = SequenceSet(torch.zeros(55, dtype=torch.int64), torch.zeros(55, 1), offsets, prompts)
    assert [list(answer_positions(p, n)) for p, n in zip(prompts, lens)][2:] == [[], []]
    for max_blocks, max_seqs in ((1000, 8), (7, 8), (7, 1), (1, 2)):
        plan = plan_forwards(data, range(4), max_blocks, max_seqs)
        for fwd in plan:
            assert sum(len(r) for _, r in fwd) <= max_blocks and len(fwd) <= max_seqs
            assert len({i for i, _ in fwd}) == len(fwd)  # a sequence once a forward
        for i, (p, n) in enumerate(zip(prompts, lens)):
            got = [c for fwd in plan for j, r in fwd if j == i for c in r]
            assert got == list(range(p, n - 2))
    assert prefix_within(data, range(4), 33) == [0, 1, 2, 3]  # 8 + 25 + 0 + 0 positions
    assert prefix_within(data, range(4), 32) == [0]
    assert prefix_within(data, [1, 2, 3], 1) == [1]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """A tiny random Qwen3 with a small vocabulary: its greedy answers repeat themselves, so a
    drafter learns some of them in a few steps."""
    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("walk_target")
    save_random_hf_model(cfg, folder)
    return str(folder)


def test_heldout_accept_length_equals_served_acceptance(target, tmp_path):
    """The target's greedy answers to 8 prompts, the drafter trained 20 steps on them (a fresh
    one accepts nothing; whether they are held out does not matter to the equality), then the
    walk over them against the engine serving their prompts (DFlash, K = B - 1 = 3, every step
    drafting, greedy, float32) with max_tokens = the answer's length: the same answers, and
    the same tokens and verify steps, sequence by sequence."""
    engine = Engine(model=target, device="cpu", dtype="float32", kv_cache_gb=0.01)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 12, (8,), generator=gen)]
    outs = engine.generate(prompt_token_ids=prompts, use_tqdm=False,
                           sampling_params=SamplingParams(max_tokens=40, temperature=0))
    seqs = [(p + list(o.token_ids), len(p)) for p, o in zip(prompts, outs)]
    core = engine.core
    args = SimpleNamespace(target_layers=None, intermediate_size=None, num_layers=1, block_size=4)
    raw = drafter_config(core.hf_config, args, 511)
    cfg = dflash_config_from_dict(raw, core.hf_config, source="test")
    data = target_features(core, seqs, tuple(cfg.target_layer_ids))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    emb = dense_weight(core.model.model.embed_tokens).detach().float().clone()
    head = dense_weight(core.model.lm_head).detach().float().clone()
    plan = TrainPlan(steps=20, lr=3e-3, warmup_steps=4, batch_sequences=8,
                     micro_batch_sequences=8, anchors=16, loss_decay=4.0, eval_every=10)
    trainer = DrafterTrainer(drafter, emb, head, data, data, plan)
    trainer.run(lambda line: None)
    # the periodic evaluation walks the first sequences within 8 x 16 blocks (~35 each), the
    # final one all 8
    assert [r.heldout.sequences for r in trainer.rows if r.heldout] == [3, 8]
    final = trainer.rows[-1].heldout

    save_drafter(drafter, raw, tmp_path / "drafter", torch.float32)
    on = Engine(model=target, device="cpu", dtype="float32", kv_cache_gb=0.01,
                speculative_algorithm="dflash", speculative_draft_model=str(tmp_path / "drafter"),
                disable_adaptive_speculation=True)
    params = [SamplingParams(max_tokens=len(s) - p, temperature=0) for s, p in seqs]
    served = on.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [list(o.token_ids) for o in served] == [s[p:] for s, p in seqs]
    spec = [o.spec_decoding for o in served]
    want = [(m["spec_accepted_drafts"] + m["spec_verify_ct"], m["spec_verify_ct"]) for m in spec]
    # forwards of at most 7 blocks and 3 sequences: answers split across forwards
    got = [walk_sequences(drafter, emb, head, data, [i], 7, 3) for i in range(8)]
    assert [(w.committed, w.steps) for w in got] == want
    committed, steps = map(sum, zip(*want))
    assert committed > steps  # some drafts accepted, some not: a walk with both
    assert sum(m["spec_accepted_drafts"] for m in spec) < 3 * steps
    assert final.accept_length == committed / steps
