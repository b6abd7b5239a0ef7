"""Build a Hugging Face fast tokenizer from GGUF tokenizer metadata.

Two GGUF tokenizer kinds are handled:
- `gpt2`: byte-level BPE with stored merges (SmolLM2, Llama 3, Qwen). The pre-tokenizer is
  chosen from `tokenizer.ggml.pre` (llama.cpp's names), mirroring llama.cpp's regexes.
- `llama`: SentencePiece BPE (Gemma, Llama 2, Mistral): pieces with scores and no merges.
  Merges are derived from the scores, byte fallback uses the `<0xNN>` pieces.

transformers' own GGUF converter is not used: it builds a Unigram model for Gemma (wrong
pieces, no BOS), needs minutes to derive merges for a 262k vocab, sets SmolLM2's eos to
`<|im_start|>` and drops SmolLM2's digit splitting.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level(split_re: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:  # llama.cpp splits every digit off first ("\p{N}")
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split_re is not None:
        steps.append(pre_tokenizers.Split(Regex(split_re), behavior="isolated"))
    # With no explicit split, ByteLevel's own regex is the GPT-2 one (_GPT2_RE).
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_re is None))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


# `tokenizer.ggml.pre` -> pre-tokenizer factory (llama.cpp's llama-vocab.cpp regex table).
_PRE_TOKENIZERS = {
    "default": lambda: _byte_level(),
    "gpt2": lambda: _byte_level(),
    "smollm": lambda: _byte_level(digits=True),
    "starcoder": lambda: _byte_level(digits=True),
    "refact": lambda: _byte_level(digits=True),
    "codeshell": lambda: _byte_level(digits=True),
    "command-r": lambda: _byte_level(digits=True),  # Cohere (Command R, R7B, A)
    "llama-bpe": lambda: _byte_level(_LLAMA3_RE),
    "llama3": lambda: _byte_level(_LLAMA3_RE),
    "qwen2": lambda: _byte_level(_QWEN2_RE),
}


def sentencepiece_merges(
    pieces: Sequence[str], scores: Sequence[float], mergeable: Sequence[bool]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece-BPE scoring, as transformers' `generate_merges`.

    A pair (left, right) is a merge when left, right and left+right are all mergeable pieces;
    merges rank by the score of the merged piece (higher first), then longer left, longer
    right, then piece id, left id, right id. Runs in O(total piece length) dict lookups.
    """
    ids = {p: i for i, p in enumerate(pieces) if mergeable[i]}
    found: list[tuple[float, int, int, int, int, int]] = []
    for piece, i in ids.items():
        score = -float(scores[i])
        n = len(piece)
        for k in range(1, n):
            left = ids.get(piece[:k])
            if left is None:
                continue
            right = ids.get(piece[k:])
            if right is not None:
                found.append((score, -k, k - n, i, left, right))
    found.sort()
    return [(pieces[f[4]], pieces[f[5]]) for f in found]


def _spm_tokenizer(tokens: list[str], meta: Mapping[str, Any], types: Sequence[int]) -> Tokenizer:
    scores = meta["tokenizer.ggml.scores"]
    # llama.cpp spells user-defined whitespace pieces with real spaces; SentencePiece (and
    # HF) spell them with "▁", which is what the normalizer produces.
    for i, t in enumerate(tokens):
        if types[i] == USER_DEFINED and " " in t:
            tokens[i] = t.replace(" ", "▁")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, scores, [ty == NORMAL for ty in types])
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        BPE(
            vocab,
            merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Replace(" ", "▁")]
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", False):  # Llama 2 / Mistral; not Gemma
        steps.insert(0, normalizers.Prepend("▁"))
        dec.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(dec)
    return tok


def _gpt2_tokenizer(tokens: list[str], meta: Mapping[str, Any]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        log.warning("GGUF pre-tokenizer %r unknown; using the GPT-2 regex", pre)
    tok.pre_tokenizer = _PRE_TOKENIZERS.get(pre, _PRE_TOKENIZERS["default"])()
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool
) -> processors.PostProcessor:
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    b = f"{tokens[bos]}:0 " if add_bos else ""
    e = f" {tokens[eos]}:0" if add_eos else ""
    b1, e1 = b.replace(":0", ":1"), e.replace(":0", ":1")
    special = ([(tokens[bos], bos)] if add_bos else []) + ([(tokens[eos], eos)] if add_eos else [])
    return processors.TemplateProcessing(
        single=f"{b}$A:0{e}", pair=f"{b}$A:0{e} {b1}$B:1{e1}", special_tokens=special
    )


def build_tokenizer(meta: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """Fast tokenizer from GGUF metadata (`tokenizer.ggml.*` keys, arrays as sequences)."""
    kind = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if kind == "llama":
        tok = _spm_tokenizer(tokens, meta, types)
        default_add_bos = True
    elif kind == "gpt2":
        tok = _gpt2_tokenizer(tokens, meta)
        default_add_bos = False
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (llama, gpt2)")
    if tok.get_vocab_size() != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")

    # Control tokens are special (matched verbatim, e.g. by chat templates); user-defined
    # ones are atomic pieces matched after normalization, as SentencePiece does.
    tok.add_tokens(
        [
            AddedToken(t, special=types[i] == CONTROL, normalized=types[i] == USER_DEFINED)
            for i, t in enumerate(tokens)
            if types[i] in (CONTROL, USER_DEFINED)
        ]
    )

    def tok_at(key: str) -> tuple[int | None, str | None]:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return (i, tokens[i]) if i is not None and 0 <= i < len(tokens) else (None, None)

    (bos, bos_s), (eos, eos_s) = tok_at("bos"), tok_at("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tokens, bos, eos, add_bos, add_eos)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_s,
        eos_token=eos_s,
        unk_token=tok_at("unknown")[1],
        pad_token=tok_at("padding")[1],
        add_bos_token=add_bos and bos is not None,
        add_eos_token=add_eos and eos is not None,
        clean_up_tokenization_spaces=False,
        model_max_length=int(meta.get(f"{arch}.context_length") or 1 << 30),
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast
