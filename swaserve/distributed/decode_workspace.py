"""The decode-only workspace of the MoE exchange (`--moe-decode-max-tokens-per-rank N`,
DESIGN §9.2): fixed-shape buffers for the steps where every rank only decodes.

A step is on the fixed path when every rank's batch is decode-only (each request's chunk is
its one last token, plus its drafts when it verifies; an idle rank's empty batch counts) and no
rank has more than N tokens; every rank knows it from the step's agreement
(ExpertParallel.agree_step). Its MoE layers then exchange through buffers allocated once, at
start, and padded to N rows on every rank whatever the step's token counts:

    send   [N, H]       this rank's n tokens in rows 0..n-1 (rows n.. stale: no expert reads them)
    route  [N, 2k]      their top-k weights | expert ids as float32; rows n.. all -1 (no expert)
    xs     [D N, H]     send all-gathered: rank r's block is rows [r N, (r + 1) N)
    rs     [D N, 2k]    route all-gathered, same blocks
    share  [D N, H]     this rank's experts' share of every gathered row
    out    [N, H]       share reduce-scattered: block `rank`, whose rows 0..n-1 are this rank's
                        tokens' MoE outputs (a copy of them is returned: nothing handed to the
                        model aliases the workspace, which the next MoE layer overwrites)

So every collective of such a step has the same shapes in every step (what a CUDA graph that
captures them needs). The buffers are shared by all MoE layers, which run one after another.

The cap holds because the scheduler never puts more than N decode/verify tokens on a rank's
step (Scheduler.decode_cap; a verifying request counts K + 1): a decode-only step always fits.
A step with a prefill chunk on any rank takes GatherExchange, sized by the step's largest rank
(the prefill workspace, allocated per step).

Default N: the largest decode step the scheduler can make, min(max_num_batched_tokens,
max_num_seqs x (1 + K)), K the drafts per verify (0 without speculation): the cap then never
holds a request back. The workspace is (2 D + 2) N H elements of the model's dtype plus
(D + 1) N 2k float32 (gpt-oss-20b's shape, H = 2,880, k = 4, with D = 2 and N = 1,024 in
bfloat16: 35 MB); memory_stats() reports it as `moe_workspace_bytes`.
"""

from __future__ import annotations

import torch

from swaserve.config import EngineConfig
from swaserve.distributed.parallel_state import EPGroup


def decode_cap(config: EngineConfig, num_drafts: int) -> int:
    """N for a rank's config (its device defaults filled in): the flag, else the largest decode
    step the scheduler can make (module docstring). 0: no workspace, no cap."""
    if config.moe_decode_max_tokens_per_rank is not None:
        return config.moe_decode_max_tokens_per_rank
    return min(config.max_num_batched_tokens, config.max_num_seqs * (1 + num_drafts))


class DecodeWorkspace:
    """The buffers of the module docstring, for N rows per rank of hidden size H and top-k."""

    def __init__(
        self, group: EPGroup, rows: int, hidden: int, top_k: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        d = group.size
        self.rows = rows
        self.send = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.route = torch.full((rows, 2 * top_k), -1.0, dtype=torch.float32, device=device)
        self.xs = torch.empty(d * rows, hidden, dtype=dtype, device=device)
        self.rs = torch.empty(d * rows, 2 * top_k, dtype=torch.float32, device=device)
        self.share = torch.empty(d * rows, hidden, dtype=dtype, device=device)
        self.out = torch.empty(rows, hidden, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        bufs = (self.send, self.route, self.xs, self.rs, self.share, self.out)
        return sum(t.numel() * t.element_size() for t in bufs)


class FixedExchange:
    """MoEExchange (expert_parallel.py) through a DecodeWorkspace: every rank pads to N rows,
    not to the step's largest rank. Only for steps whose every rank has at most N tokens."""

    def __init__(self, group: EPGroup, workspace: DecodeWorkspace) -> None:
        self.group = group
        self.ws = workspace
        self.share = workspace.share  # local_experts writes the experts' share here

    def dispatch(self, x, weights, ids, sizes):
        ws, (n, k) = self.ws, ids.shape
        ws.send[:n].copy_(x)
        ws.route[:n, :k].copy_(weights)
        ws.route[:n, k:].copy_(ids)
        ws.route[n:].fill_(-1.0)  # ids exact as float32 below 2^24 experts
        self.group.all_gather_into(ws.xs, ws.send)
        self.group.all_gather_into(ws.rs, ws.route)
        return ws.xs, ws.rs[:, :k].to(weights.dtype), ws.rs[:, k:].long()

    def combine(self, out, sizes):
        self.group.reduce_scatter_into(self.ws.out, out)
        return self.ws.out[: sizes[self.group.rank]].clone()
