"""train-drafter's served-equivalent held-out acceptance (speculative/drafter_walk.py): the
greedy walk on hand-built drafts (full, partial and no acceptance, the sequence's end cutting
blocks short), and how the every-position drafts are split into forwards."""

from __future__ import annotations

import torch

from swaserve.speculative.drafter_features import SequenceSet
from swaserve.speculative.drafter_walk import (
    WalkTotals,
    answer_positions,
    greedy_walk,
    plan_forwards,
    prefix_within,
)

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
