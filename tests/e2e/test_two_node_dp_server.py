"""Plain data-parallel replicas over two "machines" on loopback: `swaserve serve -dp 2 --nnodes 2
--node-rank 0` (HTTP, the rendezvous store, replica 0) and `--node-rank 1` (replica 1's engine
core only, its pipes to node 0's frontend over TCP), on the tiny random Qwen3-MoE of the
expert-parallel test without expert parallelism (each replica holds every expert).

Concurrent requests of the official client land on both replicas and get one process's greedy
tokens, with `-tp 2` too; node 0 stopping stops node 1 (status 0). No collective ties the
replicas, so only the lost link tells node 0 that node 1 is gone (server/link_watch.py): node 1
killed (its process group: the machine), frozen (SIGSTOP: a machine that stops answering, found
by the heartbeats) or only its engine core killed, while a request streams from that replica,
ends the request with an error and node 0's server within seconds, naming the rank and its
node. Node 0 killed stops node 1. Every wait is bounded (startup 240 s, a request 60 s, the exit
15 s after the kill)."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from tests.e2e.conftest import (
    RunningServer,
    check_both_ranks_served,
    concurrent_token_ids,
    kill_mid_stream,
    offline_greedy,
)
from tests.e2e.two_nodes import (
    check_clean_stop,
    kill_node,
    node1_core_pid,
    node1_log,
    start_pair,
    stop_pair,
)
from tests.helpers import random_prompts

pytestmark = pytest.mark.slow  # two server processes of their own

FLAGS = ["-dp", "2", "--nnodes", "2", "--device", "cpu", "--dtype", "float32",
         "--kv-cache-gb", "0.01", "--page-size", "4", "--max-num-batched-tokens", "16"]  # fmt: skip
OFFLINE = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16,
               kv_cache_gb=0.01)  # one replica's Engine: the same flags, one process


def _start_pair(folder, tmp_path, *extra: str):
    return start_pair(["--model", str(folder), *FLAGS, *extra], tmp_path)


@pytest.mark.parametrize("tp", [1, 2])
def test_two_nodes_serve_replicas_with_one_process_tokens(tiny_moe_folder, tmp_path, tp):
    """With `-tp 2` each replica is its core and a worker on its node, meeting on a local port
    (not --dist-init-addr's, where node 0's store is)."""
    prompts = random_prompts(128, [30, 7, 19, 41], seed=4)
    lens = [10, 25, 4, 17]
    want = offline_greedy(tiny_moe_folder, prompts, lens, **OFFLINE)
    node0, node1 = _start_pair(tiny_moe_folder, tmp_path, "-tp", str(tp))
    try:
        assert concurrent_token_ids(node0, str(tiny_moe_folder), prompts, lens) == want
        ranks = check_both_ranks_served(node0)  # /v1/memory and /metrics dp_rank 0 and 1
        assert all(r["pages_total"] > 0 for r in ranks)
        assert "(dp rank 1 of 2, node 1)" in node1_log(tmp_path)  # replica 1 ran on node 1
        check_clean_stop(node0, node1, tmp_path)
    finally:
        stop_pair(node0, node1)


def _stream_on_rank_1(node0: RunningServer, folder) -> dict:
    """A long streamed completion's body (the context is 256), after a short request that
    replica 0 takes (both idle: the lower rank), so that the stream goes to replica 1 (fewer
    requests so far)."""
    short = {"model": str(folder), "prompt": [9, 8, 7], "max_tokens": 2}
    assert httpx.post(node0.base_url + "/completions", json=short, timeout=60).status_code == 200
    return {"model": str(folder), "prompt": [5, 6, 7], "max_tokens": 250, "stream": True,
            "ignore_eos": True}  # fmt: skip


@pytest.mark.parametrize("what", ["node", "frozen", "core"])
def test_a_dead_node_stops_the_server_naming_the_rank(tiny_moe_folder, tmp_path, what):
    node0, node1 = _start_pair(tiny_moe_folder, tmp_path)
    try:
        body = _stream_on_rank_1(node0, tiny_moe_folder)
        core = node1_core_pid(tmp_path, 1)

        def kill() -> None:
            ranks = httpx.get(node0.base_url + "/memory", timeout=10).json()["ranks"]
            assert [r["num_running"] for r in ranks] == [0, 1]  # the stream is replica 1's
            if what == "node":
                kill_node(node1)
            elif what == "frozen":
                os.killpg(node1.pid, signal.SIGSTOP)  # stop_pair's SIGKILL ends it
            else:
                os.kill(core, signal.SIGKILL)

        # the stream ends with an error, node 0 exits non-zero within 15 s of the kill
        kill_mid_stream(node0, body, kill)
        log = node0.log()
        assert re.search(r"engine core is gone \(dp rank 1: lost the link to its engine core on "
                         "node 1", log), log[-3000:]  # fmt: skip
        if what == "core":  # node 1 outlived its core: it says so and fails
            assert node1.wait(timeout=30) == 1, node1_log(tmp_path)[-2000:]
            assert "dp rank 1's engine core process" in node1_log(tmp_path)
    finally:
        stop_pair(node0, node1)


def test_node_0_killed_stops_node_1(tiny_moe_folder, tmp_path):
    """Node 0 gone without a word (SIGKILL: no `shutdown` sent): node 1's core finds its link
    lost and exits as a core whose server died does; node 1 then exits 0."""
    node0, node1 = _start_pair(tiny_moe_folder, tmp_path)
    try:
        node0.proc.kill()
        assert node1.wait(timeout=15) == 0, node1_log(tmp_path)[-2000:]
    finally:
        stop_pair(node0, node1)
