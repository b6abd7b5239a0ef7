"""Structured outputs: a request's tokens held to a grammar (a JSON schema, any JSON object, a
regular expression, a choice of strings, an EBNF grammar, or a structural tag), through
xgrammar, as vLLM and SGLang do.

A structural tag (xgrammar's `StructuralTag`) mixes free text with constrained parts, e.g.
"anything, but once `<tool_call>` is written, a call whose arguments keep to a schema". Its
spec value is the tag as JSON text in xgrammar's form, `{"type": "structural_tag", "format":
{...}}`; the legacy form vLLM and SGLang still take (`structures` of {begin, schema, end} and
`triggers`) is turned into it by `normalise` (a `triggered_tags` format, as xgrammar's own
`StructuralTag.from_legacy_structural_tag`).

One request, one `GrammarMatcher`: before each sampled token the matcher writes which tokens
may come next as a bitmask (bit t % 32 of int32 word t // 32), the sampler sets every other
token's logit to -inf (`apply_token_bitmask`, first of its edits), and the token sampled is
then fed back (`Grammars.advance`). So the engine must know each token's value before it
samples the next: such requests read the history (no overlap for their steps, as penalties).
Under speculative decoding their drafts are cut at the first one the grammar refuses
(`valid_prefix`), and each verify row gets the mask of the state after the drafts before it
(`bitmasks`), so a verify step samples every row from the distribution a plain step would.
A matcher
that completes its grammar (its stop token accepted, or nothing more can follow) ends the
request with finish_reason "stop".

`normalise` is the one validation of the spec (SamplingParams); `check_syntax` compiles nothing
but parses it, so that the server answers a bad schema with a 400 before the request reaches the
engine; `Grammars` (one per engine core) compiles against the model's tokenizer, cached (the
MAX_CACHED_GRAMMARS most recently used).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

# The spec's kinds (vLLM's `structured_outputs` names); exactly one per request.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
ANY_OBJECT = '{"type": "object", "additionalProperties": true}'
# Whitespace between JSON tokens, at most this many characters in a row: pretty-printed JSON
# fits, and a model that would loop on newlines (Gemma 3 270M after "{" does) must go on.
MAX_JSON_WHITESPACE = 20
# Compiled grammars an engine core keeps, least recently used dropped first: a server that sees
# a new schema (or set of tools) with every request must not grow without bound. A dropped one
# is compiled again when asked for (0.3-6 ms on smollm2's vocabulary); running requests keep
# their matchers, which hold their grammar.
MAX_CACHED_GRAMMARS = 256
# Deepest nesting (objects and arrays) of a JSON schema or structural tag: xgrammar's compile
# time grows steeply with it (measured on the 2-core VM: 0.8 s at 100 levels, 10 s at 600,
# 34 s at 900, one request holding the grammar thread meanwhile); real schemas stay far below.
MAX_JSON_DEPTH = 128


def normalise(spec: Any) -> dict[str, Any] | None:
    """A spec as SamplingParams keeps it: {"json": schema as JSON text} | {"json_object": True}
    | {"regex": str} | {"choice": [str, ...]} | {"grammar": EBNF str} | {"structural_tag":
    xgrammar's form as JSON text (`structural_tag`)}; None for none. Raises ValueError naming
    `structured_outputs`."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be an object, got {spec!r}")
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise ValueError(f"structured_outputs takes one of {list(KINDS)}, got {unknown}")
    if len(given) != 1:
        raise ValueError(
            f"structured_outputs takes exactly one of {list(KINDS)}, got {sorted(given) or 'none'}"
        )
    (kind, value), = given.items()
    if kind == "json":
        if isinstance(value, str):
            parsed = _loads(value, "structured_outputs json")
        elif isinstance(value, dict):
            parsed = value
        else:
            raise ValueError(f"structured_outputs json must be a JSON schema, got {value!r}")
        _check_depth(kind, parsed)
        if isinstance(value, dict):
            value = json.dumps(value)
    elif kind == "json_object":
        if value is not True:
            raise ValueError(f"structured_outputs json_object must be true, got {value!r}")
    elif kind == "structural_tag":
        tag = structural_tag(value)
        _check_depth(kind, tag)
        value = json.dumps(tag)
    elif kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c
                                                          for c in value)):
            raise ValueError(
                f"structured_outputs choice must be a non-empty list of non-empty strings, got "
                f"{value!r}"
            )
        value = list(value)
    elif not (isinstance(value, str) and value):
        raise ValueError(f"structured_outputs {kind} must be a non-empty string, got {value!r}")
    return {kind: value}


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None


