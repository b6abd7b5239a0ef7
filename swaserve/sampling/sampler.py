"""The sampler: one batch of logits rows in, one token per row out (plus raw logprobs).

Processing order (vLLM's):

    raw logits ──► logprobs (raw log_softmax, see logprobs.py)
        │
        ├─ grammar              (structured outputs: tokens it does not allow at -inf)
        ├─ allowed token ids    (vLLM's allowed_token_ids: the others at -inf)
        ├─ logit bias           (OpenAI's logit_bias: a value added to chosen tokens' logits)
        ├─ repetition penalty   (prompt + output tokens; HF: divide positive, multiply negative)
        ├─ frequency/presence   (output tokens; OpenAI: logit -= f * count + p * [count > 0])
        ├─ min_tokens, bad words (eos / stop ids at -inf while fewer than min_tokens
        │                        outputs; the token that would complete a bad word)
        │                        ──► greedy rows: argmax here
        ├─ temperature
        ├─ top-k, top-p, min-p  (masked tokens at -inf)
        └─ exponential race     argmax(probs / q), q ~ Exp(1)   ──► random rows

Per-row parameters become [B] device tensors in one place (`SamplingTensors.from_rows`);
every step after that is vectorised over rows. The only per-row loop on the device is the
seeded noise: a row with its own generator draws its [V] noise from that generator alone,
so the same seed and params give the same tokens whatever else is in the batch
(docs/architecture.md §7).

Invariant: nothing here reads a device tensor back to the host (.item(), .tolist(), .cpu(),
boolean indexing); every branch is decided from the Python-side params. The caller makes
one copy of the `SamplerOutput`.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from swaserve.sampling.bad_words import banned_tokens
from swaserve.sampling.logprobs import compute_logprobs
from swaserve.sampling.params import SamplingParams
from swaserve.sampling.structured import apply_token_bitmask, keep_only


@dataclass
class SamplingRow:
    """One row of logits = one sequence."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request generator when params.seed is set
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # structured outputs: [W] int32 host bitmask of the tokens allowed next (structured.py)
    token_bitmask: Tensor | None = None


def _plain_greedy_row(row: SamplingRow) -> bool:
    """The row is argmax of the raw logits: greedy, no bias or penalty, no min_tokens still due
    (the per-row form of `SamplingTensors.plain_greedy`, read before any tensor is built)."""
    p = row.params
    return (
        p.greedy
        and row.token_bitmask is None
        and not p.edits_logits
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and len(row.output_token_ids) >= p.min_tokens
    )


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64, on the logits' device
    logprobs: Tensor | None = None  # [B] chosen-token logprob (raw log_softmax), if any row asks
    ranks: Tensor | None = None  # [B] int64, 1-based
    topk_ids: Tensor | None = None  # [B, K], K = max logprobs over rows asking
    topk_logprobs: Tensor | None = None  # [B, K]


