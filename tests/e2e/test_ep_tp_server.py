"""`swaserve serve -dp 2 -tp 2 --enable-expert-parallel` on CPU: two engine cores, each with one
tensor-parallel worker, the experts of a tiny random Qwen3-MoE (one KV head, a vocabulary of
129: token ids in and out) over all four processes. Concurrent requests get one offline
process's greedy tokens, spread over both ranks; /v1/memory has both; a killed worker of rank 1
(a process of its core) fails the live request and takes the server down within seconds, the
log naming that worker by its pid (last)."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import (
    RunningServer,
    check_both_ranks_served,
    kill_worker_of_rank_1,
    offline_greedy,
)
from tests.e2e.test_ep_server import _complete
from tests.helpers import random_prompts, save_random_hf_model, tiny_moe_config

pytestmark = pytest.mark.slow  # its own server: 2 core processes and 2 workers

FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.01", "--page-size", "4",
         "--max-num-batched-tokens", "16"]  # fmt: skip
VOCAB = 129


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    save_random_hf_model(tiny_moe_config(vocab_size=VOCAB, num_key_value_heads=1), out)
    return out


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    args = ["--model", str(folder), "-dp", "2", "-tp", "2", "--enable-expert-parallel", *FLAGS]
    srv = RunningServer(args, tmp_path_factory.mktemp("eptp") / "server.log")
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


def test_concurrent_requests_equal_one_process(server, folder):
    from concurrent.futures import ThreadPoolExecutor

    prompts = random_prompts(VOCAB, [30, 7, 19, 41, 12, 3], seed=4)
    lens = [10, 25, 4, 17, 30, 8]  # unequal batches on both ranks, ranks idle at times
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda a: _complete(server, folder, *a), zip(prompts, lens)))
    want = offline_greedy(folder, prompts, lens, device="cpu", dtype="float32", page_size=4,
                          max_num_batched_tokens=16, kv_cache_gb=0.01)  # fmt: skip
    assert got == want
    assert all(r["moe_decode_steps"] > 0 for r in check_both_ranks_served(server))


def test_a_killed_worker_of_rank_1_stops_the_server(server, folder):
    body = {"model": str(folder), "prompt": [5, 6, 7], "max_tokens": 240, "stream": True,
            "ignore_eos": True}  # fmt: skip
    worker = kill_worker_of_rank_1(server, body)
    log = server.log()
    named = rf"tensor-parallel rank 1 \(pid {worker}\) (was killed by SIGKILL|is gone)"
    assert re.search(r"engine core is gone \(dp rank \d: .*" + named, log), log[-3000:]
