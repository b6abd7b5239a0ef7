"""The prompts `swaserve bench serve` sends: synthetic sets and a user's own files.

- `random`: `--input-len` random words per prompt, `--output-len` tokens each.
- `shared-prefix`: `--num-prefixes` prefixes of `--prefix-len` words, each prompt one prefix
  plus `--input-len` random words (the prefix cache's workload); with `--num-turns` T, each
  conversation's turn t+1 resends turn t's prompt plus new words.
- `jsonl` (`--dataset-path FILE`, or the old form `--dataset FILE.jsonl`): one JSON object
  per line,

      {"prompt": "Tell me about Paris.", "max_tokens": 64}
      {"prompt": [1, 4093, 314], "max_tokens": 16}
      {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}

  `prompt` is text or token ids (token ids go to `/v1/completions` only); `messages` is an
  OpenAI chat conversation, sent as is by `--endpoint-type chat` (a line with only a text
  `prompt` is sent there as one user message); `max_tokens` defaults to `--output-len`.
  Blank lines are skipped; lines are reused in order when `--num-prompts` is larger.
- `sharegpt` (`--dataset-path FILE`): a ShareGPT-format JSON list,
  `[{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}]`.
  The first human turn is the prompt; the reply after it sets max_tokens (its length in
  tokens of `--tokenizer` or the served model, else in words), or `--sharegpt-output-len`.
  As vLLM does, conversations are shuffled with `--seed`, and pairs under 4 prompt or reply
  tokens, with a prompt over 1024, or over 2048 together are skipped.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "shared-prefix", "jsonl", "sharegpt")

# ShareGPT pairs kept (vLLM's limits): both sides at least MIN_LEN; a prompt of at most
# MAX_PROMPT_LEN and a pair of at most MAX_TOTAL_LEN.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
_HUMAN = ("human", "user")
_GPT = ("gpt", "chatgpt", "assistant", "model")

_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an "
    "they which one you were all her she there would their we him been has when who will no "
    "more if out so said what up its about than into them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see "
    "men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three"
).split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    messages: list[dict[str, Any]] | None = None  # chat: sent instead of the prompt


def dataset_file(args: argparse.Namespace) -> tuple[str, Path | None]:
    """(dataset kind, file) from --dataset and --dataset-path; raises ValueError naming the
    flag for an unknown dataset, a file-based one without a file, or a missing file."""
    kind, path = args.dataset, getattr(args, "dataset_path", None)
    if kind not in DATASETS:
        if path is None and Path(kind).is_file():  # the old form: --dataset FILE.jsonl
            return "jsonl", Path(kind)
        raise ValueError(
            f"--dataset {kind!r}: not one of {', '.join(DATASETS)} (nor an existing file)"
        )
    if kind in ("jsonl", "sharegpt"):
        if path is None:
            raise ValueError(f"--dataset {kind} needs --dataset-path FILE")
        if not Path(path).is_file():
            raise ValueError(f"--dataset-path {path}: no such file")
        return kind, Path(path)
    return kind, None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _cycle(items: list[BenchRequest], n: int) -> list[list[BenchRequest]]:
    return [[items[i % len(items)]] for i in range(n)]


def build_dataset(
    args: argparse.Namespace, count: Callable[[str], int] | None = None
) -> list[list[BenchRequest]]:
    """Conversations: each a list of requests sent one after another (one turn unless
    shared-prefix with --num-turns > 1); --num-prompts counts requests. `count` measures
    ShareGPT text (tokens; words when None)."""
    kind, path = dataset_file(args)
    rng = random.Random(args.seed)
    n = args.num_prompts
    chat = getattr(args, "endpoint_type", "completions") == "chat"
    if kind == "random":
        return [[BenchRequest(_words(rng, args.input_len), args.output_len)] for _ in range(n)]
    if kind == "shared-prefix":
        prefixes = [_words(rng, args.prefix_len) for _ in range(max(1, args.num_prefixes))]
        turns = max(1, args.num_turns)
        convs = []
        for i in range(max(1, n // turns)):
            prompt, conv = prefixes[i % len(prefixes)], []
            for _ in range(turns):
                prompt = prompt + " " + _words(rng, args.input_len)
                conv.append(BenchRequest(prompt, args.output_len))
            convs.append(conv)
        return convs
    assert path is not None
    if kind == "jsonl":
        return _cycle(load_jsonl(path, args.output_len, chat), n)
    items = load_sharegpt(path, count or _count_words, args.sharegpt_output_len, args.seed)
    return _cycle(items, n)


def _count_words(text: str) -> int:
    return len(text.split())


def _line_request(d: Any, default_max_tokens: int, chat: bool) -> BenchRequest:
    """One JSONL object -> a request; ValueError (without the line number) when malformed."""
    if not isinstance(d, dict):
        raise ValueError("expected a JSON object")
    prompt, messages = d.get("prompt"), d.get("messages")
    if prompt is None and messages is None:
        raise ValueError('needs "prompt" (text or token ids) or "messages"')
    if prompt is not None and not (
        (isinstance(prompt, str) and prompt)
        or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt))
    ):
        raise ValueError('"prompt" must be non-empty text or a list of token ids')
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    ):
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    max_tokens = d.get("max_tokens", default_max_tokens)
    if type(max_tokens) is not int or max_tokens < 1:
        raise ValueError(f'"max_tokens" must be a positive integer, got {max_tokens!r}')
    if chat and messages is None and not isinstance(prompt, str):
        raise ValueError("token ids cannot go to the chat endpoint: give text or messages")
    if not chat and prompt is None:
        raise ValueError('"messages" need --endpoint-type chat, or add a "prompt"')
    return BenchRequest(prompt if prompt is not None else "", max_tokens, messages)


def load_jsonl(path: Path, default_max_tokens: int, chat: bool = False) -> list[BenchRequest]:
    """The documented JSONL format (module docstring); ValueError naming the file and line."""
    items = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--dataset-path {path} line {i}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        try:
            items.append(_line_request(d, default_max_tokens, chat))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not items:
        raise ValueError(f"--dataset-path {path}: holds no prompts")
    return items


def _first_pair(conv: Any) -> tuple[str, str] | None:
    """(first human turn, the gpt reply right after it), or None."""
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    if not isinstance(turns, list):
        return None
    for a, b in zip(turns, turns[1:]):
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return None
        if a.get("from") in _HUMAN:
            if b.get("from") in _GPT and isinstance(a.get("value"), str):
                return a["value"], str(b.get("value") or "")
            return None
    return None


def load_sharegpt(
    path: Path, count: Callable[[str], int], output_len: int | None = None, seed: int = 0
) -> list[BenchRequest]:
    """ShareGPT pairs as requests, shuffled by `seed`, filtered by MIN_LEN, MAX_PROMPT_LEN and
    MAX_TOTAL_LEN as counted by `count`; max_tokens is the reply's length or `output_len`."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path {path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f'--dataset-path {path}: expected a JSON list of {{"conversations"}}')
    pairs = [p for p in map(_first_pair, data) if p is not None]
    random.Random(seed).shuffle(pairs)
    items = []
    for prompt, reply in pairs:
        n_in = count(prompt)
        n_out = count(reply) if output_len is None else output_len
        too_short = n_in < MIN_LEN or (output_len is None and n_out < MIN_LEN)
        if too_short or n_in > MAX_PROMPT_LEN or n_in + n_out > MAX_TOTAL_LEN or n_out < 1:
            continue
        items.append(BenchRequest(prompt, n_out))
    if not items:
        raise ValueError(
            f"--dataset-path {path}: no usable ShareGPT conversation (a human turn of "
            f"{MIN_LEN}..{MAX_PROMPT_LEN} tokens followed by a gpt reply, "
            f"{MAX_TOTAL_LEN} at most together)"
        )
    return items


def text_counter(name: str | None) -> tuple[Callable[[str], int], str]:
    """(a function counting tokens of `name`'s tokenizer, "tokens"), or the word counter and
    "words" when `name` is None or swaserve finds no tokenizer for it locally."""
    if name:
        try:
            from swaserve.engine.engine import load_tokenizer, resolve_folder

            src = Path(name)
            folder = src if (src / "tokenizer.json").is_file() else resolve_folder(name)
            tok = load_tokenizer(folder)
        except Exception:  # best effort: words are counted instead, and said so
            tok = None
        if tok is not None:
            return (lambda s: len(tok(s, add_special_tokens=False).input_ids)), "tokens"
    return _count_words, "words"
