"""Training sequences of `swaserve train-drafter` on disk, so that generating them and training
on them can run in separate calls (a time-boxed GPU call answers a few thousand prompts;
several such files then train one drafter).

One `.npz` per file: `tokens` (int32, every sequence's prompt + answer ids, flat), `offsets`
(int64, sequence i is tokens[offsets[i]:offsets[i + 1]]), `prompt_lens` (int64) and `meta`
(JSON: the target, its vocabulary size, how the answers were made). Loading checks that every
id fits the target's vocabulary and drops sequences repeated across files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def save_sequences(path: str | Path, seqs: Sequence[tuple[list[int], int]], meta: dict) -> int:
    """Write (token ids, prompt length) pairs; returns the file's size in bytes."""
    lengths = np.array([len(s) for s, _ in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for s, _ in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a bare name
        np.savez_compressed(f, tokens=tokens, offsets=offsets,
                            prompt_lens=np.array([p for _, p in seqs], dtype=np.int64),
                            meta=np.array(json.dumps(meta)))
    return path.stat().st_size


def load_sequences(paths: Sequence[str | Path], vocab_size: int, target: str
                   ) -> tuple[list[tuple[list[int], int]], list[str]]:
    """Every file's sequences, each distinct one once; and notes for the log (files made for
    another target are loaded, with a note: a fine-tuned copy may share its tokenizer).
    ValueError naming the file when one is not such a file or holds ids past `vocab_size`."""
    seen: set[tuple[int, ...]] = set()
    out: list[tuple[list[int], int]] = []
    notes = []
    for path in paths:
        try:
            with np.load(path, allow_pickle=False) as z:
                tokens, offsets, prompts = z["tokens"], z["offsets"], z["prompt_lens"]
                meta = json.loads(str(z["meta"]))
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"--sequences {path}: not a train-drafter sequence file ({e})") from e
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise ValueError(f"--sequences {path}: token ids outside the target's vocabulary "
                             f"(0..{vocab_size - 1}): made for another model?")
        if meta.get("target") != target:
            notes.append(f"{path} was made for {meta.get('target')!r}, not {target!r}")
        ids = tokens.tolist()
        before = len(out)
        for i, p in enumerate(prompts.tolist()):
            seq = ids[offsets[i] : offsets[i + 1]]
            key = tuple(seq)
            if key not in seen:
                seen.add(key)
                out.append((seq, int(p)))
        notes.append(f"{path}: {len(out) - before} of {len(prompts)} sequences new")
    return out, notes
