"""`swaserve train-drafter --target MODEL --out DIR`: train a DFlash drafter on text the target
itself generates.

1. Prompts (drafter_prompts.py, drafter_data.py): from `--prompts FILE` (one per line), or
   built in: users' messages the target writes itself (sampled, seeded), deduplicated, and
   "task about topic" templates; in the target's chat template when it has one.
2. Answers: the target continues each prompt (greedy by default: the drafter learns what
   greedy serving will ask of it). A held-out share of the sequences is never trained on.
   `--save-sequences FILE` keeps them (sequence_file.py); `--sequences FILE...` trains on
   files of earlier runs instead, so that generating (`--generate-only`) and training can run
   in separate time-boxed calls.
3. Features (drafter_features.py): the target's hidden states after `target_layer_ids` at
   every position, from batched prefills on a scratch pool, kept in the target's dtype.
4. Training (drafter_trainer.py, objective in drafter_training.py): a fresh drafter (the
   target's attention shape, so serving can share its KV pool), AdamW with warm-up and
   cosine decay, several sequences per drafter forward, about `--epochs` passes over the
   data, a held-out evaluation every `--eval-every` steps: the served-equivalent acceptance
   (serving's greedy walk replayed, drafter_walk.py) beside the objective's loss and mean
   block accept; the target's embedding and head stay frozen and are not saved.
5. Output: DIR/config.json (DFlashDraftModel, loadable by swaserve and by the `dflash`
   reference), DIR/model.safetensors, DIR/loss.csv and DIR/loss.png; the last line reports
   the final held-out acceptance, over every held-out sequence.

Each phase prints its time, so a time-boxed GPU run can be planned from the last one.
"""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from swaserve.models.blocks import head_dim_of
from swaserve.ops.cpu_linear import dense_weight
from swaserve.speculative.dflash_config import build_target_layer_ids, dflash_config_from_dict
from swaserve.speculative.dflash_model import DFlashDrafter
from swaserve.speculative.drafter_data import (
    answer,
    builtin_prompts,
    prompt_ids,
    split_held_out,
)
from swaserve.speculative.drafter_features import SequenceSet, target_features
from swaserve.speculative.drafter_prompts import dedupe
from swaserve.speculative.drafter_trainer import (
    CSV_HEADER,
    DrafterTrainer,
    Row,
    TrainPlan,
    default_steps,
)
from swaserve.speculative.loss_plot import plot_loss
from swaserve.speculative.sequence_file import load_sequences, save_sequences


def drafter_config(hf: Any, args: Any, mask_id: int) -> dict:
    """config.json of a fresh drafter for target `hf`: its attention shape (so that serving
    shares the target's KV pool), Qwen3 layers as every DFlash drafter has."""
    n_target = int(hf.num_hidden_layers)
    ids = args.target_layers or build_target_layer_ids(n_target, 3)
    rope = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in rope:  # per layer type (Gemma 3): the full layers' rotary
        rope = rope["full_attention"]
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    gemma = getattr(hf, "model_type", "").startswith("gemma")
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(hf.hidden_size),
        "intermediate_size": int(args.intermediate_size or hf.intermediate_size),
        "num_hidden_layers": int(args.num_layers),
        "num_attention_heads": int(hf.num_attention_heads),
        "num_key_value_heads": int(hf.num_key_value_heads),
        "head_dim": int(head_dim_of(hf)),
        "vocab_size": int(hf.vocab_size),
        "rms_norm_eps": float(hf.rms_norm_eps),
        "max_position_embeddings": int(hf.max_position_embeddings),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(theta)},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "num_target_layers": n_target,
        # Gemma scales its embeddings by sqrt(hidden); the drafter reads the raw table
        "input_embedding_scale": math.sqrt(hf.hidden_size) if gemma else 1.0,
        "dflash_config": {
            "block_size": int(args.block_size),
            "mask_token_id": int(mask_id),
            "target_layer_ids": [int(i) for i in ids],
        },
    }


