"""`swaserve serve -dp 2 -tp 2` on CPU: two engine-core replicas, each rank 0 of its own
two-rank tensor-parallel group (one spawned worker each), behind one frontend. The official
client's concurrent requests get one process's greedy tokens, spread over both replicas;
/v1/memory has both; a killed worker of replica 1 takes the server down within seconds, its
log and /health naming the replica and the rank."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from tests.e2e.conftest import (
    RunningServer,
    concurrent_token_ids,
    kill_mid_stream,
    offline_greedy,
)
from tests.helpers import random_prompts, spawned_children

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
    mem = httpx.get(dp_tp_server.base_url + "/memory", timeout=10).json()
    assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
    assert all(r["pages_total"] > 0 for r in mem["ranks"])
    text = httpx.get(dp_tp_server.url + "/metrics", timeout=10).text
    for rank in ("0", "1"):  # both replicas served some
        m = re.search(rf'swaserve:request_success_total{{dp_rank="{rank}"[^}}]*}} (\S+)', text)
        assert m and float(m.group(1)) > 0, text[:2000]


def test_a_killed_worker_of_replica_1_stops_the_server(dp_tp_server, tiny_model_folder):
    log = dp_tp_server.log()
    core = int(re.search(r"engine core process (\d+) is loading .*dp rank 1", log).group(1))
    workers = spawned_children(core)
    assert len(workers) == 1, workers
    body = {"model": str(tiny_model_folder), "prompt": [5, 6, 7], "max_tokens": 2000,
            "stream": True, "ignore_eos": True}  # fmt: skip
    kill_mid_stream(dp_tp_server, body, lambda: os.kill(workers[0], signal.SIGKILL))
    log = dp_tp_server.log()
    assert re.search(r"dp rank 1: .*tensor-parallel rank 1 \(pid \d+\) was killed by SIGKILL",
                     log, re.S), log[-3000:]  # fmt: skip
