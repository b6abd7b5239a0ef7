"""Expert parallelism over two "machines" on loopback: `swaserve serve -dp 2
--enable-expert-parallel --nnodes 2 --node-rank 0` (HTTP, the rendezvous, data-parallel rank 0)
and `--node-rank 1` (rank 1's engine core only, its pipes to node 0's frontend over TCP), on a
tiny random Qwen3-MoE (token ids in and out). Concurrent requests of the official client, on
both ranks, get one process's greedy tokens; node 0 stopping stops node 1 cleanly; a killed node
1 takes node 0's server down within seconds with an error naming the remote rank. With `-tp 2`
each rank is two processes of its node, and the tokens are the same."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.e2e.conftest import concurrent_token_ids, kill_mid_stream, offline_greedy
from tests.e2e.two_nodes import check_clean_stop, kill_node, start_pair, stop_pair
from tests.helpers import random_prompts

pytestmark = pytest.mark.slow  # two server processes of their own

FLAGS = ["-dp", "2", "--enable-expert-parallel", "--nnodes", "2", "--device", "cpu",
         "--dtype", "float32", "--kv-cache-gb", "0.01", "--page-size", "4",
         "--max-num-batched-tokens", "16"]  # fmt: skip


OFFLINE = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16,
               kv_cache_gb=0.01)  # the Engine of those flags


def _start_pair(folder, tmp_path, *extra: str):
    return start_pair(["--model", str(folder), *FLAGS, *extra], tmp_path)


def test_two_nodes_serve_with_one_process_tokens(tiny_moe_folder, tmp_path):
    prompts = random_prompts(128, [30, 7, 19, 41], seed=4)
    lens = [10, 25, 4, 17]  # unequal: a rank idles while the other decodes
    want = offline_greedy(tiny_moe_folder, prompts, lens, **OFFLINE)
    node0, node1 = _start_pair(tiny_moe_folder, tmp_path)
    try:
        assert concurrent_token_ids(node0, str(tiny_moe_folder), prompts, lens) == want
        mem = httpx.get(node0.base_url + "/memory", timeout=10).json()
        assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
        assert all(r["pages_total"] > 0 for r in mem["ranks"])
        check_clean_stop(node0, node1, tmp_path)
    finally:
        stop_pair(node0, node1)


def test_two_nodes_of_tensor_parallel_ranks(tiny_moe_folder, tmp_path):
    """`-tp 2` too: each node runs its rank's core and tensor-parallel worker (their rendezvous
    local to the node), the experts over all four processes, each index's expert-parallel
    group across the nodes through node 0's store."""
    prompts = random_prompts(128, [23, 9, 35], seed=8)
    lens = [12, 5, 20]
    want = offline_greedy(tiny_moe_folder, prompts, lens, **OFFLINE)
    node0, node1 = _start_pair(tiny_moe_folder, tmp_path, "-tp", "2")
    try:
        assert concurrent_token_ids(node0, str(tiny_moe_folder), prompts, lens) == want
        mem = httpx.get(node0.base_url + "/memory", timeout=10).json()
        assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
        check_clean_stop(node0, node1, tmp_path)
    finally:
        stop_pair(node0, node1)


def test_a_killed_node_stops_the_other_with_a_clear_error(tiny_moe_folder, tmp_path):
    node0, node1 = _start_pair(tiny_moe_folder, tmp_path)
    try:
        body = {"model": str(tiny_moe_folder), "prompt": [5, 6, 7], "max_tokens": 200,
                "stream": True, "ignore_eos": True}  # fmt: skip
        kill_mid_stream(node0, body, lambda: kill_node(node1))
        log = node0.log()
        # node 1's lost link, or (when node 0's rank saw it first) its failed collective
        assert re.search(r"engine core is gone \(dp rank 1: lost the link to its engine core on "
                         r"node 1|engine core is gone \(dp rank 0: .*data-parallel rank 1 on "
                         "other nodes failed", log), log[-3000:]  # fmt: skip
    finally:
        stop_pair(node0, node1)
