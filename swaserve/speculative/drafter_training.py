"""DFlash's training objective (the paper's, as SpecForge and NeMo implement it): random
anchors, one masked block per anchor, all blocks of a batch of sequences in one drafter forward.

For a sequence x_0..x_{L-1} with the target's features at every position, an anchor a gives
the block [x_a, mask x (B - 1)] at positions a..a+B-1, and row i (i >= 1) learns x_{a+i}:
exactly what serving asks of it (engine/speculation: committed up to a, x_a the last token).
All blocks of a batch share one forward (each sequence's context is its own rows, at its
own positions); block j's rows see

    context keys at positions < a_j          (the target's features, as in serving), of
                                              block j's own sequence only
    the rows of block j itself               (non-causal; a sliding drafter layer's own
                                              causal/window rule applies on top, by position)

and never another block. The loss is cross-entropy through the target's frozen head, row i
weighted by exp(-(i - 1) / decay): an early draft gates every later one, so it matters most.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from swaserve.speculative.dflash_model import DFlashDrafter


@dataclass
class Blocks:
    """Every block of a batch of sequences, flattened block-major (N blocks x B rows), and the
    context rows they read: T rows of a flat token/feature store (drafter_features.py)."""

    token_ids: Tensor  # [N * B]: x_a then mask ids
    positions: Tensor  # [N * B]: a .. a + B - 1, within the block's own sequence
    targets: Tensor  # [N * (B - 1)]: x_{a+1..a+B-1}
    weights: Tensor  # [N * (B - 1)]: the position decay, summing to N * sum_i w_i
    visible: Tensor  # [N * B, T + N * B] bool: the structural mask (docstring)
    ctx_rows: Tensor  # [T]: the context's rows in the store, sequence by sequence
    ctx_positions: Tensor  # [T]: their positions within their own sequences


def sample_anchors(lo: int, length: int, block: int, n: int, gen: torch.Generator) -> list[int]:
    """Up to n distinct anchors a in [max(lo, 1), length - block] (a block's targets lie inside
    the sequence; a >= 1 leaves context to attend to), sorted."""
    first, last = max(lo, 1), length - block
    if last < first:
        return []
    count = last - first + 1
    picks = torch.randperm(count, generator=gen)[:n] + first
    return sorted(picks.tolist())


def build_batch(
    tokens: Tensor,
    spans: Sequence[tuple[int, int]],
    anchors: Sequence[Sequence[int]],
    block: int,
    mask_id: int,
    decay: float,
) -> Blocks:
    """The blocks of several sequences for one drafter forward: sequence s is rows
    spans[s] = (offset, length) of the flat `tokens`, with blocks at anchors[s]. Its context
    rows are its whole span (keys past an anchor are masked), so a block sees exactly what
    it would in a batch of one: context before its anchor in its own sequence, its own rows."""
    dev = tokens.device
    lens = torch.tensor([n for _, n in spans], dtype=torch.int64)
    offs = torch.tensor([o for o, _ in spans], dtype=torch.int64)
    s_ctx = torch.repeat_interleave(torch.arange(len(spans)), lens)  # [T]: its sequence
    starts = torch.cumsum(lens, 0) - lens
    ctx_pos = torch.arange(int(lens.sum())) - starts[s_ctx]
    s_blk = torch.repeat_interleave(torch.arange(len(spans)),
                                    torch.tensor([len(a) for a in anchors], dtype=torch.int64))
    a = torch.tensor([x for seq in anchors for x in seq], dtype=torch.int64)  # [N]
    host = torch.stack([s_ctx, ctx_pos, ctx_pos + offs[s_ctx]])
    s_ctx, ctx_pos, ctx_rows = host.to(dev, non_blocking=True).unbind(0)
    blk = torch.stack([s_blk, a, a + offs[s_blk]]).to(dev, non_blocking=True)
    s_blk, a, row0 = blk.unbind(0)
    n = a.shape[0]
    steps = torch.arange(block, device=dev)
    ids = torch.full((n, block), mask_id, dtype=tokens.dtype, device=dev)
    ids[:, 0] = tokens[row0]
    targets = tokens[(row0[:, None] + steps[None, 1:]).reshape(-1)]
    w = torch.exp(-(steps[1:].float() - 1) / decay) if decay > 0 else torch.ones(block - 1)
    weights = w.to(dev).repeat(n)
    rows_block = torch.arange(n, device=dev).repeat_interleave(block)  # [N * B]
    ctx = (s_blk[rows_block][:, None] == s_ctx[None, :]) & (
        ctx_pos[None, :] < a[rows_block][:, None])  # [N * B, T]
    same = rows_block[:, None] == rows_block[None, :]  # [N * B, N * B]
    positions = (a[:, None] + steps[None, :]).reshape(-1)
    return Blocks(ids.reshape(-1), positions, targets, weights, torch.cat([ctx, same], dim=1),
                  ctx_rows, ctx_pos)


def build_blocks(
    tokens: Tensor, anchors: list[int], block: int, mask_id: int, decay: float
) -> Blocks:
    """The blocks of one sequence `tokens` (its context: all of it, rows 0..L-1)."""
    return build_batch(tokens, [(0, tokens.shape[0])], [anchors], block, mask_id, decay)


@dataclass
class StepResult:
    loss: Tensor  # weighted mean cross-entropy (differentiable)
    accuracy: Tensor  # argmax == target, all rows (a 0-dim tensor: no host sync)
    # mean over blocks of 1 + the leading correct rows: not served acceptance (a plain mean
    # over anchors, where serving divides tokens by verify steps: drafter_walk.py)
    mean_block_accept: Tensor
    num_blocks: int


def block_logits(
    drafter: DFlashDrafter,
    features: Tensor,  # [T, n_ids * hidden]: the target's, at the rows blocks.ctx_rows
    blocks: Blocks,
    embedding: Tensor,  # the target's [V, hidden] table (frozen)
    head: Tensor,  # the target's [V, hidden] head weight (frozen)
) -> Tensor:
    """Logits [N * (B - 1), V] (float32) of rows 1..B-1 of every block: the drafter's forward
    for training and for the held-out drafts alike."""
    ctx = drafter.project_context(features)
    kv = [drafter.context_kv(i, ctx, blocks.ctx_positions) for i in range(len(drafter.layers))]
    embeds = drafter.embed_block(blocks.token_ids, embedding)
    hidden = drafter.forward_block(embeds, blocks.positions, kv, blocks.visible)
    b = drafter.cfg.block_size
    rows = hidden.view(-1, b, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
    return drafter.compute_logits(rows, head).float()


def dflash_loss(
    drafter: DFlashDrafter,
    features: Tensor,  # [T, n_ids * hidden]: the target's, at the rows blocks.ctx_rows
    blocks: Blocks,
    embedding: Tensor,  # the target's [V, hidden] table (frozen)
    head: Tensor,  # the target's [V, hidden] head weight (frozen)
) -> StepResult:
    b = drafter.cfg.block_size
    logits = block_logits(drafter, features, blocks, embedding, head)
    ce = F.cross_entropy(logits, blocks.targets, reduction="none")
    loss = (ce * blocks.weights).sum() / blocks.weights.sum()
    with torch.no_grad():
        right = (logits.argmax(-1) == blocks.targets).view(-1, b - 1)
        lead = torch.cumprod(right.int(), dim=1).sum(dim=1).float()
        accept = lead.mean() + 1.0
    return StepResult(loss, right.float().mean(), accept, right.shape[0])


def cosine_lr(step: int, total: int, peak: float, warmup: int, progress: float | None = None
              ) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0 at `progress` 1 (default:
    step / total; a time-boxed run passes the larger of that and its share of the time)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup) if progress is None else progress
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
