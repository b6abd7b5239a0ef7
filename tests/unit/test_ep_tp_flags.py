"""`-dp D -tp T --enable-expert-parallel` without processes: what starts, and what is refused at
start with an error naming the flags and the numbers (config.py, expert_shards.py), before any
rank process exists; each rank's place (its GPUs, its local rendezvous) and its experts."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from swaserve import Engine
from swaserve.config import EngineConfig
from swaserve.distributed.expert_shards import check_expert_parallel, expert_range, expert_rank
from swaserve.distributed.layers import check_shardable
from swaserve.server.launch import replica_config
from tests.helpers import tiny_moe_config

EP_TP = dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)


def _moe(**kw):
    cfg = tiny_moe_config(**kw)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def test_what_is_refused_names_itself():
    EngineConfig(**EP_TP)  # runs now
    EngineConfig(**EP_TP, speculative_algorithm="ngram")  # test_dp_tp_expert_parallel_spec.py
    EngineConfig(**EP_TP, speculative_algorithm="dflash")  # test_dflash_ep.py
    for kwargs, flag, why in [
        (dict(host_cache_gb=1.0), "--host-cache-gb",
         "is not supported with --tensor-parallel-size 2 and --enable-expert-parallel yet"),
        (dict(disk_cache_dir="/tmp/x"), "--disk-cache-dir",
         "is not supported with --tensor-parallel-size 2 and --enable-expert-parallel yet"),
        (dict(nnodes=3, dist_init_addr="127.0.0.1:1234"), "--nnodes",
         r"must be >= 1 and divide --data-parallel-size \(2\)"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"^invalid {flag} .*{why}"):
            EngineConfig(**EP_TP, **kwargs)


def test_the_experts_split_over_d_times_t():
    check_expert_parallel(_moe(), 2, 2)  # 8 experts over 4 processes
    check_expert_parallel(_moe(), 4, 2)  # one each
    with pytest.raises(ValueError, match=r"^--data-parallel-size 3 x --tensor-parallel-size 2 "
                       r"= 6 expert-parallel ranks .*experts per layer \(8\)"):  # fmt: skip
        check_expert_parallel(_moe(), 3, 2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 must divide the model's "
                       r"attention heads \(4\)"):  # fmt: skip
        check_expert_parallel(_moe(num_experts=12), 2, 3)
    # the experts stay whole: their intermediate size (6) need not divide by T, as with plain TP
    check_expert_parallel(_moe(moe_intermediate_size=6), 2, 4)
    with pytest.raises(ValueError, match="expert intermediate size"):
        check_shardable(_moe(moe_intermediate_size=6), 4)


def test_each_process_holds_its_quarter():
    assert [expert_rank(i, j, 2) for i in range(2) for j in range(2)] == [0, 1, 2, 3]
    assert [expert_range(8, 4, r, 2) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_engine_refuses_an_uneven_split_before_any_process(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    _moe().save_pretrained(folder)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"--data-parallel-size 3 x --tensor-parallel-size 2"):
        Engine(model=str(folder), data_parallel_size=3, tensor_parallel_size=2,
               enable_expert_parallel=True, device="cpu", load_format="dummy")  # fmt: skip
    assert time.monotonic() - start < 5


def test_rank_devices_and_local_rendezvous(monkeypatch):
    """Data-parallel rank i's core on cuda:i*T, its workers on the next GPUs; its tensor-parallel
    group meets on a free local port, whatever --dist-init-addr says (that is the expert-parallel
    store's)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    cfg = EngineConfig(model="x", device="cuda", **{**EP_TP, "data_parallel_size": 4},
                       dist_init_addr="10.0.0.1:29500")  # fmt: skip
    reps = [replica_config(cfg, i) for i in range(4)]
    assert [r.device for r in reps] == ["cuda:0", "cuda:2", "cuda:4", "cuda:6"]
    assert {(r.tensor_parallel_size, r.data_parallel_size, r.dist_init_addr) for r in reps} == {
        (2, 1, None)
    }
    assert not any(r.enable_expert_parallel for r in reps)
    # over two nodes (tests/e2e/test_two_node_ep_server.py): each node's ranks from cuda:0
    two = dataclasses.replace(cfg, nnodes=2, node_rank=1)
    two.__post_init__()  # accepted: the T processes of a rank stay on its node
    assert [replica_config(two, i).device for i in (2, 3)] == ["cuda:0", "cuda:2"]
    assert {replica_config(two, i).dist_init_addr for i in range(4)} == {None}
