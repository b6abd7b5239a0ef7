"""The engine's side of speculative decoding (docs/architecture.md §8): drafts before a step,
the verify rows' distributions and acceptance after its forward. EngineCore commits what comes
back.

A request in decode (one known token not computed: `last`) gets up to K drafts; the
scheduler then gives it the chunk [last, d_1..d_K] at positions c..c+K, like any chunk. Every
sampling request of a step goes through `sample`: a request with K_r drafts has K_r + 1
rows, one without (a prefill that completes its prompt, or no draft found) has one, and
`verify_drafts` returns the tokens to commit (accepted drafts, then one of the target's own).

Row i of request r is sampled as if d_1..d_i were already its outputs (penalties and
min_tokens see them), so a verified token is drawn exactly as plain decoding would draw it.

Draft length. K_r = min(K, the step's token budget - 1, max_tokens - outputs - 1, context
left - 1): a function of the request alone, so a seeded request's draws never depend on
the batch (the scheduler runs its whole chunk or waits).

DFlash drafts stay on the device when nothing needs their values on the host first
(`on_device`: one process, and no live request with penalties, which read the tokens before
each verify row): the request holds placeholders of its k drafts, the forward's input ids
take the values on the device (`draft_fill`, as the overlap schedule fills the tokens of the
step in flight), `verify_drafts` reads them there, and the host learns the accepted ones from
the verify's one read-back. So the host prepares the verify while the drafter runs, with no
sync between them.

The overlap schedule is off for steps that draft: the next step's chunk depends on how many
drafts this one accepted, known only once its tokens are back on the host, and a drafter needs
the last token's value. Steps where no request drafts (the gate turned drafting off at this
batch size, speculative/gate.py) overlap like plain decoding; a step that will draft first
reads the one in flight back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from swaserve.engine.forward_batch import DeviceTokens
from swaserve.engine.request import PLACEHOLDER, Request
from swaserve.memory.kv_pool import KVPool
from swaserve.memory.manager import MemoryManager
from swaserve.sampling.logprobs import compute_logprobs
from swaserve.sampling.sampler import Sampler, SamplingRow
from swaserve.sampling.structured import Grammars
from swaserve.speculative.dflash_config import DFlashConfig, check_num_draft_tokens
from swaserve.speculative.dflash_proposer import DFlashProposer
from swaserve.speculative.gate import DraftGate
from swaserve.speculative.metrics import SpecStats
from swaserve.speculative.ngram import NgramDrafter
from swaserve.speculative.verify import verify_drafts

NGRAM_DEFAULT_DRAFTS = 4


def num_draft_tokens(config, dflash: DFlashConfig | None = None) -> int:
    """K, the drafts per verify step, for a config: 0 without speculation; the n-gram
    drafter's flag or default; DFlash's flag (1..block_size - 1) or block_size - 1 from its
    checkpoint (`dflash`: its config); either within the token budget (a verify chunk is K + 1
    tokens). Under expert parallelism every process of a rank sizes its MoE decode workspace
    for K + 1 tokens a request with it (EngineCore._start_decode_workspace, and the -tp
    workers' ep_tp.attach_worker): a worker's K that differed from its core's would pad the
    fixed-path collectives to other shapes."""
    algo = config.speculative_algorithm
    if algo is None:
        return 0
    if algo == "ngram":
        k = config.speculative_num_draft_tokens or NGRAM_DEFAULT_DRAFTS
    elif algo == "dflash" and dflash is not None:
        k = check_num_draft_tokens(config.speculative_num_draft_tokens, dflash)
    else:
        raise ValueError(f"--speculative-algorithm {algo}: not available in this build")
    return min(k, config.max_num_batched_tokens - 1)


@dataclass
class DeviceDrafts:
    """A step's DFlash drafts on the device: request r's are ids[rows[id(r)], :k_r], where it
    holds k_r placeholders (the scheduler may cut them to fewer)."""

    ids: Tensor  # [R, B - 1]
    rows: dict[int, int]


@dataclass
class Verified:
    """One step's verify results on the host, per sampling request."""

    token_ids: list[list[int]]  # accepted drafts, then the target's token
    num_drafts: list[int]  # drafts verified
    logprobs: list[list[tuple[float, int, list[int], list[float]]]] | None  # per committed row


class Speculation:
    def __init__(
        self,
        config,
        sampler: Sampler,
        max_model_len: int,
        memory: MemoryManager | None = None,
        kv: KVPool | None = None,
        dflash: DFlashProposer | None = None,
    ) -> None:
        """`dflash`: the DFlash proposer (its drafter's K/V in `kv`, pages from `memory`);
        otherwise the n-gram drafter. `drafter` (an object with `propose(tokens, k)`) wins
        over DFlash when set (tests plant oracle drafters there)."""
        self.dflash = dflash
        self.drafter = None
        if config.speculative_algorithm == "ngram":
            self.drafter = NgramDrafter(config.speculative_ngram_min, config.speculative_ngram_max)
        self.k = num_draft_tokens(config, dflash.cfg if dflash is not None else None)
        self.gate = None if config.disable_adaptive_speculation else DraftGate()
        self.step_drafts = True  # this step's choice (decide)
        self.step_forced = False  # seeded sampling requests live: they draft regardless
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.memory, self.kv = memory, kv
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request -> (tokens, count)
        # DFlash drafts may stay on the device (module docstring): set by the engine when it
        # runs in one process; `device_drafts` holds this step's
        self.on_device = False
        self.device_drafts: DeviceDrafts | None = None

    # ---- before the step ------------------------------------------------------------------

    def decide(self, batch_size: int, seeded_sampling: bool) -> bool:
        """This step's choice (once per step, before `propose`; O(1): the step loop's host
        time is the batch's): whether the gate lets greedy and unseeded requests draft at
        this batch size. Returns whether any request may draft, i.e. whether the step in
        flight must be read back first (a drafter needs the last token's value); seeded
        sampling requests (`seeded_sampling`: some are live) always draft."""
        self.step_drafts = self.gate is None or self.gate.choose(batch_size)
        self.step_forced = seeded_sampling
        return self.step_drafts or seeded_sampling

    def propose(self, running: list[Request], history: bool = False) -> None:
        """Drafts for the running requests in decode (the rest get none), as `decide` chose:
        all of them, or, where the gate measured that drafting loses at this batch size, only
        seeded sampling requests (whose tokens must not depend on the batch: gate.py).
        `history`: a live request's sampling reads token values (DFlash drafts then come to
        the host)."""
        self.device_drafts = None
        for req in running:  # none keeps a draft it did not verify (the next step may overlap)
            req.draft_token_ids = []
        if not (self.step_drafts or self.step_forced):
            return
        arrays = {}
        batch: list[tuple[Request, int]] = []  # DFlash: drafted together below
        for req in _decoding(running):  # after the read-back: requests that finished left
            if not self.step_drafts and _follows_gate(req):
                if req.request_id in self._arrays:  # keep the n-gram lookup's token array
                    arrays[req.request_id] = self._arrays[req.request_id]
                continue
            k = min(
                self.k,
                req.max_tokens - len(req.output_token_ids) - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if k <= 0:
                continue
            if self.drafter is None:
                batch.append((req, k))
                continue
            tokens = arrays[req.request_id] = self._tokens_of(req)
            drafts = self.drafter.propose(tokens[0][: tokens[1]], k)
            req.draft_token_ids = _grammar_drafts(req, drafts)
        self._arrays = arrays  # requests that left drop out here
        if not batch:
            return
        reqs, ks = [r for r, _ in batch], [k for _, k in batch]
        if self.on_device and not history:
            ids = self.dflash.propose_on_device(reqs, ks, self.memory, self.kv)
            for req, k in zip(reqs, ks):
                req.draft_token_ids = [PLACEHOLDER] * k
            self.device_drafts = DeviceDrafts(ids, {id(r): i for i, r in enumerate(reqs)})
            return
        for req, drafts in zip(reqs, self.dflash.propose(reqs, ks, self.memory, self.kv)):
            req.draft_token_ids = _grammar_drafts(req, drafts)

    def draft_fill(self, requests: list[Request], num_new_tokens: list[int]) -> DeviceTokens | None:
        """The forward's input ids that are device drafts: a request's chunk [last, d_1..d_k]
        at packed offset o holds draft i at o + i (None: no device drafts in the step)."""
        dd = self.device_drafts
        if dd is None:
            return None
        width = dd.ids.shape[1]
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        for req, n in zip(requests, num_new_tokens):
            row, k = dd.rows.get(id(req)), len(req.draft_token_ids)
            if row is not None and k:
                dst.extend(range(offset + 1, offset + 1 + k))
                src.extend(range(row * width, row * width + k))
            offset += n
        return DeviceTokens(dst, src, dd.ids.reshape(-1)) if dst else None

    # ---- the gate's measurements (speculative/gate.py) -------------------------------------

    def record_step(self, num_new_tokens: list[int], verified: Verified | None,
                    seconds: float) -> None:
        """After a step: its committed tokens and wall time to the gate, if it was
        decode-only (every chunk the last token plus its drafts) and drafted as the gate
        chose. Plain steps commit one token a request; O(1) host work for them."""
        n = len(num_new_tokens)
        if self.gate is None or n == 0:
            return
        if verified is None:
            if sum(num_new_tokens) == n:
                self.gate.record(n, self.step_drafts, n, seconds)
        elif self.step_drafts and sum(num_new_tokens) == n + sum(verified.num_drafts):
            self.gate.record(n, True, sum(len(t) for t in verified.token_ids), seconds)

    def _tokens_of(self, req: Request) -> tuple[np.ndarray, int]:
        """The request's committed tokens as an int64 array, extended in place as outputs are
        committed (committed tokens never change), grown by doubling."""
        buf, have = self._arrays.get(req.request_id, (None, 0))
        n = req.num_tokens
        if buf is None or len(buf) < n:
            grown = np.empty(max(256, 2 * n), dtype=np.int64)
            if buf is not None:
                grown[:have] = buf[:have]
            buf = grown
        p = req.num_prompt_tokens
        if have < p:
            buf[:p] = req.prompt_token_ids
            have = p
        if have < n:
            buf[have:n] = req.output_token_ids[have - p : n - p]
        return buf, n

    # ---- after the forward ----------------------------------------------------------------

    def sample(self, logits: Tensor, requests: list[Request]) -> Verified:
        """logits [sum(K_r + 1), V]: the raw logits of each request's verify rows, in order.
        Returns what to commit; one copy to the host."""
        ks = [len(r.draft_token_ids) for r in requests]
        if all(_plain_greedy(r) for r in requests):
            target = logits  # argmax of the raw logits: no rows to build (host time per step)
        else:
            rows: list[SamplingRow] = []
            for req, k in zip(requests, ks):
                for i in range(k + 1):
                    outs = req.output_token_ids + req.draft_token_ids[:i]
                    mask = None if req.token_bitmask is None else req.token_bitmask[i]
                    rows.append(SamplingRow(req.params, req.generator, req.prompt_token_ids,
                                            outs, mask))
            target = self.sampler.target_logits(logits, rows)
        R, K, V = len(requests), max(ks), logits.shape[1]
        device = logits.device
        if all(k == K for k in ks):  # every request has K drafts: the rows are in place
            padded = target.view(R, K + 1, V)
        else:
            # [R, K + 1] index of each request's rows in the packed logits (padding repeats
            # the request's last row; verify_drafts ignores rows past num_drafts).
            starts = [0]
            for k in ks[:-1]:
                starts.append(starts[-1] + k + 1)
            index = [[s + min(i, k) for i in range(K + 1)] for s, k in zip(starts, ks)]
            padded = target[_to(torch.tensor(index), device).view(-1)].view(R, K + 1, V)
        out = verify_drafts(
            padded,
            self._draft_ids(requests, ks, K, device),
            ks,
            [r.params.greedy for r in requests],
            generators=[r.generator for r in requests],
            default_generator=self.sampler.default_generator(device),
        )
        want = [r.params.logprobs for r in requests if r.params.logprobs is not None]
        lp = None
        if want:
            # the committed token of each packed row (rows past the accepted ones: anything)
            chosen = out.token_ids.clamp_min(0)
            flat = torch.cat([chosen[r, : k + 1] for r, k in enumerate(ks)])
            lp = compute_logprobs(logits, flat, max(want))
        # The step's one copy: each row holds the accepted drafts and the target's token,
        # then -1 (token ids are >= 0), so the accepted counts need no copy of their own.
        committed = [[t for t in row if t >= 0] for row in out.token_ids.tolist()]
        lp_host = [t.cpu() for t in lp] if lp is not None else None
        logprobs = None
        if lp_host is not None:
            chosen_l, ranks, top_ids, top_lps = (t.tolist() for t in lp_host)
            logprobs, start = [], 0
            for r, k in enumerate(ks):
                rows_r = range(start, start + len(committed[r]))
                logprobs.append([(chosen_l[i], ranks[i], top_ids[i], top_lps[i]) for i in rows_r])
                start += k + 1
        return Verified(committed, ks, logprobs)


    def _draft_ids(self, requests: list[Request], ks: list[int], K: int,
                   device: torch.device) -> Tensor:
        """[R, K] the requests' drafts on the device (past a request's own k: any value)."""
        dd = self.device_drafts
        if dd is not None:  # DFlash drafts a whole step's at once: all there or none
            idx = torch.tensor([dd.rows.get(id(r), 0) for r in requests])
            return dd.ids.index_select(0, _to(idx, dd.ids.device))[:, :K]
        rows = [req.draft_token_ids + [0] * (K - k) for k, req in zip(ks, requests)]
        return _to(torch.tensor(rows, dtype=torch.long).view(len(requests), K), device)


def _grammar_drafts(req: Request, drafts: list[int]) -> list[int]:
    """A structured request's drafts up to the first its grammar refuses (structured.py);
    while its reasoning runs, up to the block's end (sampling/reasoning_gate.py)."""
    if req.reasoning_gate is not None:
        drafts = req.reasoning_gate.drafts(drafts)
    if req.grammar is None:
        return drafts
    return Grammars.valid_prefix(req.grammar, drafts)


def _plain_greedy(req: Request) -> bool:
    """Every verify row of the request samples the raw logits' argmax: greedy, no penalty,
    min_tokens reached (its first row has the fewest outputs), no logit bias.
    Sampler.target_logits would return the logits untouched for such rows; this decides so
    without building them."""
    p = req.params
    return (p.greedy and not p.edits_logits and req.grammar is None
            and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and len(req.output_token_ids) >= p.min_tokens)


def _decoding(running: list[Request]) -> list[Request]:
    """Requests in decode: one known token not computed yet (a prefill chunk is not)."""
    return [r for r in running if r.num_computed_tokens == r.num_tokens - 1 and r.output_token_ids]


def _follows_gate(req: Request) -> bool:
    """Greedy and unseeded requests: whether they draft may depend on the load (DESIGN
    §9.1); a seeded sampling request's tokens may not, so it always drafts."""
    return req.generator is None or req.params.greedy


def record(req: Request, num_drafts: int, num_accepted: int) -> None:
    """Count one verify step on the request (steps without drafts are not verify steps)."""
    if num_drafts:
        if req.spec is None:
            req.spec = SpecStats()
        req.spec.record(num_drafts, num_accepted)


def _to(t: Tensor, device: torch.device) -> Tensor:
    return t.to(device, non_blocking=True)
