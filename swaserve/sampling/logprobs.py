"""Logprobs as users see them: the raw log_softmax of the model's logits (docs/serving.md,
Logprobs).

Raw means before temperature, penalties and top-k/top-p/min-p, as vLLM reports them. Used
by the sampler for sampled tokens and by the model runner for prompt logprobs. Everything
stays on the logits' device: no host sync here, the caller copies the results once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, k: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logprob and rank of `token_ids`, and the top-k alternatives, per row.

    logits [N, V] (any float dtype), token_ids [N] int. Returns
    chosen_logprob [N] float32, chosen_rank [N] int64 (1-based), topk_ids [N, k] int64 and
    topk_logprobs [N, k] float32 (best first; k == 0 gives [N, 0]).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1)
    # Rank = 1 + number of tokens strictly more likely; tied tokens share the best rank, so a
    # greedy pick always has rank 1.
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=-1) + 1
    k = min(k, logprobs.shape[-1])
    if k > 0:
        topk_logprobs, topk_ids = logprobs.topk(k, dim=-1)
    else:
        n = logprobs.shape[0]
        topk_logprobs = logprobs.new_empty((n, 0))
        topk_ids = torch.empty((n, 0), dtype=torch.long, device=logprobs.device)
    return chosen, ranks, topk_ids, topk_logprobs
