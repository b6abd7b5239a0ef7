"""What rank 0 tells the other tensor-parallel ranks, in the order it does it: tensors only (a
header, then an int64 payload; never pickle).

Every message starts with a header, HEADER int64 words over the gloo group:

    [op, a, b, c]
    FORWARD  a = requests R, b = attention groups G, c = payload length
             payload (gloo): query_lens[R] | context_lens[R] | per group its tables as one
                             [R, W] block (zero-padded rows, W = rest / (R * G))
             then the input ids [sum(query_lens)] over the device group, after rank 0 filled
             in the tokens still on its device (the overlap schedule), so nothing waits for
             the host
    LOGITS   a = rows n: the hidden rows [n, hidden] over the device group; every rank then
             computes its vocabulary shard's logits and rank 0 gathers them
    COPY     a = pairs n: payload (gloo) src[n] | dst[n], KV page copies (copy-on-write of the
             prefix cache) to make before the next forward
    MOE      expert parallelism (ep_tp.py): a = fixed path (0/1), b = data-parallel ranks D;
             payload (gloo) the agreed token count of every data-parallel rank [D]; this
             rank's FORWARD follows, or, when its count is 0, the worker runs the idle forward
    DRAFT    a DFlash drafter forward (dflash_tp.py): a = requests R, b = context width,
             c = payload length; payload (gloo) W | x_c[R] | c[R] | per drafter group its
             tables as one [R, W] block (zero-padded); every rank runs the drafter on its
             shard, and rank 0 gathers the draft logits
    CONTEXT  the drafter's context K/V of the last FORWARD's tokens, from each rank's own kept
             target outputs (no payload: the worker holds that forward's batch)
    STOP     the worker returns
    MOVES    a = flush number, b = payload length: payload (gloo) the flush's page copies of
             the prefix cache's offload tiers (host_cache.py), in order, each op
             src tier | dst tier | n | src pages[n] | dst pages[n] (tier -1: the device pool);
             the worker replays them on its own pool and tiers before the next forward
    LANDED   a = flush number: rank 0 saw that flush's loads land; the worker orders its compute
             stream after its own loads of it (and of every earlier flush)

A step's positions are not sent: request r's run from context_lens[r] for query_lens[r] tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swaserve.attention.base import AttentionInputs
from swaserve.distributed.parallel_state import TPGroup
from swaserve.memory.host_cache import Op

HEADER = 4
FORWARD, LOGITS, COPY, STOP = 1, 2, 3, 4
MOE = 8  # (5-7 are ep_wire's, whose STOP is this one)
DRAFT, CONTEXT = 9, 10  # DFlash (11 free)
MOVES, LANDED = 12, 13  # the offload tiers (14 kept for them)
DEVICE = -1  # a MOVES op's tier for the device pool


@dataclass
class Message:
    """A message as a worker receives it; the fields of its op are set."""

    op: int
    inputs: AttentionInputs | None = None  # FORWARD
    input_ids: torch.Tensor | None = None  # FORWARD, on the device
    hidden: torch.Tensor | None = None  # LOGITS, on the device
    src: list[int] | None = None  # COPY
    dst: list[int] | None = None  # COPY
    sizes: list[int] | None = None  # MOE
    fixed: bool = False  # MOE
    head: torch.Tensor | None = None  # DRAFT: [2, R] x_c and c, on the host
    tables: list[torch.Tensor] | None = None  # DRAFT: per drafter group [R, W], on the host
    width: int = 0  # DRAFT: context keys per request
    flush: int = 0  # MOVES, LANDED
    moves: list[Op] | None = None  # MOVES


class StepWire:
    def __init__(self, tp: TPGroup, hidden_size: int, dtype: torch.dtype) -> None:
        self.tp = tp
        self.hidden_size = hidden_size
        self.dtype = dtype

    # ---- rank 0 -----------------------------------------------------------------------------

    def send_forward(self, inputs: AttentionInputs, input_ids: torch.Tensor) -> None:
        """Header (FORWARD, B, groups, payload length), then query lens, context lens and each
        group's `[B, W]` table (W from the length), then the input ids."""
        b = len(inputs.query_lens)
        groups = inputs.num_groups
        parts = [torch.tensor(list(inputs.query_lens) + list(inputs.context_lens),
                              dtype=torch.int64)]
        if b:
            parts += [torch.from_numpy(inputs.group_table(g)).reshape(-1).to(torch.int64)
                      for g in range(groups)]
        payload = torch.cat(parts)
        self._header(FORWARD, b, groups, payload.numel())
        self.tp.broadcast(payload, on_cpu=True)
        self.tp.broadcast(input_ids)

    def send_logits(self, hidden: torch.Tensor) -> None:
        self._header(LOGITS, hidden.shape[0])
        self.tp.broadcast(hidden.to(self.dtype).contiguous())

    def send_copies(self, src: list[int], dst: list[int]) -> None:
        self._header(COPY, len(src))
        self.tp.broadcast(torch.tensor(list(src) + list(dst), dtype=torch.int64), on_cpu=True)

    def send_moe(self, sizes: list[int], fixed: bool) -> None:
        self._header(MOE, int(fixed), len(sizes))
        self.tp.broadcast(torch.tensor(sizes, dtype=torch.int64), on_cpu=True)

    def send_draft(self, head: torch.Tensor, tables: list[torch.Tensor], width: int) -> None:
        """Header (DRAFT, R, width, payload length), then W, x_c, c and the groups' tables
        padded to W (`head` [2, R] and `tables` int64 host tensors)."""
        w = max(t.shape[1] for t in tables)
        padded = [F.pad(t, (0, w - t.shape[1])).reshape(-1) for t in tables]
        payload = torch.cat([torch.tensor([w], dtype=torch.int64), head.reshape(-1), *padded])
        self._header(DRAFT, head.shape[1], width, payload.numel())
        self.tp.broadcast(payload, on_cpu=True)

    def send_context(self) -> None:
        self._header(CONTEXT)

    def send_moves(self, flush: int, ops: list[Op]) -> None:
        words: list[int] = []
        for src, src_pages, dst, dst_pages in ops:
            words += [_tier(src), _tier(dst), len(src_pages), *src_pages, *dst_pages]
        self._header(MOVES, flush, len(words))
        self.tp.broadcast(torch.tensor(words, dtype=torch.int64), on_cpu=True)

    def send_landed(self, flush: int) -> None:
        self._header(LANDED, flush)

    def send_stop(self) -> None:
        self._header(STOP)

    def _header(self, op: int, *sizes: int) -> None:
        words = [op, *sizes] + [0] * (HEADER - 1 - len(sizes))
        self.tp.broadcast(torch.tensor(words, dtype=torch.int64), on_cpu=True)

    # ---- the other ranks ---------------------------------------------------------------------

    def recv(self) -> Message:
        """The next message from rank 0 (blocks while the engine idles)."""
        op, a, b, c = self._payload(HEADER)
        if op == FORWARD:
            vals = self.tp.broadcast(torch.empty(c, dtype=torch.int64), on_cpu=True)
            q, ctx = vals[:a].tolist(), vals[a : 2 * a].tolist()
            width = (c - 2 * a) // (a * b) if a * b else 0
            flat = vals[2 * a :].to(torch.int32).numpy()
            arrays = [flat[g * a * width : (g + 1) * a * width].reshape(a, width)
                      for g in range(b)]
            ids = torch.empty(sum(q), dtype=torch.int64, device=self.tp.device)
            self.tp.broadcast(ids)
            return Message(op, inputs=AttentionInputs(q, ctx, arrays=arrays), input_ids=ids)
        if op == LOGITS:
            hidden = torch.empty(a, self.hidden_size, dtype=self.dtype, device=self.tp.device)
            return Message(op, hidden=self.tp.broadcast(hidden))
        if op == COPY:
            vals = self._payload(2 * a)
            return Message(op, src=vals[:a], dst=vals[a:])
        if op == MOE:
            return Message(op, sizes=self._payload(b), fixed=bool(a))
        if op == DRAFT:
            return self._recv_draft(a, b, c)
        if op == MOVES:
            return Message(op, flush=a, moves=_ops(self._payload(b)))
        if op == LANDED:
            return Message(op, flush=a)
        if op in (CONTEXT, STOP):
            return Message(op)
        raise RuntimeError(f"step wire: unknown op {op}")

    def _recv_draft(self, r: int, width: int, n: int) -> Message:
        vals = self.tp.broadcast(torch.empty(n, dtype=torch.int64), on_cpu=True)
        w = int(vals[0])
        blocks = vals[1 + 2 * r :].view(-1, r, w)  # [groups, R, W]
        return Message(DRAFT, head=vals[1 : 1 + 2 * r].view(2, r), tables=list(blocks),
                       width=width)

    def _payload(self, n: int) -> list[int]:
        return self.tp.broadcast(torch.empty(n, dtype=torch.int64), on_cpu=True).tolist()


def _tier(t: int | None) -> int:
    return DEVICE if t is None else t


def _ops(words: list[int]) -> list[Op]:
    """MOVES' payload back into the flush's ops."""
    ops: list[Op] = []
    i = 0
    while i < len(words):
        src, dst, n = words[i : i + 3]
        pages = words[i + 3 : i + 3 + 2 * n]
        ops.append((None if src == DEVICE else src, pages[:n],
                    None if dst == DEVICE else dst, pages[n:]))  # fmt: skip
        i += 3 + 2 * n
    return ops
