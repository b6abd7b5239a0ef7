"""Acceptance of drafted tokens: a pure function of draft tokens, draft probabilities and the
target's distributions (docs/architecture.md §8, vLLM's rejection sampler). No engine state:
the engine commits what it returns.

A request with K drafts d_1..d_K was verified in one forward over [last, d_1..d_K] at
positions c..c+K; row i of its target distribution predicts position c+i+1 (what follows
d_i, or `last` for row 0). Returned: a = the number of drafts accepted, and a + 1 tokens to
commit, d_1..d_a then one token of the target's own (the bonus, or the resample of the
first rejected position):

    greedy   accept while d_{i+1} == argmax(row i); the token after is argmax(row a)
    sampling accept d_{i+1} iff u_i < p_i(d_{i+1}) / q_i(d_{i+1}), u_i ~ U[0, 1) (q one-hot
             for a deterministic drafter: u_i < p_i(d_{i+1})); at the first rejection j the
             token after is drawn from norm(max(p_j - q_j, 0)); with every draft accepted it
             is drawn from p_K. The emitted tokens then follow the target's distribution
             exactly (Leviathan et al. 2023; Chen et al. 2023).

Randomness: a request with its own generator (a seeded request) draws its K uniforms, then
the [V] exponential noise of the final draw, from that generator alone, so its tokens do not
depend on what else is verified with it. Nothing here reads a device tensor back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from swaserve.sampling.sampler import row_argmax


@dataclass
class VerifyOutput:
    num_accepted: Tensor  # [R] int64: drafts accepted
    token_ids: Tensor  # [R, K + 1] int64: accepted drafts, then the target's token; -1 after


def verify_drafts(
    logits: Tensor,
    draft_ids: Tensor,
    num_drafts: Sequence[int],
    greedy: Sequence[bool],
    draft_probs: Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
) -> VerifyOutput:
    """Accept drafts for R requests of at most K drafts each (see the module docstring).

    logits [R, K + 1, V]: the target's processed logits per verify row (penalties,
    temperature, top-k/top-p/min-p applied; masked tokens at -inf); rows past a request's
    num_drafts + 1 are ignored. draft_ids [R, K] int64 (anything past num_drafts).
    num_drafts: R ints in [0, K] (host values: a request's own generator draws exactly
    that many uniforms, whatever the batch's K). greedy: R bools (host values), argmax
    acceptance (rows of greedy requests hold logits before temperature, so argmax is the
    greedy token); an all-greedy batch skips the softmax and the draws.
    draft_probs [R, K, V] the drafter's q per draft, or None for one-hot drafts.
    generators: per request, its own generator or None (then `default_generator`, or torch's
    global RNG when that is None too)."""
    R, K1, V = logits.shape
    K = K1 - 1
    device = logits.device
    counts = list(num_drafts)
    num_drafts = torch.tensor(counts, dtype=torch.long).to(device, non_blocking=True)
    pos = torch.arange(K, device=device)
    valid = pos.unsqueeze(0) < num_drafts.unsqueeze(1)  # [R, K]
    safe_drafts = torch.where(valid, draft_ids, 0)

    target_ids = row_argmax(logits)  # [R, K + 1]
    greedy_ok = (safe_drafts == target_ids[:, :K]) & valid
    if all(greedy):
        num_accepted = greedy_ok.long().cumprod(dim=1).sum(dim=1)
        next_token = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        return _output(draft_ids, num_accepted, next_token, pos, K1)
    greedy = torch.tensor(list(greedy)).to(device, non_blocking=True)

    probs = logits.float().softmax(dim=-1)  # [R, K + 1, V]
    p_draft = probs[:, :K].gather(-1, safe_drafts.unsqueeze(-1)).squeeze(-1)  # [R, K]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float().gather(-1, safe_drafts.unsqueeze(-1)).squeeze(-1)
    uniform, noise = _draws(counts, K, V, device, generators, default_generator)
    # u < p / q without the division (q > 0 for a drafted token: the drafter proposed it)
    sample_ok = (uniform * q_draft < p_draft) & valid

    ok = torch.where(greedy.unsqueeze(1), greedy_ok, sample_ok)
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)  # leading accepts

    # The target's own token at row a: greedy argmax, else a draw from the residual
    # (a < num_drafts: a rejection) or from p_K (every draft accepted).
    rows = num_accepted.view(R, 1, 1).expand(R, 1, V)
    p_a = probs.gather(1, rows).squeeze(1)  # [R, V]
    rejected = num_accepted < num_drafts
    q_a = torch.zeros_like(p_a)  # q of the draft at row a (only read where one was rejected)
    if K > 0:
        a = num_accepted.clamp(max=K - 1)
        if draft_probs is None:
            q_a.scatter_(1, safe_drafts.gather(1, a.unsqueeze(1)), 1.0)
        else:
            q_a = draft_probs.float().gather(1, a.view(R, 1, 1).expand(R, 1, V)).squeeze(1)
    residual = torch.where(rejected.unsqueeze(1), (p_a - q_a).clamp_min(0.0), p_a)
    # p == q up to rounding leaves nothing: sample p itself (a rejection is then measure-zero)
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_a, residual)
    sampled = row_argmax(residual.div_(noise), dim=1)  # exponential race: an exact draw
    greedy_next = target_ids.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    next_token = torch.where(greedy, greedy_next, sampled)
    return _output(draft_ids, num_accepted, next_token, pos, K1)


def _output(
    draft_ids: Tensor, num_accepted: Tensor, next_token: Tensor, pos: Tensor, K1: int
) -> VerifyOutput:
    """[R, K + 1]: the accepted drafts, then the target's token, then -1."""
    K = K1 - 1
    out = torch.full((num_accepted.shape[0], K1), -1, dtype=torch.long, device=draft_ids.device)
    out[:, :K] = torch.where(pos.unsqueeze(0) < num_accepted.unsqueeze(1), draft_ids, -1)
    out.scatter_(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    return VerifyOutput(num_accepted=num_accepted, token_ids=out)


def _draws(
    counts: list[int],
    K: int,
    V: int,
    device: torch.device,
    generators: Sequence[torch.Generator | None] | None,
    default: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """Per request: one uniform per draft, then [V] Exp(1) noise; a request's own generator
    draws exactly those (its draws do not depend on the other requests' draft counts)."""
    R = len(counts)
    uniform = torch.zeros((R, K), device=device)
    noise = torch.empty((R, V), device=device)
    own = [(i, g) for i, g in enumerate(generators or []) if g is not None]
    if len(own) < R:
        uniform.uniform_(generator=default)
        noise.exponential_(generator=default)
    for i, g in own:
        if counts[i]:
            uniform[i, : counts[i]].uniform_(generator=g)
        noise[i].exponential_(generator=g)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return uniform, noise
