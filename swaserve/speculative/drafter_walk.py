"""Served-equivalent acceptance of a drafter on held-out sequences: serving's greedy walk,
replayed offline.

Serving (engine/speculation.py) drafts from the last committed position c: k = min(K,
max_tokens - outputs - 1) drafts d_1..d_k for positions c+1..c+k; the verify accepts the
longest prefix equal to the target's greedy tokens and commits it plus one token of the
target's own; the next draft starts from there. Its acceptance (`spec_accept_length`) is
committed tokens / verify steps. A held-out sequence x_0..x_{n-1} is a prompt x_0..x_{P-1}
and the target's own greedy answer, so serving its prompt with max_tokens = n - P commits
exactly x_P..x_{n-1}, and the walk needs nothing but the drafter's drafts:

    c = P                   x_P comes from the prefill, without drafts
    k = min(K, n - c - 2)   max_tokens - outputs - 1, outputs = c + 1 - P: the end of the
                            sequence cuts the last blocks short; k <= 0 (c = n - 2): x_{n-1}
                            comes from a plain decode step, which is no verify step
    m = leading i in 1..k with d_i == x_{c+i};  commit m + 1;  c += m + 1

A block at c reads x_c and the target's features before c only, never the walk's history, so
the drafts at every answer position (P..n-3) come from batched training forwards
(drafter_training.block_logits) before the walk. Measured on smollm2 (CPU float32): the walk
reproduced the served drafts and acceptance at every one of 6,247 verify steps.

Why not the mean block accept (the training objective's figure, mean over anchors of 1 +
leading correct drafts): a sequence where the target loops gets many anchors at acceptance ~B
but few verify steps, and anchors start at P - 1, a position serving never drafts from; it
read 0.2-0.35 above served acceptance on the same text (smollm2's shipped drafter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from swaserve.speculative.dflash_model import DFlashDrafter
from swaserve.speculative.drafter_features import SequenceSet
from swaserve.speculative.drafter_training import block_logits, build_batch


@dataclass
class WalkTotals:
    committed: int  # tokens committed by verify steps (accepted drafts + one each)
    steps: int  # verify steps
    sequences: int  # sequences walked

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify step, as `spec_accept_length`; None with no verify step (never a
        made-up 1.0)."""
        return self.committed / self.steps if self.steps else None


def greedy_walk(
    drafts: Sequence[Sequence[int]], tokens: Sequence[int], prompt_len: int, k: int
) -> tuple[int, int]:
    """(tokens committed by verify steps, verify steps) of serving `tokens[:prompt_len]` greedily
    up to the end of `tokens` with at most k drafts a step. drafts[j]: the drafter's drafts (at
    least k) from position prompt_len + j, for every position the walk can reach (..n-3)."""
    n, c = len(tokens), prompt_len
    committed = steps = 0
    while (kc := min(k, n - c - 2)) > 0:
        d = drafts[c - prompt_len]
        m = 0
        while m < kc and d[m] == tokens[c + 1 + m]:
            m += 1
        committed, steps, c = committed + m + 1, steps + 1, c + m + 1
    return committed, steps


def answer_positions(prompt_len: int, length: int) -> range:
    """Positions a verify step can start from: P..n-3 (a draft needs a token after it and the
    bonus's)."""
    return range(prompt_len, max(prompt_len, length - 2))


def prefix_within(data: SequenceSet, idx: Sequence[int], max_blocks: int) -> list[int]:
    """The first sequences of `idx` whose answer positions total at most `max_blocks` (the
    first one always, so an evaluation is never empty)."""
    out, total = [], 0
    for i in idx:
        total += len(answer_positions(data.prompt_lens[i], data.length(i)))
        if out and total > max_blocks:
            break
        out.append(i)
    return out


def plan_forwards(
    data: SequenceSet, idx: Sequence[int], max_blocks: int, max_sequences: int
) -> list[list[tuple[int, range]]]:
    """Every answer position of sequences `idx`, as forwards of (sequence, positions) pieces:
    at most `max_blocks` blocks and `max_sequences` sequences a forward; a long answer spans
    consecutive forwards (so a sequence is at most once in a forward)."""
    forwards: list[list[tuple[int, range]]] = []
    cur: list[tuple[int, range]] = []
    blocks = 0
    for i in idx:
        pos = answer_positions(data.prompt_lens[i], data.length(i))
        start = pos.start
        while start < pos.stop:
            if blocks == max_blocks or len(cur) == max_sequences:
                forwards.append(cur)
                cur, blocks = [], 0
            take = min(pos.stop - start, max_blocks - blocks)
            cur.append((i, range(start, start + take)))
            blocks, start = blocks + take, start + take
    if cur:
        forwards.append(cur)
    return forwards


@torch.no_grad()
def walk_sequences(
    drafter: DFlashDrafter,
    embedding: Tensor,
    head: Tensor,
    data: SequenceSet,
    idx: Sequence[int],
    max_blocks: int,
    max_sequences: int,
) -> WalkTotals:
    """The greedy walk (K = block_size - 1, serving's default) over sequences `idx` of `data`,
    drafts from forwards of at most `max_blocks` blocks and `max_sequences` sequences."""
    b = drafter.cfg.block_size
    # build_batch reads every block's targets x_{a+1..a+B-1}: past a sequence's end they are
    # the next sequence's tokens or this padding, and unused (the walk compares drafts with
    # the sequence's own tokens)
    tokens = torch.cat([data.tokens, data.tokens.new_zeros(b)])
    plan = plan_forwards(data, idx, max_blocks, max_sequences)
    out: list[Tensor] = []
    for fwd in plan:
        blocks = build_batch(tokens, [(data.offsets[i], data.length(i)) for i, _ in fwd],
                             [list(r) for _, r in fwd], b, drafter.cfg.mask_token_id, 0.0)
        feats = data.features[blocks.ctx_rows].float()
        logits = block_logits(drafter, feats, blocks, embedding, head)
        out.append(logits.view(-1, b - 1, logits.shape[-1]).argmax(-1))
    rows = torch.cat(out).tolist() if out else []  # one read-back for the whole evaluation
    drafts: dict[int, list[list[int]]] = {i: [] for i in idx}
    j = 0
    for fwd in plan:  # pieces of a sequence come in position order
        for i, r in fwd:
            drafts[i] += rows[j : j + len(r)]
            j += len(r)
    host = data.tokens.tolist()
    committed = steps = 0
    for i in idx:
        o, n = data.offsets[i], data.length(i)
        c, s = greedy_walk(drafts[i], host[o : o + n], data.prompt_lens[i], b - 1)
        committed, steps = committed + c, steps + s
    return WalkTotals(committed, steps, len(idx))
