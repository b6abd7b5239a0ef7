"""`swaserve train-drafter --target MODEL --out DIR`: train a DFlash drafter on text the target
itself generates (drafter_training.py has the objective).

1. Data: prompts from `--prompts FILE` (one per line) or built-in varied ones, in the target's
   chat template when it has one; the target continues each (greedy by default: the drafter
   learns what greedy serving will ask of it).
2. Features: the target's hidden states after `target_layer_ids` at every position of each
   sequence, from one prefill over a scratch pool (the engine's own model and backend).
3. Training: a fresh drafter (the target's attention shape, so serving can share its KV
   pool), AdamW with warm-up and cosine decay, several anchors per sequence per step; the
   target's embedding and head stay frozen and are not saved.
4. Output: DIR/config.json (DFlashDraftModel, loadable by swaserve and by the `dflash`
   reference), DIR/model.safetensors, DIR/loss.csv and DIR/loss.png.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from swaserve.attention.base import AttentionInputs
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import build_layout
from swaserve.memory.kv_pool import KVPool
from swaserve.models.blocks import head_dim_of, layer_windows
from swaserve.ops.cpu_linear import dense_weight
from swaserve.speculative.dflash_config import build_target_layer_ids, dflash_config_from_dict
from swaserve.speculative.dflash_model import DFlashDrafter
from swaserve.speculative.drafter_training import (
    build_blocks,
    cosine_lr,
    dflash_loss,
    sample_anchors,
)
from swaserve.speculative.loss_plot import plot_loss

log = logging.getLogger(__name__)

_TASKS = [
    "Explain {t} to a curious twelve-year-old.",
    "Write a short story about {t}.",
    "List five facts about {t}, one per line.",
    "What are the pros and cons of {t}?",
    "Write a Python function related to {t}, with a docstring.",
    "Summarise the history of {t} in one paragraph.",
    "Give step-by-step instructions for getting started with {t}.",
    "Write a haiku and then a limerick about {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Answer as a teacher: why does {t} matter?",
    "What are common misconceptions about {t}?",
    "Write a short dialogue between two friends discussing {t}.",
    "Describe {t} in three sentences.",
    "Write a blog post introduction about {t}.",
    "What questions would an expert ask about {t}? Answer two of them.",
    "Create a quiz with three multiple-choice questions about {t}.",
    "Explain how {t} works, using an analogy.",
    "Write a product description for something inspired by {t}.",
    "What would the world be like without {t}?",
    "Give a beginner's glossary of five terms related to {t}.",
]
_TOPICS = [
    "photosynthesis", "the Roman empire", "black holes", "sourdough bread", "chess openings",
    "climate change", "the French revolution", "neural networks", "volcanoes", "jazz music",
    "the water cycle", "prime numbers", "bicycles", "the immune system", "coffee", "honeybees",
    "the moon landing", "recycling", "the stock market", "origami", "electric cars",
    "the printing press", "sleep", "rainforests", "the Olympic games", "sorting algorithms",
    "gardening", "the human heart", "earthquakes", "public libraries",
    "machine learning", "the solar system", "ancient Egypt", "chocolate", "the internet",
    "dinosaurs", "renewable energy", "meditation", "the Renaissance", "quantum computing",
    "football", "tea ceremonies", "ocean tides", "vaccines", "the piano", "time zones",
    "hiking", "the human brain", "cryptography", "coral reefs", "democracy", "baking cakes",
    "the Great Wall of China", "photography", "bees and pollination", "3D printing",
    "mountains", "the Silk Road", "robots", "friendship", "budgeting", "the blockchain",
    "wolves", "volunteering", "airplanes", "spices", "the periodic table", "marathons",
    "the Amazon river", "video games", "glaciers", "Shakespeare", "public speaking",
    "the theory of evolution", "trains", "mushrooms",
]


def builtin_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pairs = [(task, topic) for task in _TASKS for topic in _TOPICS]
    rng.shuffle(pairs)
    return [task.format(t=topic) for task, topic in (pairs * (n // len(pairs) + 1))[:n]]


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


@torch.inference_mode()
def target_features(core: Any, ids: list[int], layer_ids: tuple[int, ...]) -> Tensor:
    """[L, len(layer_ids) * hidden]: the target's hidden states after `layer_ids` (Hugging
    Face's hidden_states[i + 1]) at every position of `ids`, one prefill on a scratch pool."""
    hf, ps = core.hf_config, 16
    layout = build_layout(layer_windows(hf))
    per_group = math.ceil(len(ids) / ps)
    pool = KVPool(layout, 1 + per_group * layout.num_groups, ps, hf.num_key_value_heads,
                  head_dim_of(hf), core.dtype, core.device)
    tables = [list(range(1 + g * per_group, 1 + (g + 1) * per_group))
              for g in range(layout.num_groups)]
    backend = type(core.runner.backend)(layout, ps, core.device)
    fb = ForwardBatch(
        torch.tensor(ids, device=core.device),
        torch.arange(len(ids), device=core.device),
        backend,
        backend.prepare(AttentionInputs([len(ids)], [0], [tables])),
        pool,
        keep_layers=frozenset(layer_ids),
    )
    core.model(fb)
    return torch.cat([fb.layer_outputs[i] for i in layer_ids], dim=-1)


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


