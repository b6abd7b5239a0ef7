"""DFlash's training objective on one sequence (the paper's, as SpecForge and NeMo implement
it): random anchors, one masked block per anchor, all blocks in one drafter forward.

For a sequence x_0..x_{L-1} with the target's features at every position, an anchor a gives
the block [x_a, mask x (B - 1)] at positions a..a+B-1, and row i (i >= 1) learns x_{a+i}:
exactly what serving asks of it (engine/speculation: committed up to a, x_a the last token).
All blocks of a sequence share one forward; block j's rows see

    context keys at positions < a_j          (the target's features, as in serving)
    the rows of block j itself               (non-causal; a sliding drafter layer's own
                                              causal/window rule applies on top, by position)

and never another block. The loss is cross-entropy through the target's frozen head, row i
weighted by exp(-(i - 1) / decay): an early draft gates every later one, so it matters most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from swaserve.speculative.dflash_model import DFlashDrafter


@dataclass
class Blocks:
    """Every block of one sequence, flattened block-major (N blocks x B rows)."""

    token_ids: Tensor  # [N * B]: x_a then mask ids
    positions: Tensor  # [N * B]
    targets: Tensor  # [N * (B - 1)]: x_{a+1..a+B-1}
    weights: Tensor  # [N * (B - 1)]: the position decay, summing to N * sum_i w_i
    visible: Tensor  # [N * B, L + N * B] bool: the structural mask (docstring)


def sample_anchors(lo: int, length: int, block: int, n: int, gen: torch.Generator) -> list[int]:
    """Up to n distinct anchors a in [max(lo, 1), length - block] (a block's targets lie inside
    the sequence; a >= 1 leaves context to attend to), sorted."""
    first, last = max(lo, 1), length - block
    if last < first:
        return []
    count = last - first + 1
    picks = torch.randperm(count, generator=gen)[:n] + first
    return sorted(picks.tolist())


def build_blocks(
    tokens: Tensor, anchors: list[int], block: int, mask_id: int, decay: float
) -> Blocks:
    length, n, dev = tokens.shape[0], len(anchors), tokens.device
    a = torch.tensor(anchors, device=dev)
    offs = torch.arange(block, device=dev)
    positions = (a[:, None] + offs[None, :]).reshape(-1)
    ids = torch.full((n, block), mask_id, dtype=tokens.dtype, device=dev)
    ids[:, 0] = tokens[a]
    targets = tokens[(a[:, None] + offs[None, 1:]).reshape(-1)]
    w = torch.exp(-(offs[1:].float() - 1) / decay) if decay > 0 else torch.ones(block - 1)
    weights = w.to(dev).repeat(n)
    rows_block = torch.arange(n, device=dev).repeat_interleave(block)  # [N * B]
    ctx = torch.arange(length, device=dev)[None, :] < a[rows_block][:, None]  # [N*B, L]
    same = rows_block[:, None] == rows_block[None, :]  # [N*B, N*B]
    return Blocks(ids.reshape(-1), positions, targets, weights, torch.cat([ctx, same], dim=1))


@dataclass
class StepResult:
    loss: Tensor  # weighted mean cross-entropy (differentiable)
    accuracy: float  # argmax == target, all rows
    accept_length: float  # mean over blocks of 1 + the leading correct rows (greedy proxy)


def dflash_loss(
    drafter: DFlashDrafter,
    features: Tensor,  # [L, n_ids * hidden], the target's, at positions 0..L-1
    tokens: Tensor,  # [L]
    blocks: Blocks,
    embedding: Tensor,  # the target's [V, hidden] table (frozen)
    head: Tensor,  # the target's [V, hidden] head weight (frozen)
) -> StepResult:
    length = tokens.shape[0]
    ctx = drafter.project_context(features)
    positions = torch.arange(length, device=tokens.device)
    kv = [drafter.context_kv(i, ctx, positions) for i in range(len(drafter.layers))]
    embeds = drafter.embed_block(blocks.token_ids, embedding)
    hidden = drafter.forward_block(embeds, blocks.positions, kv, blocks.visible)
    b = drafter.cfg.block_size
    rows = hidden.view(-1, b, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
    logits = drafter.compute_logits(rows, head).float()
    ce = F.cross_entropy(logits, blocks.targets, reduction="none")
    loss = (ce * blocks.weights).sum() / blocks.weights.sum()
    with torch.no_grad():
        right = (logits.argmax(-1) == blocks.targets).view(-1, b - 1)
        lead = torch.cumprod(right.int(), dim=1).sum(dim=1).float()
        accept = float(lead.mean()) + 1.0
    return StepResult(loss, float(right.float().mean()), accept)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
