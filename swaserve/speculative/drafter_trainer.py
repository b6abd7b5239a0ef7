"""The optimisation loop of `swaserve train-drafter`: epochs over the training sequences, a
held-out evaluation every few steps, a time box.

    step      `batch_sequences` sequences (the next of a seeded shuffle of the training set,
              reshuffled each epoch), `anchors` blocks each, in forwards of
              `micro_batch_sequences` sequences (gradients accumulated, weighted by blocks);
              AdamW, gradient norm clipped to 1
    lr        linear warm-up, then cosine decay reaching 0 at the last step, or at
              `max_seconds` when that comes first (so a time-boxed run ends decayed)
    held-out  on sequences never trained on: the objective at fixed, seeded anchors (loss,
              accuracy, mean block accept = mean of 1 + leading correct drafts), and the
              served-equivalent acceptance, serving's greedy walk replayed (drafter_walk.py):
              tokens per verify step, what `spec_accept_length` reads when the held-out
              prompts are served. The mean block accept reads higher (drafter_walk.py says
              why); do not take it for acceptance.
    metrics   kept on the device and read back every `sync_every` steps (a read is a sync,
              and the host should run ahead of the GPU)
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from swaserve.speculative.dflash_model import DFlashDrafter
from swaserve.speculative.drafter_features import SequenceSet
from swaserve.speculative.drafter_training import (
    Blocks,
    StepResult,
    build_batch,
    cosine_lr,
    dflash_loss,
    sample_anchors,
)
from swaserve.speculative.drafter_walk import prefix_within, walk_sequences


@dataclass
class TrainPlan:
    steps: int
    lr: float
    warmup_steps: int
    batch_sequences: int
    micro_batch_sequences: int
    anchors: int
    loss_decay: float
    eval_every: int
    max_seconds: float = 0  # 0: no time box
    seed: int = 0
    sync_every: int = 10


@dataclass
class HeldOut:
    """One held-out evaluation."""

    loss: float
    accuracy: float
    mean_block_accept: float  # the objective's figure at the fixed anchors: not acceptance
    accept_length: float | None  # served-equivalent (drafter_walk.py); None: no verify step
    sequences: int  # held-out sequences walked for accept_length

    def csv(self) -> list[str]:
        accept = "" if self.accept_length is None else f"{self.accept_length:.6g}"
        return [f"{self.loss:.6g}", f"{self.accuracy:.6g}", f"{self.mean_block_accept:.6g}",
                accept, str(self.sequences)]

    def describe(self) -> str:
        accept = "n/a" if self.accept_length is None else f"{self.accept_length:.2f}"
        return (f"accept length {accept} (served-equivalent, {self.sequences} sequences), "
                f"mean block accept {self.mean_block_accept:.2f}, loss {self.loss:.3f}, "
                f"accuracy {self.accuracy:.3f}")


@dataclass
class Row:
    """One line of loss.csv: a step's training metrics, and the held-out ones where it was
    evaluated (None elsewhere)."""

    step: int
    loss: float
    accuracy: float
    mean_block_accept: float
    heldout: HeldOut | None = None

    def csv(self) -> list:
        tail = self.heldout.csv() if self.heldout else [""] * 5
        return [self.step, f"{self.loss:.6g}", f"{self.accuracy:.6g}",
                f"{self.mean_block_accept:.6g}", *tail]


# Earlier runs wrote accept_length_proxy and heldout_accept_length_proxy where the mean block
# accept columns are now, and had no heldout_accept_length / heldout_accept_sequences: the
# columns kept their places and the new ones come last.
CSV_HEADER = ["step", "loss", "accuracy", "mean_block_accept", "heldout_loss",
              "heldout_accuracy", "heldout_mean_block_accept", "heldout_accept_length",
              "heldout_accept_sequences"]


class DrafterTrainer:
    def __init__(self, drafter: DFlashDrafter, embedding: Tensor, head: Tensor,
                 train: SequenceSet, heldout: SequenceSet | None, plan: TrainPlan) -> None:
        self.drafter, self.embedding, self.head = drafter, embedding, head
        self.train, self.heldout, self.plan = train, heldout, plan
        self.opt = torch.optim.AdamW(drafter.parameters(), lr=plan.lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(plan.seed)
        self.eval_batches = self._fixed_batches(heldout) if heldout is not None else []
        # The walk drafts at every answer position, in forwards no bigger than a training
        # micro-batch (its sequences, its blocks), so it fits where training does. Periodic
        # evaluations walk a fixed prefix of the held-out sequences with at most as many
        # blocks as the fixed anchors (held-out sequences x --anchors), so each costs about
        # what the objective's evaluation does (all ~220 answer positions of the shipped
        # drafter's sequences would be ~3.5x that at 64 anchors); the final one walks all.
        self.walk_blocks = plan.micro_batch_sequences * plan.anchors
        self.walk_all = list(range(len(heldout))) if heldout is not None else []
        self.walk_periodic = (prefix_within(heldout, self.walk_all,
                                            len(self.walk_all) * plan.anchors)
                              if self.walk_all else [])
        self.rows: list[Row] = []
        self.last_heldout: HeldOut | None = None

    # ---- batches -------------------------------------------------------------------------

    def _blocks(self, data: SequenceSet, idx: list[int], gen: torch.Generator) -> Blocks | None:
        cfg, plan = self.drafter.cfg, self.plan
        spans, anchors = [], []
        for i in idx:
            a = sample_anchors(data.prompt_lens[i] - 1, data.length(i), cfg.block_size,
                               plan.anchors, gen)
            if a:
                spans.append((data.offsets[i], data.length(i)))
                anchors.append(a)
        if not spans:
            return None
        return build_batch(data.tokens, spans, anchors, cfg.block_size, cfg.mask_token_id,
                           plan.loss_decay)

    def _fixed_batches(self, data: SequenceSet) -> list[Blocks]:
        """The held-out blocks, drawn once (seeded) and kept: every evaluation sees the same."""
        gen = torch.Generator().manual_seed(self.plan.seed + 1)
        m = self.plan.micro_batch_sequences
        out = []
        for start in range(0, len(data), m):
            b = self._blocks(data, list(range(start, min(start + m, len(data)))), gen)
            if b is not None:
                out.append(b)
        return out

    def _order(self) -> Iterator[list[int]]:
        """Batches of sequence indices: a fresh seeded shuffle each epoch."""
        n, s = len(self.train), self.plan.batch_sequences
        while True:
            perm = torch.randperm(n, generator=self.gen).tolist()
            for start in range(0, n, s):
                yield perm[start : start + s]

    def _loss(self, data: SequenceSet, blocks: Blocks) -> StepResult:
        feats = data.features[blocks.ctx_rows].float()
        return dflash_loss(self.drafter, feats, blocks, self.embedding, self.head)

    # ---- evaluation ----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, full: bool = False) -> HeldOut | None:
        """The held-out evaluation: the objective averaged over the fixed blocks, and the
        served-equivalent acceptance of the walk over the periodic prefix or (`full`) every
        held-out sequence."""
        if not self.eval_batches:
            return None
        total = torch.zeros(3, device=self.train.tokens.device)
        blocks = 0
        for b in self.eval_batches:
            r = self._loss(self.heldout, b)
            n = r.num_blocks
            total += torch.stack([r.loss.detach(), r.accuracy, r.mean_block_accept]) * n
            blocks += n
        loss, acc, block_accept = (total / blocks).tolist()
        walk = walk_sequences(self.drafter, self.embedding, self.head, self.heldout,
                              self.walk_all if full else self.walk_periodic, self.walk_blocks,
                              self.plan.micro_batch_sequences)
        return HeldOut(loss, acc, block_accept, walk.accept_length, walk.sequences)

    # ---- the loop ------------------------------------------------------------------------

    def step(self, idx: list[int], lr: float) -> Tensor | None:
        """One optimiser step on sequences `idx`; its (loss, accuracy, accept) on the device."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        m = self.plan.micro_batch_sequences
        micro = [self._blocks(self.train, idx[i : i + m], self.gen) for i in range(0, len(idx), m)]
        micro = [b for b in micro if b is not None]
        if not micro:
            return None
        n_blocks = sum(b.targets.shape[0] for b in micro) // (self.drafter.cfg.block_size - 1)
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros(3, device=self.train.tokens.device)
        for b in micro:
            r = self._loss(self.train, b)
            (r.loss * (r.num_blocks / n_blocks)).backward()
            total += torch.stack([r.loss.detach(), r.accuracy, r.mean_block_accept]) * (
                r.num_blocks / n_blocks)
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.opt.step()
        return total

    def run(self, log: Any = print) -> list[Row]:
        """Train for `plan.steps` steps or `plan.max_seconds`; returns the loss.csv rows."""
        from tqdm import tqdm

        plan = self.plan
        every = max(1, plan.steps // 10)
        pending: list[tuple[int, Tensor]] = []
        order = self._order()
        bar = tqdm(range(plan.steps), desc="train-drafter", unit="step")
        t0 = time.monotonic()
        last_eval = self.last_heldout = self.evaluate()
        if last_eval is not None:
            log(f"train-drafter: held-out before training: {last_eval.describe()}")
        for step in bar:
            elapsed = time.monotonic() - t0
            if plan.max_seconds and elapsed > plan.max_seconds:
                log(f"train-drafter: stopped at step {step} of {plan.steps}: "
                    f"--max-train-seconds {plan.max_seconds:g} reached")
                break
            decay = (step - plan.warmup_steps) / max(1, plan.steps - plan.warmup_steps)
            progress = max(decay, elapsed / plan.max_seconds if plan.max_seconds else 0.0)
            lr = cosine_lr(step, plan.steps, plan.lr, plan.warmup_steps, progress)
            metrics = self.step(next(order), lr)
            if metrics is not None:
                pending.append((step, metrics))
            last = step + 1 == plan.steps
            do_eval = bool(self.eval_batches) and ((step + 1) % plan.eval_every == 0 or last)
            if len(pending) >= plan.sync_every or do_eval or (step + 1) % every == 0 or last:
                self._flush(pending, bar)
                pending = []
            if do_eval and self.rows:
                last_eval = self.last_heldout = self.evaluate(full=last)
                self.rows[-1].heldout = last_eval
                self._postfix(bar)
            if (step + 1) % every == 0 and self.rows:
                recent = [r for r in self.rows if r.step > step - every]
                held = f" | held-out {last_eval.describe()}" if last_eval else ""
                log(f"train-drafter: step {step + 1}/{plan.steps} loss "
                    f"{_mean(r.loss for r in recent):.3f} accuracy "
                    f"{_mean(r.accuracy for r in recent):.3f} mean block accept "
                    f"{_mean(r.mean_block_accept for r in recent):.2f}{held}")
        self._flush(pending, bar)
        bar.close()
        # the last row holds the final evaluation, over every held-out sequence (a time box
        # can stop the run just after a periodic one)
        h = self.rows[-1].heldout if self.rows else None
        if self.eval_batches and self.rows and (h is None or h.sequences < len(self.walk_all)):
            self.rows[-1].heldout = self.last_heldout = self.evaluate(full=True)
        return self.rows

    def _flush(self, pending: list[tuple[int, Tensor]], bar: Any) -> None:
        if not pending:
            return
        values = torch.stack([m for _, m in pending]).tolist()
        for (step, _), (loss, acc, block_accept) in zip(pending, values):
            self.rows.append(Row(step, loss, acc, block_accept))
        self._postfix(bar)

    def _postfix(self, bar: Any) -> None:
        r, h = self.rows[-1], self.last_heldout
        held = {}
        if h is not None:
            accept = "n/a" if h.accept_length is None else f"{h.accept_length:.2f}"
            held = {"heldout_accept": accept, "heldout_block_accept": f"{h.mean_block_accept:.2f}"}
        bar.set_postfix(loss=f"{r.loss:.3f}", acc=f"{r.accuracy:.2f}",
                        block_accept=f"{r.mean_block_accept:.2f}", **held)


def _mean(values: Any) -> float:
    v = list(values)
    return sum(v) / len(v) if v else math.nan


def default_steps(num_sequences: int, batch_sequences: int, epochs: float) -> int:
    """Steps for `epochs` passes over `num_sequences` sequences, `batch_sequences` a step."""
    return max(1, math.ceil(epochs * num_sequences / max(1, batch_sequences)))