def run(args: Any) -> int:
    from tqdm import tqdm

    from swaserve import Engine, SamplingParams

    torch.manual_seed(args.seed)
    engine = Engine(model=args.target, device=args.device, dtype=args.dtype,
                    kv_cache_gb=args.kv_cache_gb, seed=args.seed)
    core, tok = engine.core, engine.tokenizer
    if tok is None:
        raise ValueError(f"{args.target} has no tokenizer: train-drafter needs text prompts")
    if args.prompts:
        texts = [t for t in Path(args.prompts).read_text().splitlines() if t.strip()]
    else:
        texts = builtin_prompts(args.num_prompts, args.seed)
    prompts = [prompt_ids(tok, t) for t in texts]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                            seed=args.seed if args.temperature > 0 else None)
    t0 = time.monotonic()
    outs = engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=True)
    seqs = [(p + o.token_ids, len(p)) for p, o in zip(prompts, outs)]
    n_gen = sum(len(s) - p for s, p in seqs)
    print(f"train-drafter: {len(seqs)} sequences, {n_gen} generated tokens "
          f"({time.monotonic() - t0:.0f} s)")

    hf = core.hf_config
    raw = drafter_config(hf, args, _mask_token(tok, int(hf.vocab_size)))
    cfg = dflash_config_from_dict(raw, hf, source="train-drafter")
    drafter = DFlashDrafter(cfg).to(core.device)
    _init_weights(drafter, args.seed)
    drafter.rotary_emb.restore_buffers(core.device)
    inner = core.model.model
    # float32 copies made outside inference mode: autograd reads them (frozen, no grad)
    embedding = dense_weight(inner.embed_tokens).detach().float().clone()
    head = (embedding if core.model.tie_word_embeddings
            else dense_weight(core.model.lm_head).detach().float().clone())
    data = [(torch.tensor(s, device=core.device), p,
             target_features(core, s, cfg.target_layer_ids).float().clone()) for s, p in seqs]
    del engine  # the generation KV pool is not needed any more

    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, losses = [], []
    bar = tqdm(range(args.steps), desc="train-drafter", unit="step")
    every = max(1, args.steps // 10)
    t_train = time.monotonic()
    for step in bar:
        if args.max_train_seconds and time.monotonic() - t_train > args.max_train_seconds:
            print(f"train-drafter: stopped at step {step} of {args.steps}: "
                  f"--max-train-seconds {args.max_train_seconds:g} reached", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, args.steps, args.lr, args.warmup_steps)
        opt.zero_grad(set_to_none=True)
        results = []
        # several sequences per step: their losses are averaged (one backward each, so that
        # only one sequence's activations are alive at a time)
        for _ in range(args.batch_sequences):
            tokens, lo, feats = data[int(torch.randint(len(data), (1,), generator=gen))]
            anchors = sample_anchors(lo - 1, tokens.shape[0], cfg.block_size, args.anchors, gen)
            if not anchors:
                continue
            blocks = build_blocks(tokens, anchors, cfg.block_size, cfg.mask_token_id,
                                  args.loss_decay)
            res = dflash_loss(drafter, feats, tokens, blocks, embedding, head)
            (res.loss / args.batch_sequences).backward()
            results.append(res)
        if not results:
            continue
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        n = len(results)
        loss = sum(float(r.loss.detach()) for r in results) / n
        acc = sum(r.accuracy for r in results) / n
        accept = sum(r.accept_length for r in results) / n
        losses.append(loss)
        rows.append((step, loss, acc, accept))
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}", accept=f"{accept:.2f}")
        if (step + 1) % every == 0:  # a plain line too, for logs that keep no progress bar
            recent = rows[-every:]
            print(f"train-drafter: step {step + 1}/{args.steps} loss "
                  f"{sum(r[1] for r in recent) / len(recent):.3f} accuracy "
                  f"{sum(r[2] for r in recent) / len(recent):.3f} accept-length proxy "
                  f"{sum(r[3] for r in recent) / len(recent):.2f}", flush=True)
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "accuracy", "accept_length_proxy"])
        w.writerows(rows)
    plot_loss(losses, out / "loss.png", title=f"DFlash drafter for {args.target}")
    size = save_drafter(drafter, raw, out, getattr(torch, args.save_dtype))
    print(f"train-drafter: saved {out} ({size / 2**20:.2f} MiB of weights, {args.save_dtype})")
    return 0


def add_args(p: Any) -> None:
    p.add_argument("--target", required=True, help="the target model (alias, GGUF or folder)")
    p.add_argument("--out", required=True, help="output folder for the drafter")
    p.add_argument("--prompts", help="a text file, one prompt per line (default: built-in)")
    p.add_argument("--num-prompts", type=int, default=600, help="built-in prompts to use")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy continuations")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    p.add_argument("--batch-sequences", type=int, default=4,
                   help="sequences per optimiser step (their losses averaged)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="drafter MLP width (default: the target's)")
    p.add_argument("--target-layers", type=int, nargs="+", default=None,
                   help="target layers whose outputs feed the drafter (default: 3, spread)")
    p.add_argument("--loss-decay", type=float, default=4.0,
                   help="row i weighs exp(-(i-1)/decay); 0: equal weights")
    p.add_argument("--max-train-seconds", type=float, default=0,
                   help="stop the optimisation after this long and save (0: no limit)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="the target's dtype")
    p.add_argument("--save-dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                 "float32"))
    p.add_argument("--kv-cache-gb", type=float, default=2.0,
                   help="KV pool of the target while it generates the data")
    p.add_argument("--seed", type=int, default=0)