def row_argmax(x: Tensor, dim: int = -1) -> Tensor:
    """`x.argmax(dim)`: the index of the first maximum, NaN counting as the maximum. On CPU
    `max(dim).indices` gives the same index (documented: the first maximal value) about 3x
    faster than aten::argmax on [16, 262144] float32 (2.8 -> 1.1 ms, and 4.6 -> 0.9 ms on a
    strided view): a greedy CPU decode step of Gemma 3 spent ~4% of its time in argmax."""
    if x.device.type == "cpu":
        return x.max(dim=dim).indices
    return x.argmax(dim=dim)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator for a seeded request, on the device the logits live on."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SamplingTensors:
    """One batch's per-row params as device tensors, built once per step from the rows.

    Greedy rows carry neutral values (temperature 1, no top-k/top-p/min-p): they are
    argmax'ed before temperature, so those values only keep the vectorised math finite.
    Fields that no row uses are None and the matching step is skipped.
    """

    greedy: Tensor  # [B] bool
    temperature: Tensor  # [B] float32
    top_k: Tensor | None  # [B] int64 in [1, V]; V = off
    # Largest k over the rows when it bounds every row's kept set (each row using top-p
    # also uses top-k), so a partial topk can replace the full sort; None otherwise.
    max_top_k: int | None
    top_p: Tensor | None  # [B] float32 in (0, 1]; 1 = off
    min_p: Tensor | None  # [B] float32 in [0, 1]; 0 = off
    logit_bias_at: Tensor | None  # flat indices into logits.view(-1) of biased tokens
    logit_bias: Tensor | None  # float32 values added there
    allowed_rows: Tensor | None  # [A] int64: rows with allowed_token_ids
    allowed_at: Tensor | None  # flat indices into their [A, V] block of the allowed tokens
    grammar_rows: Tensor | None  # [R] int64: the rows held to a grammar
    grammar_bitmask: Tensor | None  # [R, W] int32: their allowed tokens (structured.py)
    repetition_penalty: Tensor | None  # [B] float32; 1 = off
    repetition_mask: Tensor | None  # [B, V] bool: token seen in prompt or output
    frequency_penalty: Tensor | None  # [B] float32
    presence_penalty: Tensor | None  # [B] float32
    output_counts: Tensor | None  # [B, V] float32: occurrences in the output so far
    # flat indices into logits.view(-1) to set to -inf: min_tokens' stop ids, bad words
    min_tokens_fill: Tensor | None
    seeded_rows: list[tuple[int, torch.Generator]]  # random rows with their own generator
    any_unseeded_random: bool
    all_greedy: bool
    any_greedy: bool
    max_num_logprobs: int | None  # None: no row asks for logprobs

    @property
    def plain_greedy(self) -> bool:
        """Every row is argmax of the raw logits: no bias, penalties or min_tokens masking."""
        return (
            self.all_greedy
            and self.grammar_rows is None
            and self.logit_bias is None
            and self.allowed_rows is None
            and self.repetition_penalty is None
            and self.frequency_penalty is None
            and self.min_tokens_fill is None
        )

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Iterable[int] = (),
    ) -> SamplingTensors:
        V = vocab_size
        eos = set(eos_token_ids)
        greedy, temps, top_ks, top_ps, min_ps = [], [], [], [], []
        seeded_rows: list[tuple[int, torch.Generator]] = []
        any_unseeded_random = False
        rep_rows, freq_pres_rows = [], []
        min_tokens_fill: list[int] = []
        bias_at: list[int] = []
        grammar_rows: list[int] = []
        allowed_rows: list[int] = []
        allowed_at: list[int] = []
        bias: list[float] = []
        max_num_logprobs: int | None = None
        for i, row in enumerate(rows):
            p = row.params
            g = p.greedy
            greedy.append(g)
            temps.append(1.0 if g else p.temperature)
            top_ks.append(V if g or p.top_k == 0 else min(p.top_k, V))
            top_ps.append(1.0 if g else p.top_p)
            min_ps.append(0.0 if g else p.min_p)
            if not g:
                if p.seed is not None:
                    if row.generator is None:
                        raise ValueError(f"row {i} has seed={p.seed} but no generator")
                    seeded_rows.append((i, row.generator))
                else:
                    any_unseeded_random = True
            if row.token_bitmask is not None:
                grammar_rows.append(i)
            if p.allowed_token_ids is not None:
                base = len(allowed_rows) * V
                allowed_rows.append(i)
                allowed_at.extend(base + t for t in p.allowed_token_ids if t < V)
            if p.logit_bias is not None:
                for t, b in p.logit_bias.items():
                    if t < V:  # ids past the vocabulary: refused where requests come in
                        bias_at.append(i * V + t)
                        bias.append(b)
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                freq_pres_rows.append(i)
            banned = set()
            if len(row.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | eos
                if row.token_bitmask is not None and not _allows_other(row.token_bitmask, banned):
                    # a complete grammar allows only the end: it ends the request, as the stop
                    # rule lets it before min_tokens (no row of -inf)
                    banned = set()
            if p.bad_words_token_ids:
                banned |= banned_tokens(p.bad_words_token_ids, row.output_token_ids)
            min_tokens_fill.extend(i * V + t for t in sorted(banned) if 0 <= t < V)
            if p.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, p.logprobs)

        B = len(rows)

        def f32(xs: list[float]) -> Tensor:
            return _to_device(torch.tensor(xs, dtype=torch.float32), device)

        def longs(xs: list[int]) -> Tensor | None:
            return _to_device(torch.tensor(xs, dtype=torch.long), device) if xs else None

        repetition_penalty = repetition_mask = None
        if rep_rows:
            repetition_penalty = f32([r.params.repetition_penalty for r in rows])
            seen = [(i, rows[i].prompt_token_ids) for i in rep_rows]
            seen += [(i, rows[i].output_token_ids) for i in rep_rows]
            repetition_mask = _token_counts(seen, B, V, device) > 0
        frequency_penalty = presence_penalty = output_counts = None
        if freq_pres_rows:
            frequency_penalty = f32([r.params.frequency_penalty for r in rows])
            presence_penalty = f32([r.params.presence_penalty for r in rows])
            outputs = [(i, rows[i].output_token_ids) for i in freq_pres_rows]
            output_counts = _token_counts(outputs, B, V, device)

        return cls(
            greedy=_to_device(torch.tensor(greedy, dtype=torch.bool), device),
            temperature=f32(temps),
            top_k=(
                _to_device(torch.tensor(top_ks, dtype=torch.long), device)
                if any(k < V for k in top_ks)
                else None
            ),
            max_top_k=(
                max((k for k in top_ks if k < V), default=V)
                if all(k < V for k, p in zip(top_ks, top_ps) if p < 1.0)
                else None
            ),
            top_p=f32(top_ps) if any(p < 1.0 for p in top_ps) else None,
            min_p=f32(min_ps) if any(p > 0.0 for p in min_ps) else None,
            logit_bias_at=longs(bias_at),
            logit_bias=f32(bias) if bias else None,
            allowed_rows=longs(allowed_rows),
            allowed_at=(  # may be empty (every id past the vocabulary): all banned
                _to_device(torch.tensor(allowed_at, dtype=torch.long), device)
                if allowed_rows
                else None
            ),
            grammar_rows=longs(grammar_rows),
            grammar_bitmask=(
                _to_device(torch.stack([rows[i].token_bitmask for i in grammar_rows]), device)
                if grammar_rows
                else None
            ),
            repetition_penalty=repetition_penalty,
            repetition_mask=repetition_mask,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            output_counts=output_counts,
            min_tokens_fill=longs(min_tokens_fill),
            seeded_rows=seeded_rows,
            any_unseeded_random=any_unseeded_random,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            max_num_logprobs=max_num_logprobs,
        )


