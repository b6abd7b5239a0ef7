"""Data parallelism over tensor-parallel replicas on CPU (gloo), offline: `Engine(
data_parallel_size=2, tensor_parallel_size=2)` runs two replicas in this process, each the rank
0 of its own two-rank group (one spawned worker each, its own rendezvous). Against one process
in float32: greedy tokens equal and logprobs within 1e-4 on tiny random Llama and Gemma 3 (slow)
whose one KV head is replicated on both ranks and whose vocabulary (129) is padded over them, with
requests on both replicas; `memory_stats()` has both. A killed worker of replica 1 is an error
naming the replica and the rank within seconds (last: it ends the module's engine). Without
`-tp`, two one-process replicas give the same outputs too (and bench's tracked run sees both).
Replica configs and device placement, and the flags still refused, are checked without
processes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from swaserve.bench.offline import local_cores, run_tracked
from swaserve.config import EngineConfig
from swaserve.distributed.launch import worker_device
from swaserve.server.launch import replica_config
from tests.helpers import assert_same_outputs, random_prompts, save_random_hf_models

ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16,
              kv_cache_gb=0.01)  # fmt: skip
VOCAB = 129  # not divisible by 2: the last vocabulary shard is padded
COMMON = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
              vocab_size=VOCAB, num_key_value_heads=1, intermediate_size=96)  # fmt: skip


def _configs() -> dict:
    return {
        "llama": transformers.LlamaConfig(
            **COMMON, num_hidden_layers=2, tie_word_embeddings=False, attention_bias=True,
        ),
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=3.0,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return save_random_hf_models(_configs(), tmp_path_factory)


# Gemma 3 is slow-marked: each 4-rank engine takes ~15 s to start on 2 cores
@pytest.fixture(scope="module", params=["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
def pair(request, folders):
    """(name, one process, dp 2 x tp 2) on the same checkpoint; one 4-rank engine at a time."""
    name = request.param
    # dense weights on both: the TP ranks never pack theirs for oneDNN (ops/cpu_pack.py)
    one = Engine(model=str(folders[name]), disable_fused_ops=True, **ENGINE)
    four = Engine(model=str(folders[name]), data_parallel_size=2, tensor_parallel_size=2,
                  **ENGINE)  # fmt: skip
    yield name, one, four
    four.core.shutdown()


def test_greedy_tokens_and_logprobs_equal_one_process(pair):
    name, one, four = pair
    replicas = four.core.replicas
    assert [r.parallel.tp.size for r in replicas] == [2, 2]
    # each replica its own group: its own store, its own worker
    assert replicas[0].parallel.store.port != replicas[1].parallel.store.port
    assert replicas[0].parallel.procs[1].pid != replicas[1].parallel.procs[1].pid
    prompts = random_prompts(VOCAB, [37, 9, 23, 50, 14, 30], seed=2)  # chunked prefills
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    want = one.generate(prompt_token_ids=prompts, sampling_params=params)
    got = four.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_same_outputs(want, got)
    assert all(n >= 2 for n in four.core.placement.routed), four.core.placement.routed
    assert not four.core.placement.requests
    for r in replicas:
        r.memory.check_integrity()
    mem = four.memory_stats()
    assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
    assert mem["pages_total"] == sum(r["pages_total"] for r in mem["ranks"])


def test_dp2_without_tp_equals_one_process(folders):
    """`Engine(data_parallel_size=2)` alone: two one-process replicas here, no worker."""
    one = Engine(model=str(folders["llama"]), **ENGINE)
    two = Engine(model=str(folders["llama"]), data_parallel_size=2, **ENGINE)
    assert [r.parallel for r in two.core.replicas] == [None, None]
    prompts = random_prompts(VOCAB, [21, 5, 33, 9], seed=6)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    assert_same_outputs(one.generate(prompt_token_ids=prompts, sampling_params=params),
                        two.generate(prompt_token_ids=prompts, sampling_params=params))
    assert two.core.placement.routed == [2, 2]
    # bench's tracked run sees both replicas' schedulers (it once asked the core for one)
    assert local_cores(two.core) == two.core.replicas
    res = run_tracked(two, prompts, 3)
    assert res["tracked_cores"] == 2 and res["peak_running"] == len(prompts)
    assert res["output_tokens"] == 3 * len(prompts) and res["preemptions"] == 0


@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_killed_worker_of_replica_1_is_a_clear_error(pair):
    """Last in the module: the engine stays down."""
    _, _, four = pair
    worker = four.core.replicas[1].parallel.procs[1]
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    prompts = random_prompts(VOCAB, [20] * 4, seed=3)
    threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    pattern = r"dp rank 1: tensor-parallel rank 1 .*killed by SIGKILL"
    with pytest.raises(RuntimeError, match=pattern):
        for _ in range(1000):  # until the kill lands, mid-step or between steps
            four.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="dp rank 1"):  # and it stays down
        four.generate(prompt_token_ids=prompts, sampling_params=params)


def test_replica_devices_and_rendezvous(monkeypatch):
    """Replica i of -dp D -tp T: cuda:i*T for its rank 0, the next T - 1 GPUs for its workers,
    a rendezvous of its own (HOST:PORT + i when given); over nodes, with expert parallelism or
    without, a rank's GPU is its index on its node and its group meets on a local port."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    cfg = EngineConfig(model="x", device="cuda", data_parallel_size=3, tensor_parallel_size=2,
                       dist_init_addr="10.0.0.1:29500")  # fmt: skip
    reps = [replica_config(cfg, i) for i in range(3)]
    assert [r.device for r in reps] == ["cuda:0", "cuda:2", "cuda:4"]
    assert [r.dist_init_addr for r in reps] == [f"10.0.0.1:{29500 + i}" for i in range(3)]
    assert {(r.data_parallel_size, r.tensor_parallel_size) for r in reps} == {(1, 2)}
    assert [worker_device(reps[2], rank) for rank in (0, 1)] == [
        torch.device("cuda", 4), torch.device("cuda", 5),
    ]  # fmt: skip
    assert replica_config(dataclasses.replace(cfg, dist_init_addr=None), 1).dist_init_addr is None
    ep = EngineConfig(model="x", device="cuda", data_parallel_size=4, enable_expert_parallel=True,
                      nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500")  # fmt: skip
    rep = replica_config(ep, 3)
    assert (rep.device, rep.nnodes, rep.node_rank, rep.dist_init_addr) == ("cuda:1", 1, 0, None)
    assert not rep.enable_expert_parallel and rep.data_parallel_size == 1
    plain = EngineConfig(model="x", device="cuda", data_parallel_size=4, tensor_parallel_size=2,
                         nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:29500")  # fmt: skip
    reps = [replica_config(plain, i) for i in (2, 3)]  # node 1's replicas
    assert [(r.device, r.dist_init_addr, r.nnodes, r.node_rank) for r in reps] == [
        ("cuda:0", None, 1, 0), ("cuda:2", None, 1, 0),
    ]  # fmt: skip
    assert [worker_device(reps[1], rank) for rank in (0, 1)] == [
        torch.device("cuda", 2), torch.device("cuda", 3),
    ]  # fmt: skip


def test_flags_still_refused_name_themselves():
    EngineConfig(data_parallel_size=2, tensor_parallel_size=2)  # runs now
    # with expert parallelism too (tests/unit/test_ep_tp_flags.py: what it still refuses)
    EngineConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    # replicas over nodes too (tests/unit/test_nodes.py)
    EngineConfig(data_parallel_size=2, tensor_parallel_size=2, nnodes=2,
                 dist_init_addr="127.0.0.1:1234")  # fmt: skip
    with pytest.raises(ValueError, match=r"^invalid --nnodes 2 .*divide --data-parallel-size"):
        EngineConfig(data_parallel_size=3, enable_expert_parallel=True, nnodes=2,
                     dist_init_addr="127.0.0.1:1234")  # fmt: skip
    EngineConfig(data_parallel_size=4, enable_expert_parallel=True, nnodes=2, node_rank=1,
                 dist_init_addr="127.0.0.1:1234")  # fmt: skip
    with pytest.raises(ValueError, match=r"^invalid --data-parallel-size 2 .*cuda:i"):
        EngineConfig(data_parallel_size=2, tensor_parallel_size=2, device="cuda:1")


def test_workers_take_their_nodes_share_of_the_cores(monkeypatch):
    """On CPU the workers run as many threads as their spawner has once it took its share:
    another node's launcher shares its cores among its own ranks (here 2 of -tp 4 over 2
    nodes), never handing them its whole thread count."""
    import os

    import swaserve.distributed.launch as launch

    seen = []
    monkeypatch.setattr(launch, "spawn_ranks", lambda *a, **k: seen.append(
        torch.get_num_threads()) or {})  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(64)
    try:
        cfg = EngineConfig(model="x", device="cpu", tensor_parallel_size=4, nnodes=2,
                           node_rank=1, dist_init_addr="127.0.0.1:1")  # fmt: skip
        assert launch.run_node(cfg, None) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [max(1, min(64, len(os.sched_getaffinity(0)) // 2))]
