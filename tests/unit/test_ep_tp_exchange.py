"""The MoE exchange of `-dp 2 -tp 2 --enable-expert-parallel` (distributed/ep_tp.py) in one
process: four threads play the four ranks (i, j) over real gloo groups, each data-parallel rank
i's tensor-parallel group TP_i and each tensor-parallel index's expert-parallel group EP_j, and
each holds its quarter of the experts. Every copy of a data-parallel rank's tokens gets the
whole layer's output (one process's, within float32 rounding); each (token, expert) pair is
computed once over the four; an idle rank's two processes serve their experts with zero rows;
the decode workspace's fixed path and a forward outside a step (sizes exchanged in the layer)
give the same."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

from swaserve.distributed.expert_parallel import ExpertParallel
from swaserve.distributed.expert_shards import expert_range, expert_rank
from swaserve.distributed.parallel_state import EPGroup, TPGroup, expert_group_store
from swaserve.models.moe import SparseMoE

D, T, E, H = 2, 2, 8, 16
CPU = torch.device("cpu")


def _full_moe() -> SparseMoE:
    torch.manual_seed(0)
    moe = SparseMoE(H, 8, E, 2, "softmax_topk", True, router_bias=True, expert_bias=True)
    for p in moe.parameters():
        nn.init.normal_(p, 0.0, 0.5)
    return moe.requires_grad_(False)


def _part(full: SparseMoE, rank: int) -> SparseMoE:
    """Expert-parallel rank `rank`'s layer: the router whole, its experts only."""
    lo, hi = expert_range(E, D * T, rank, T)
    part = SparseMoE(H, 8, E, 2, "softmax_topk", True, router_bias=True, expert_bias=True)
    part.router.load_state_dict(full.router.state_dict())
    for leaf in ("w13", "b13", "w2", "b2"):
        getattr(part, leaf).data = getattr(full, leaf)[lo:hi].clone()
    part.expert_range = (lo, hi)
    return part.requires_grad_(False)


def run_ranks(body) -> dict:
    """body(i, j, ep, layer) on four threads, one per process (i, j), each with its groups;
    {(i, j): what it returned}. An exception in any thread fails the test."""
    store, full = dist.HashStore(), _full_moe()
    out: dict = {}

    def rank(i: int, j: int) -> None:
        try:
            tp = TPGroup.create(dist.PrefixStore(f"tp{i}", store), j, T, "127.0.0.1", CPU)
            group = EPGroup.create(expert_group_store(store, j), i, D, "127.0.0.1", CPU)
            ep = ExpertParallel(group, lambda: None, tp_rank=j, tp_size=T)
            layer = _part(full, expert_rank(i, j, T))
            calls = []
            run = layer.run_experts
            layer.run_experts = lambda x, *a: calls.append(x.shape[0]) or run(x, *a)
            ep.attach(nn.ModuleList([layer]), tp)
            out[i, j] = (body(i, j, ep, layer), calls)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            out[i, j] = e

    threads = [threading.Thread(target=rank, args=(i, j), daemon=True)
               for i in range(D) for j in range(T)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    for v in out.values():
        if isinstance(v, BaseException):
            raise v
    out["full"] = full
    return out


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fixed", [False, True])
def test_every_copy_gets_the_whole_layer_and_each_pair_runs_once(fixed):
    xs = [_tokens(5, 1), _tokens(3, 2)]  # rank 1 has fewer tokens: padding rows in the gather

    def body(i, j, ep, layer):
        if fixed:
            ep.enable_decode_workspace(6)
        ep.begin_step([x.shape[0] for x in xs], fixed)
        y = layer(xs[i].clone())  # the same tokens on both of rank i's processes
        ep.end_step()
        return y

    out = run_ranks(body)
    full = out.pop("full")
    for (i, _), (y, _) in out.items():
        assert torch.allclose(y, full(xs[i]), atol=1e-5)
    # every process saw every rank's tokens once; all its assignments were of its own experts,
    # and over the four processes they add up to one per (token, top-k slot)
    assignments = sum(sum(calls) for _, calls in out.values())
    assert assignments == sum(x.shape[0] for x in xs) * 2


def test_an_idle_rank_serves_its_experts():
    x = _tokens(7, 3)

    def body(i, j, ep, layer):
        ep.begin_step([7, 0], False)
        if i == 1:
            ep.idle_forward()  # both of rank 1's processes, zero rows
            return None
        return layer(x.clone())

    out = run_ranks(body)
    full = out.pop("full")
    for (i, _), (y, _) in out.items():
        if i == 0:
            assert torch.allclose(y, full(x), atol=1e-5)
    assert sum(sum(calls) for _, calls in out.values()) == 7 * 2
    assert all(calls for (i, _), (_, calls) in out.items() if i == 1)  # the idle rank computed


def test_a_forward_outside_a_step_exchanges_its_sizes():
    xs = [_tokens(2, 4), _tokens(6, 5)]
    out = run_ranks(lambda i, j, ep, layer: layer(xs[i].clone()))
    full = out.pop("full")
    for (i, _), (y, _) in out.items():
        assert torch.allclose(y, full(xs[i]), atol=1e-5)