def _allows_other(bitmask: Tensor, tokens: set[int]) -> bool:
    """The [W] int32 host bitmask (bit t of word t // 32: token t allowed) allows a token
    outside `tokens`."""
    words: dict[int, int] = {}
    for t in tokens:
        w = t >> 5
        if w < bitmask.shape[0]:
            words[w] = words.get(w, int(bitmask[w]) & 0xFFFFFFFF) & ~(1 << (t & 31))
    if any(words.values()):
        return True
    others = int(torch.count_nonzero(bitmask))
    return others > sum(1 for w in words if int(bitmask[w]) != 0)


def _to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """Host tensor to `device` without a stream sync. The source is pageable memory, which
    CUDA stages before cudaMemcpyAsync returns, so the host may drop it right away; a
    blocking copy would instead wait for the whole queued forward pass."""
    return t.to(device, non_blocking=True)


def _token_counts(
    row_tokens: Sequence[tuple[int, Sequence[int]]],
    num_rows: int,
    vocab_size: int,
    device: torch.device | str,
) -> Tensor:
    """[num_rows, V] float32 occurrence counts of each (row, token list) pair's tokens.

    The host only concatenates the lists (through `array`, ~10x faster than torch.tensor on
    a list) and copies them once; the flat index row * V + token is built on the device and
    scatter-added there (bincount would sync on CUDA to size its output). Ids outside
    [0, V) go to one spill slot past the end, dropped, so they never touch a neighbour row.
    """
    V = vocab_size
    flat = array.array("q")
    row_ids: list[int] = []
    lengths: list[int] = []
    for row, tokens in row_tokens:
        flat.extend(tokens)
        row_ids.append(row)
        lengths.append(len(tokens))
    counts = torch.zeros(num_rows * V + 1, dtype=torch.float32, device=device)
    if flat:
        tok = _to_device(torch.frombuffer(flat, dtype=torch.int64), device)
        row = torch.repeat_interleave(
            _to_device(torch.tensor(row_ids), device),
            _to_device(torch.tensor(lengths), device),
            output_size=len(flat),  # known here: no sync to size the output
        )
        idx = torch.where((tok >= 0) & (tok < V), row * V + tok, num_rows * V)
        counts.index_add_(0, idx, torch.ones(idx.shape[0], dtype=torch.float32, device=device))
    return counts[:-1].view(num_rows, V)


