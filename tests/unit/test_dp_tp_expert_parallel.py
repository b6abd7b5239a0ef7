"""`Engine(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)` on CPU
(gloo): 2 data-parallel ranks of 2 tensor-parallel processes each, the experts over all four
(distributed/ep_tp.py); rank 0's core here, its worker and rank 1 (with its own worker)
spawned.

Against one process on the same checkpoint, in float32: greedy tokens equal and logprobs within
1e-4 on tiny random Qwen3-MoE (a dense layer among the sparse ones) and gpt-oss (router and
expert biases, sinks, sliding layers), each with one KV head (replicated over the two
tensor-parallel ranks) and a vocabulary of 129 (the last shard padded), through chunked
prefill (16-token steps), a prefix hit, one data-parallel rank idle for many steps, and the
decode workspace capped below the running decodes. Each rank's memory manager passes
check_integrity(). A killed data-parallel rank (its engine core) and a killed tensor-parallel
worker are clear errors naming them within seconds (each ends its module's engine, last).
Every case runs under a deadline. Slow: each four-process engine takes ~15 s to start on 2
cores. The flags still refused, without processes: tests/unit/test_ep_tp_flags.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import transformers

from swaserve import Engine, SamplingParams
from tests.helpers import (
    assert_same_outputs,
    random_prompts,
    save_random_hf_models,
    spawned_children,
    tiny_moe_config,
)
from tests.unit.test_expert_parallel import (
    _assert_close,
    _params,
    _watch_decode_path,
    check_one_rank_idle,
    check_prefix_hit_on_rank_1,
    deadline,
    drive,
)

pytestmark = pytest.mark.slow

ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16,
              kv_cache_gb=0.01)  # fmt: skip
EP_TP = dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
VOCAB = 129  # not divisible by 2: the last vocabulary shard is padded
COMMON = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
              vocab_size=VOCAB, num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
CAP = {"qwen3_moe": None, "gpt_oss": 2}  # gpt-oss: decode steps of at most 2 tokens per rank


def _configs() -> dict:
    return {
        "qwen3_moe": tiny_moe_config(**COMMON),
        "gpt_oss": transformers.GptOssConfig(  # 4 experts: one on each process
            **COMMON, intermediate_size=32, num_hidden_layers=4, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8,
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return save_random_hf_models(_configs(), tmp_path_factory)


@pytest.fixture(scope="module", params=list(CAP))
def pair(request, folders):
    """(name, one process, dp 2 x tp 2 with expert parallelism); one such engine at a time."""
    name = request.param
    one = Engine(model=str(folders[name]), disable_fused_ops=True, **ENGINE)
    with deadline(180):
        four = Engine(model=str(folders[name]), **EP_TP, **ENGINE,
                      moe_decode_max_tokens_per_rank=CAP[name])  # fmt: skip
    yield name, one, four
    four.core.shutdown()


def test_greedy_tokens_and_logprobs_equal_one_process(pair):
    name, one, four = pair
    local = four.core.local
    assert local.parallel.tp.size == 2 and local.ep.experts_place == (0, 4)
    prompts = random_prompts(VOCAB, [37, 9, 23, 50, 14, 30], seed=2)  # chunked prefills
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    want = one.generate(prompt_token_ids=prompts, sampling_params=params)
    with deadline(120):
        got = four.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_same_outputs(want, got)
    assert all(n >= 2 for n in four.core.placement.routed), four.core.placement.routed
    ranks = four.memory_stats()["ranks"]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    assert all(r["moe_decode_steps"] > 0 and r["moe_decode_over_cap"] == 0 for r in ranks)
    four.core.check_integrity()


def test_prefix_hit_on_one_rank(pair):
    _, one, four = pair
    check_prefix_hit_on_rank_1(one, four, random_prompts(VOCAB, [30], seed=5)[0])


def test_one_rank_idle_for_many_steps(pair):
    """Rank 1 without requests while rank 0 decodes 30 tokens, then the other way round: the
    idle rank's core and its worker run an idle forward in every step."""
    _, one, four = pair
    check_one_rank_idle(one, four, random_prompts(VOCAB, [11], seed=7)[0], 30)


def test_unequal_batches_under_the_decode_cap(pair):
    """Four decoding requests on each rank: with gpt-oss's cap of 2 no decode step of rank 0
    carries more than 2 tokens and every fixed-path exchange of its core gathers D x N = 4 rows
    (no rank counts a step over the cap); with Qwen3-MoE's default cap (16) the same requests
    run uncapped."""
    name, one, four = pair
    prompts = random_prompts(VOCAB, [9, 14, 6, 11, 13, 7, 10, 5], seed=21)
    reqs = [(f"c{i}", p, _params(8 + i), i % 2) for i, p in enumerate(prompts)]
    ref = {}
    for r in reqs:
        ref.update(drive(one.core, [r]))
    rows, decode_tokens, undo = _watch_decode_path(four.core)
    try:
        got = drive(four.core, reqs)
    finally:
        undo()
    _assert_close(ref, got, [r[0] for r in reqs])
    cap = CAP[name] or 16
    assert max(decode_tokens) == min(cap, 4) and rows and set(rows) == {2 * cap}
    assert all(r["moe_decode_over_cap"] == 0 for r in four.memory_stats()["ranks"])
    four.core.check_integrity()


def _kill_during_generate(four: Engine, pid: int, pattern: str, after: str) -> None:
    """SIGKILL `pid` while `four` generates: RuntimeError matching `pattern` within 10 s, and
    `after` on the next call."""
    params = _params(200)
    prompts = random_prompts(VOCAB, [20] * 4, seed=3)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with deadline(60), pytest.raises(RuntimeError, match=pattern):
        for _ in range(1000):  # until the kill lands, mid-step or between steps
            four.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match=after):  # and it stays down
        four.generate(prompt_token_ids=prompts[:1], sampling_params=params)


@pytest.mark.parametrize("pair", ["qwen3_moe"], indirect=True)
def test_killed_data_parallel_rank_is_a_clear_error(pair):
    """Last with this engine: data-parallel rank 1's engine core killed."""
    _, _, four = pair
    core1 = four.core.parallel.procs[1].pid
    pattern = r"data-parallel rank 1 \(pid \d+\) was killed by SIGKILL"
    _kill_during_generate(four, core1, pattern, pattern)


@pytest.mark.parametrize("pair", ["gpt_oss"], indirect=True)
def test_killed_tensor_parallel_worker_is_a_clear_error(pair):
    """Last with this engine: rank 0's tensor-parallel worker killed (a process of this one)."""
    _, _, four = pair
    worker = four.core.local.parallel.procs[1].pid
    assert worker in spawned_children(os.getpid())
    pattern = r"tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL"
    _kill_during_generate(four, worker, pattern, pattern)
