"""`swaserve serve -dp 2 -tp 2` on CPU: two engine-core replicas, each rank 0 of its own
two-rank tensor-parallel group (one spawned worker each), behind one frontend. The official
client's concurrent requests get one process's greedy tokens, spread over both replicas;
/v1/memory has both; a killed worker of replica 1 takes the server down within seconds, its
log and /health naming the replica and the rank."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import (
    RunningServer,
    check_both_ranks_served,
    concurrent_token_ids,
    kill_worker_of_rank_1,
    offline_greedy,
)
from tests.helpers import random_prompts

pytestmark = pytest.mark.slow  # its own server: 2 core processes and 2 workers

FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.05", "--page-size", "4",
         "--max-num-batched-tokens", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def dp_tp_server(tiny_model_folder, tmp_path_factory):
    args = ["--model", str(tiny_model_folder), "-dp", "2", "-tp", "2", *FLAGS]
    srv = RunningServer(args, tmp_path_factory.mktemp("dptp") / "server.log")
    try:
        srv.wait_ready(timeout=300)
        yield srv
    finally:
        srv.stop()


def test_concurrent_requests_equal_one_process(dp_tp_server, tiny_model_folder):
    prompts = random_prompts(49152, [30, 7, 19, 41, 12, 3], seed=4)
    lens = [10, 25, 4, 17, 30, 8]
    want = offline_greedy(tiny_model_folder, prompts, lens, device="cpu", dtype="float32",
                          page_size=4, max_num_batched_tokens=16, kv_cache_gb=0.05)  # fmt: skip
    assert concurrent_token_ids(dp_tp_server, str(tiny_model_folder), prompts, lens) == want
    ranks = check_both_ranks_served(dp_tp_server)
    assert all(r["pages_total"] > 0 for r in ranks)


def test_a_killed_worker_of_replica_1_stops_the_server(dp_tp_server, tiny_model_folder):
    body = {"model": str(tiny_model_folder), "prompt": [5, 6, 7], "max_tokens": 2000,
            "stream": True, "ignore_eos": True}  # fmt: skip
    kill_worker_of_rank_1(dp_tp_server, body)
    log = dp_tp_server.log()
    assert re.search(r"dp rank 1: .*tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL",
                     log, re.S), log[-3000:]  # fmt: skip