def apply_penalties(logits: Tensor, t: SamplingTensors) -> None:
    """The grammar's mask, the allowed token ids, logit bias, repetition, frequency and
    presence penalties and min_tokens masking, in place (masks and bias first, as vLLM applies
    its grammar bitmask and logits processors before its penalties)."""
    if t.grammar_rows is not None:
        apply_token_bitmask(logits, t.grammar_rows, t.grammar_bitmask)
    if t.allowed_rows is not None:
        allowed = torch.zeros(t.allowed_rows.shape[0], logits.shape[1], dtype=torch.bool,
                              device=logits.device)
        allowed.view(-1).index_fill_(0, t.allowed_at, True)
        keep_only(logits, t.allowed_rows, allowed)
    if t.logit_bias is not None:
        logits.view(-1).index_add_(0, t.logit_bias_at, t.logit_bias)
    if t.repetition_penalty is not None:
        rp = t.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits.copy_(torch.where(t.repetition_mask, penalised, logits))
    if t.frequency_penalty is not None:
        counts = t.output_counts
        logits -= t.frequency_penalty.unsqueeze(1) * counts
        logits -= t.presence_penalty.unsqueeze(1) * (counts > 0)
    if t.min_tokens_fill is not None:
        logits.view(-1).index_fill_(0, t.min_tokens_fill, float("-inf"))


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, max_top_k: int | None = None
) -> None:
    """Mask (to -inf, in place) tokens outside each row's top-k, then outside its top-p.

    top_k [B] int64 in [1, V] (V = off). top_p [B] in (0, 1] (1 = off): keeps the smallest
    best-first prefix of the top-k-renormalised distribution whose mass reaches p, i.e. a
    token survives iff the mass sorted before it is < p. The best token always survives.

    Both rules keep a best-first prefix, so each row reduces to one cutoff logit and the mask
    is `logits < cutoff`: tokens tied with the cutoff are all kept (top-k too may keep more
    than k then), and no scatter back from sorted order is needed.

    Candidates, best first: a full sort of the vocabulary, or, when `max_top_k` is given, a
    partial topk of that many. The caller passes max_top_k only when it bounds every row's
    kept set: every row using top-p also uses top-k, and max_top_k >= each such k.
    """
    if top_k is None and top_p is None:
        return
    V = logits.shape[-1]
    if max_top_k is not None and max_top_k < V:
        cand = logits.topk(max_top_k, dim=-1).values  # [B, M], best first
    else:
        cand = logits.sort(dim=-1, descending=True).values  # [B, V]
    B, M = cand.shape
    drop = torch.zeros_like(cand, dtype=torch.bool)
    untouched = torch.ones(B, dtype=torch.bool, device=logits.device)
    if top_k is not None:
        pos = torch.arange(M, device=logits.device)
        drop |= pos.unsqueeze(0) >= top_k.unsqueeze(1)
        untouched &= top_k >= V
    if top_p is not None:
        probs = cand.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exclusive prefix sum, best first
        drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        untouched &= top_p >= 1.0
    # Kept = a non-empty prefix: the best token always survives (k >= 1, and mass_before[0]
    # is 0 < p, except for a p so small that it is 0 in float32: keep it then too).
    drop[:, 0] = False
    num_kept = (~drop).sum(dim=-1, keepdim=True)
    cutoff = cand.gather(1, num_kept - 1)
    # Rows with neither filter keep everything (with a partial topk, cand would cut them).
    cutoff.masked_fill_(untouched.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < cutoff, float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor | None) -> None:
    """Mask (in place) tokens with prob < min_p * max prob, in logit space.

    p_i / p_max = exp(l_i - l_max), so the rule is l_i < l_max + log(min_p); min_p == 0 gives
    log 0 = -inf and keeps everything. The ratio does not change under renormalisation, so
    it is the same before or after top-k/top-p.
    """
    if min_p is None:
        return
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