def _init_weights(drafter: DFlashDrafter, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


def _mask_token(tokenizer: Any, vocab: int) -> int:
    mask = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    return int(mask) if mask is not None and 0 <= mask < vocab else vocab - 1


def save_drafter(drafter: DFlashDrafter, raw: dict, out: Path, dtype: torch.dtype) -> int:
    """config.json + model.safetensors; returns the weights' size in bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = dict(raw, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {n: p.detach().to(dtype).cpu().contiguous() for n, p in drafter.named_parameters()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return (out / "model.safetensors").stat().st_size


def _prompts(engine: Any, args: Any) -> list[str]:
    if args.prompts:
        texts = dedupe([t.strip() for t in Path(args.prompts).read_text().splitlines()
                        if t.strip()])
        return texts[: args.num_prompts] if args.num_prompts else texts
    return builtin_prompts(
        engine, args.num_prompts or 12000, args.seed, args.question_share,
        temperature=args.question_temperature, top_p=args.question_top_p,
        max_tokens=args.question_max_tokens,
    )


def _features(core: Any, seqs: list[tuple[list[int], int]], layer_ids: tuple[int, ...],
              max_tokens: int, name: str) -> SequenceSet:
    from tqdm import tqdm

    with tqdm(total=len(seqs), desc=f"features ({name})", unit="seq") as bar:
        return target_features(core, seqs, layer_ids, max_tokens, bar.update)


class _Clock:
    """Prints each phase's wall time (the GPU work of a phase is synchronised first)."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.start = self.last = time.monotonic()

    def mark(self, what: str) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.monotonic()
        print(f"train-drafter: {what} ({now - self.last:.0f} s; {now - self.start:.0f} s in "
              f"all)", flush=True)
        self.last = now


def run(args: Any) -> int:
    from swaserve import Engine

    if args.generate_only and not args.save_sequences:
        raise ValueError("--generate-only needs --save-sequences FILE (where the answers go)")
    if args.generate_only and args.sequences:
        raise ValueError("--generate-only with --sequences: nothing to generate or train")
    if not args.generate_only and not args.out:
        raise ValueError("--out DIR is needed (the drafter's folder), unless --generate-only")
    torch.manual_seed(args.seed)
    clock = _Clock()
    engine = Engine(model=args.target, device=args.device, dtype=args.dtype,
                    kv_cache_gb=args.kv_cache_gb, seed=args.seed, max_num_seqs=args.max_num_seqs)
    core = engine.core
    clock.device = core.device
    clock.mark(f"loaded {args.target} on {core.device}")
    vocab = int(core.hf_config.vocab_size)
    if args.sequences:
        seqs, notes = load_sequences(args.sequences, vocab, args.target)
        for note in notes:
            print(f"train-drafter: {note}", flush=True)
        clock.mark(f"loaded {len(seqs)} sequences")
    else:
        seqs = _sequences(engine, args, clock)
    if args.save_sequences:
        meta = {"target": args.target, "vocab_size": vocab, "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature, "seed": args.seed}
        size = save_sequences(args.save_sequences, seqs, meta)
        print(f"train-drafter: saved {len(seqs)} sequences to {args.save_sequences} "
              f"({size / 2**20:.1f} MiB)", flush=True)
    if args.generate_only:
        return 0
    raw = drafter_config(core.hf_config, args,
                         _mask_token(engine.tokenizer, int(core.hf_config.vocab_size)))
    cfg = dflash_config_from_dict(raw, core.hf_config, source="train-drafter")
    train, heldout = _feature_sets(core, seqs, tuple(cfg.target_layer_ids), args, clock)
    del engine, seqs  # the token lists are in the feature sets now

    drafter = DFlashDrafter(cfg).to(core.device)
    _init_weights(drafter, args.seed)
    drafter.rotary_emb.restore_buffers(core.device)
    # float32 copies made outside inference mode: autograd reads them (frozen, no grad)
    embedding = dense_weight(core.model.model.embed_tokens).detach().float().clone()
    head = (embedding if core.model.tie_word_embeddings
            else dense_weight(core.model.lm_head).detach().float().clone())
    if core.device.type == "cuda":  # TF32 matmuls: the float32 drafter's step is matmul-bound
        torch.backends.cuda.matmul.allow_tf32 = True
    plan = _plan(args, len(train))
    rows = DrafterTrainer(drafter, embedding, head, train, heldout, plan).run(
        lambda line: print(line, flush=True))
    clock.mark(f"trained {len(rows)} steps")
    _write(Path(args.out), rows, drafter, raw, args)
    return 0


def _sequences(engine: Any, args: Any, clock: _Clock) -> list[tuple[list[int], int]]:
    """(prompt + answer token ids, prompt length) per prompt."""
    from swaserve import SamplingParams

    tok = engine.tokenizer
    if tok is None:
        raise ValueError(f"{args.target} has no tokenizer: train-drafter needs text prompts")
    texts = _prompts(engine, args)
    clock.mark(f"{len(texts)} prompts")
    # the answers' token ids are the data: no text (detokenizing cost host time per token)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=args.seed if args.temperature > 0 else None, detokenize=False)
    seqs = answer(engine, [prompt_ids(tok, t) for t in texts], params,
                  max_seconds=args.max_generate_seconds)
    n_gen = sum(len(s) - p for s, p in seqs)
    clock.mark(f"{len(seqs)} sequences, {n_gen} generated tokens "
               f"({n_gen / max(1, len(seqs)):.0f} a sequence)")
    return seqs


def _feature_sets(core: Any, seqs: list[tuple[list[int], int]], layer_ids: tuple[int, ...],
                  args: Any, clock: _Clock) -> tuple[SequenceSet, SequenceSet | None]:
    """The training and held-out sequences (split_held_out) with the target's features."""
    train_idx, held_idx = split_held_out(len(seqs), args.heldout_sequences, args.seed)
    sets = []
    for name, idx in (("train", train_idx), ("held-out", held_idx)):
        sets.append(_features(core, [seqs[i] for i in idx], layer_ids,
                              args.feature_batch_tokens, name) if idx else None)
    train, heldout = sets
    size = sum(s.features.numel() * s.features.element_size() for s in sets if s is not None)
    clock.mark(f"features of {len(train_idx)} training and {len(held_idx)} held-out sequences "
               f"({size / 2**20:.0f} MiB, {train.features.dtype})")
    return train, heldout


def _plan(args: Any, num_train: int) -> TrainPlan:
    batch = max(1, min(args.batch_sequences, num_train))
    steps = args.steps or default_steps(num_train, batch, args.epochs)
    print(f"train-drafter: {steps} steps of {batch} sequences x {args.anchors} blocks "
          f"({steps * batch / max(1, num_train):.2f} epochs of {num_train} sequences)",
          flush=True)
    return TrainPlan(
        steps=steps, lr=args.lr, warmup_steps=min(args.warmup_steps, max(1, steps // 10)),
        batch_sequences=batch, micro_batch_sequences=args.micro_batch_sequences or batch,
        anchors=args.anchors, loss_decay=args.loss_decay,
        eval_every=args.eval_every or max(1, steps // 20),
        max_seconds=args.max_train_seconds, seed=args.seed,
    )


def _write(out: Path, rows: list[Row], drafter: DFlashDrafter, raw: dict, args: Any) -> None:
    """loss.csv, loss.png, config.json and model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_HEADER)
        w.writerows(r.csv() for r in rows)
    held = [(i, r.heldout.loss) for i, r in enumerate(rows) if r.heldout]
    plot_loss([r.loss for r in rows], out / "loss.png", title=f"DFlash drafter for {args.target}",
              heldout=held)
    size = save_drafter(drafter, raw, out, getattr(torch, args.save_dtype))
    print(f"train-drafter: saved {out} ({size / 2**20:.2f} MiB of weights, {args.save_dtype})")
    final = next((r.heldout for r in reversed(rows) if r.heldout), None)
    if final is not None:  # the last line: what serving will accept (drafter_walk.py)
        print(f"train-drafter: held-out {final.describe()}")


def add_args(p: Any) -> None:
    p.add_argument("--target", required=True, help="the target model (alias, GGUF or folder)")
    p.add_argument("--out", help="output folder for the drafter (not with --generate-only)")
    g = p.add_argument_group("data")
    g.add_argument("--sequences", nargs="+", metavar="FILE",
                   help="train on sequences saved earlier by --save-sequences (several files: "
                   "all of them, repeats once); no prompt is answered")
    g.add_argument("--save-sequences", metavar="FILE",
                   help="write the training sequences (prompt + answer ids) to FILE (.npz), for "
                   "--sequences in a later run")
    g.add_argument("--generate-only", action="store_true",
                   help="answer the prompts, --save-sequences, and stop (no training): "
                   "generation and training can then run in separate, time-boxed calls")
    g.add_argument("--prompts", help="a text file, one prompt per line, deduplicated (default: "
                   "built-in: messages the target writes itself, and templates)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="prompts to answer (built-in: how many to make, default 12000; a "
                   "file: its first N, default all)")
    g.add_argument("--question-share", type=float, default=0.8,
                   help="built-in prompts: the share written by the target (the rest, and any "
                   "shortfall, are templates; default %(default)s)")
    g.add_argument("--question-temperature", type=float, default=0.8,
                   help="sampling temperature of the target writing users' messages "
                   "(default %(default)s)")
    g.add_argument("--question-top-p", type=float, default=0.95, help="(default %(default)s)")
    g.add_argument("--question-max-tokens", type=int, default=96,
                   help="tokens of each list of users' messages the target writes "
                   "(default %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=320,
                   help="tokens of each answer (default %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="answers: 0 is greedy")
    g.add_argument("--max-generate-seconds", type=float, default=0,
                   help="stop answering when this runs out and train on what is done, answers "
                   "cut short kept as far as they got (0: no limit)")
    g.add_argument("--heldout-sequences", type=int, default=256,
                   help="sequences kept out of training, for the held-out evaluation (at most "
                   "a tenth of them; default %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests the target generates at once (default %(default)s)")
    g.add_argument("--kv-cache-gb", type=float, default=2.0,
                   help="KV pool of the target while it generates the data "
                   "(default %(default)s)")
    g.add_argument("--feature-batch-tokens", type=int, default=65536,
                   help="tokens per prefill when extracting the target's hidden states "
                   "(default %(default)s)")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=float, default=2.0,
                   help="passes over the training sequences: sets --steps when that is not "
                   "given (default %(default)s)")
    t.add_argument("--steps", type=int, default=None, help="optimiser steps (default: --epochs)")
    t.add_argument("--lr", type=float, default=6e-4,
                   help="peak learning rate (default %(default)s)")
    t.add_argument("--warmup-steps", type=int, default=100,
                   help="linear warm-up (at most a tenth of the steps; default %(default)s)")
    t.add_argument("--anchors", type=int, default=64,
                   help="blocks per sequence per step (default %(default)s)")
    t.add_argument("--batch-sequences", type=int, default=8,
                   help="sequences per optimiser step (default %(default)s)")
    t.add_argument("--micro-batch-sequences", type=int, default=None,
                   help="sequences per drafter forward (default: --batch-sequences; fewer use "
                   "less memory, gradients accumulate)")
    t.add_argument("--eval-every", type=int, default=None,
                   help="steps between held-out evaluations (default: a twentieth of the run)")
    t.add_argument("--loss-decay", type=float, default=4.0,
                   help="row i weighs exp(-(i-1)/decay); 0: equal weights")
    t.add_argument("--max-train-seconds", type=float, default=0,
                   help="stop the optimisation after this long and save; the learning rate "
                   "decays to 0 by then (0: no limit)")
    d = p.add_argument_group("drafter")
    d.add_argument("--block-size", type=int, default=8)
    d.add_argument("--num-layers", type=int, default=1, help="drafter decoder layers")
    d.add_argument("--intermediate-size", type=int, default=None,
                   help="drafter MLP width (default: the target's)")
    d.add_argument("--target-layers", type=int, nargs="+", default=None,
                   help="target layers whose outputs feed the drafter (default: 3, spread)")
    d.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                 "float32"))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the target's dtype")
    p.add_argument("--seed", type=int, default=0)