def _check_depth(kind: str, value: Any) -> None:
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"structured_outputs {kind} nests deeper than {MAX_JSON_DEPTH} levels")


def json_depth(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (0 for a scalar); no recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is not None:
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in items)
    return deepest


def structural_tag(value: Any) -> dict[str, Any]:
    """A structural tag (a dict, or its JSON text) in xgrammar's form, {"type":
    "structural_tag", "format": {...}}; the legacy form {"type": "structural_tag", "structures":
    [{"begin", "schema", "end"}, ...], "triggers": [...]} becomes a `triggered_tags` format (text
    until a trigger, then the tag whose `begin` it starts). Only the outer shape is checked here:
    the format itself is xgrammar's to judge (`check_syntax`). ValueError naming
    `structured_outputs structural_tag`."""
    what = "structured_outputs structural_tag"
    if isinstance(value, str):
        value = _loads(value, what)
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be an object, got {value!r}")
    if value.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f'{what} type must be "structural_tag", got {value["type"]!r}')
    keys = set(value) - {"type"}
    if keys == {"format"}:
        if not isinstance(value["format"], dict):
            raise ValueError(f"{what} format must be an object, got {value['format']!r}")
        return {"type": "structural_tag", "format": value["format"]}
    if keys != {"structures", "triggers"}:
        raise ValueError(f'{what} takes "format", or "structures" and "triggers" (the legacy '
                         f"form), got {sorted(keys) or 'neither'}")  # fmt: skip
    structures, triggers = value["structures"], value["triggers"]
    if not (isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)):  # fmt: skip
        raise ValueError(f"{what} triggers must be a non-empty list of non-empty strings, got "
                         f"{triggers!r}")  # fmt: skip
    if not (isinstance(structures, list) and structures
            and all(_is_structure(s) for s in structures)):  # fmt: skip
        raise ValueError(f'{what} structures must be a non-empty list of {{"begin": str, '
                         f'"schema": object, "end": str}}, got {structures!r}')  # fmt: skip
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": s["schema"]}}
            for s in structures]  # fmt: skip
    fmt = {"type": "triggered_tags", "triggers": list(triggers), "tags": tags}
    return {"type": "structural_tag", "format": fmt}


def _is_structure(s: Any) -> bool:
    return (isinstance(s, dict) and set(s) == {"begin", "schema", "end"}
            and isinstance(s["begin"], str) and s["begin"] and isinstance(s["end"], str)
            and isinstance(s["schema"], dict))  # fmt: skip