class Sampler:
    """Samples one token per row of logits; see the module docstring for the order.

    `eos_token_ids` are masked, with the request's stop_token_ids, while a request has fewer
    than min_tokens outputs (unless it sets ignore_eos). Rows without a seed share one
    default generator, seeded from `seed`; with seed None they use torch's global RNG.
    """

    def __init__(self, eos_token_ids: Iterable[int] = (), seed: int | None = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _default_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if device not in self._generators:
            self._generators[device] = make_generator(self.seed, device)
        return self._generators[device]

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all(map(_plain_greedy_row, rows)) and not any(r.params.logprobs is not None
                                                         for r in rows):
            # argmax of the raw logits, as below, without building [B] parameter tensors (and
            # their host-to-device copies) that it would not read
            return SamplerOutput(token_ids=row_argmax(logits))
        t = SamplingTensors.from_rows(rows, logits.shape[1], logits.device, self.eos_token_ids)

        if t.plain_greedy:
            token_ids = row_argmax(logits)  # fast path: no copy, no softmax, no sort
        else:
            # A contiguous float32 copy: the raw logits stay intact for logprobs, and the
            # min_tokens fill indexes the flat view.
            x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            apply_penalties(x, t)
            if t.all_greedy:
                token_ids = row_argmax(x)
            else:
                # Greedy rows: argmax before temperature and masking (neither moves it).
                greedy_ids = row_argmax(x) if t.any_greedy else None
                x.div_(t.temperature.unsqueeze(1))
                apply_top_k_top_p(x, t.top_k, t.top_p, t.max_top_k)
                apply_min_p(x, t.min_p)
                token_ids = self._exponential_race(x, t)
                if greedy_ids is not None:
                    token_ids = torch.where(t.greedy, greedy_ids, token_ids)

        out = SamplerOutput(token_ids=token_ids)
        if t.max_num_logprobs is not None:
            out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs = compute_logprobs(
                logits, token_ids, t.max_num_logprobs
            )
        return out

    def target_logits(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """The distribution each row samples from, as float32 logits (for verifying drafts):
        penalties and min_tokens masking, then temperature, top-k/top-p and min-p for random
        rows (greedy rows carry neutral values there, so their argmax is the greedy token).
        Masked tokens are -inf. When every row is plain greedy, `logits` itself."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all(map(_plain_greedy_row, rows)):
            return logits  # argmax of the raw logits: nothing to apply (not a copy)
        t = SamplingTensors.from_rows(rows, logits.shape[1], logits.device, self.eos_token_ids)
        if t.plain_greedy:  # min_tokens still due, but nothing to ban (no stop or EOS ids)
            return logits
        x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        apply_penalties(x, t)
        if not t.all_greedy:
            x.div_(t.temperature.unsqueeze(1))
            apply_top_k_top_p(x, t.top_k, t.top_p, t.max_top_k)
            apply_min_p(x, t.min_p)
        return x

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of rows without a seed (None: torch's global RNG)."""
        return self._default_generator(device)

    def _exponential_race(self, logits: Tensor, t: SamplingTensors) -> Tensor:
        """argmax(probs / q) with q ~ Exp(1): an exact sample from probs, one noise draw per row.

        Seeded rows draw their [V] noise from their own generator only, so their tokens do not
        depend on the batch. Masked tokens have prob exactly 0 and q > 0 after the clamp, so
        they score 0 and never beat the best unmasked token (whose score is > 0).
        """
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        if t.any_unseeded_random:
            q.exponential_(generator=self._default_generator(probs.device))
        for i, gen in t.seeded_rows:
            q[i].exponential_(generator=gen)
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return row_argmax(probs.div_(q))