def _grammar(spec: dict[str, Any]) -> Any:
    """The xgrammar `Grammar` of a normalised spec (no tokenizer: syntax only)."""
    import xgrammar as xgr

    (kind, value), = spec.items()
    if kind == "json":
        return xgr.Grammar.from_json_schema(value, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if kind == "json_object":  # OpenAI's: an object (xgrammar's built-in JSON takes any value)
        return xgr.Grammar.from_json_schema(ANY_OBJECT, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(value)
    if kind == "choice":
        literals = (json.dumps(c, ensure_ascii=False) for c in value)  # EBNF takes C escapes
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(literals))
    return xgr.Grammar.from_ebnf(value)


def check_syntax(spec: dict[str, Any]) -> None:
    """ValueError naming structured_outputs when xgrammar cannot parse the spec."""
    try:
        _grammar(spec)
    except Exception as e:  # xgrammar raises RuntimeError or its own errors on bad input
        (kind, _), = spec.items()
        raise ValueError(f"structured_outputs {kind} cannot be used: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix."""
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", text)[:300]


class Grammars:
    """One engine core's grammar compiler: the tokenizer's vocabulary read once (at the first
    structured request), compiled grammars cached by spec. `compile_async` compiles on a
    thread of its own (xgrammar releases the GIL while it compiles), so that a server's core
    loop keeps stepping the running requests meanwhile; the cache and the compiler's creation
    are locked, the compiles themselves are not."""

    def __init__(self, tokenizer_loader: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # spec -> grammar, LRU
        self._lock = threading.Lock()  # the cache
        self._compiler_lock = threading.Lock()  # one TokenizerInfo, built once
        self._pool: ThreadPoolExecutor | None = None  # compile_async's thread, made at first use

    def matcher(self, spec: dict[str, Any]) -> Any:
        """A fresh `GrammarMatcher` for the spec (`compile`)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def compile(self, spec: dict[str, Any]) -> Any:
        """The spec's compiled grammar, cached; ValueError naming structured_outputs when it
        does not compile."""
        key = json.dumps(spec, sort_keys=True)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        try:
            compiled = self._compiler_now().compile_grammar(_grammar(spec))
        except ValueError:
            raise
        except Exception as e:
            (kind, _), = spec.items()
            raise ValueError(
                f"structured_outputs {kind} cannot be used: {_first_line(e)}"
            ) from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def compile_async(self, spec: dict[str, Any]) -> Future | None:
        """None when the spec's grammar is cached; else a future of `compile(spec)` on the
        compiler thread (its exception: compile's ValueError). Once it is done the grammar is
        cached (unless MAX_CACHED_GRAMMARS others came after it)."""
        with self._lock:
            if json.dumps(spec, sort_keys=True) in self._compiled:
                return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="swaserve-grammar")
        return self._pool.submit(self.compile, spec)

    def _compiler_now(self) -> Any:
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                tok = self._load_tokenizer()
                if tok is None:
                    raise ValueError("structured_outputs needs the model's tokenizer; it has none")
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def bitmasks(self, matcher: Any, drafts: list[int]) -> Tensor:
        """[len(drafts) + 1, W] int32 host bitmasks of the tokens the matcher allows next, then
        after each draft in turn (a verify step's rows); the matcher ends where it began.
        The drafts must keep to the grammar (`valid_prefix`)."""
        import xgrammar as xgr

        masks = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        for i, token in enumerate(drafts):
            matcher.fill_next_token_bitmask(masks, i)
            if not matcher.accept_token(token):
                raise AssertionError(f"draft {token} breaks the grammar: valid_prefix first")
        matcher.fill_next_token_bitmask(masks, len(drafts))
        if drafts:
            matcher.rollback(len(drafts))
        return masks

    @staticmethod
    def valid_prefix(matcher: Any, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar takes from the matcher's state (which
        it leaves as it was), short of a draft that would complete it (its stop token): a
        complete matcher has no next mask for the verify row after it, and the stop token is
        then sampled at its own row. Speculative decoding verifies only drafts that could be
        sampled."""
        n = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            if matcher.is_terminated():
                matcher.rollback(1)
                break
            n += 1
        if n:
            matcher.rollback(n)
        return drafts[:n]

    @staticmethod
    def advance(matcher: Any, token: int) -> bool:
        """Feed the sampled token; True when the request must end here: the grammar is
        complete, or (with a warning) the token breaks it, which the mask prevents unless
        every allowed token was masked otherwise (min_tokens banning the stop token)."""
        if not matcher.accept_token(token):
            log.warning("structured output: token %d breaks the grammar; the request ends", token)
            return True
        return matcher.is_terminated()


def apply_token_bitmask(logits: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """logits [B, V]: rows `rows` [R] (int64) keep only the tokens set in `bitmask` [R, W]
    (int32, on the logits' device); the others become -inf, in place. Token ids past W * 32
    (none: W covers the vocabulary) and bits past V are ignored."""
    V = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :V].bool()
    keep_only(logits, rows, allowed)


def keep_only(logits: Tensor, rows: Tensor, allowed: Tensor) -> None:
    """logits [B, V]: rows `rows` [R] keep the tokens `allowed` [R, V] (bool) marks; the
    others become -inf, in place."""
    sub = logits.index_select(0, rows)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, rows, sub)
