"""Expert parallelism over two "machines" on loopback: `swaserve serve -dp 2
--enable-expert-parallel --nnodes 2 --node-rank 0` (HTTP, the rendezvous, data-parallel rank 0)
and `--node-rank 1` (rank 1's engine core only, its pipes to node 0's frontend over TCP), on a
tiny random Qwen3-MoE (token ids in and out). Concurrent requests of the official client, on
both ranks, get one process's greedy tokens; node 0 stopping stops node 1 cleanly; a killed node
1 takes node 0's server down within seconds with an error naming the remote rank. With `-tp 2`
each rank is two processes of its node, and the tokens are the same."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import (
    RunningServer,
    concurrent_token_ids,
    free_port,
    kill_mid_stream,
    offline_greedy,
)
from tests.helpers import random_prompts, save_random_hf_model, tiny_moe_config

pytestmark = pytest.mark.slow  # two server processes of their own

FLAGS = ["-dp", "2", "--enable-expert-parallel", "--nnodes", "2", "--device", "cpu",
         "--dtype", "float32", "--kv-cache-gb", "0.01", "--page-size", "4",
         "--max-num-batched-tokens", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    cfg = tiny_moe_config()
    folder = tmp_path_factory.mktemp("moe")
    save_random_hf_model(cfg, folder)
    return folder


def _start_pair(folder, tmp_path, *extra: str) -> tuple[RunningServer, subprocess.Popen]:
    addr = f"127.0.0.1:{free_port()}"
    common = ["--model", str(folder), *FLAGS, *extra, "--dist-init-addr", addr]
    log = open(tmp_path / "node1.log", "w")  # noqa: SIM115 (the process owns it)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    # its own session: killing the group is the whole machine going away (launcher and core)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "swaserve.cli", "serve", *common, "--node-rank", "1"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
    node0 = RunningServer([*common, "--node-rank", "0"], tmp_path / "node0.log")
    try:
        node0.wait_ready(timeout=240)
    except BaseException:
        os.killpg(node1.pid, signal.SIGKILL)
        raise
    return node0, node1


def _stop_pair(node0: RunningServer, node1: subprocess.Popen) -> None:
    node0.stop()
    if node1.poll() is None:
        os.killpg(node1.pid, signal.SIGKILL)


def test_two_nodes_serve_with_one_process_tokens(moe_folder, tmp_path):
    prompts = random_prompts(128, [30, 7, 19, 41], seed=4)
    lens = [10, 25, 4, 17]  # unequal: a rank idles while the other decodes
    want = offline_greedy(moe_folder, prompts, lens, device="cpu", dtype="float32", page_size=4,
                          max_num_batched_tokens=16, kv_cache_gb=0.01)  # fmt: skip
    node0, node1 = _start_pair(moe_folder, tmp_path)
    try:
        assert concurrent_token_ids(node0, str(moe_folder), prompts, lens) == want
        mem = httpx.get(node0.base_url + "/memory", timeout=10).json()
        assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
        assert all(r["pages_total"] > 0 for r in mem["ranks"])
        assert node1.poll() is None  # node 1 serves as long as node 0 does
        node0.stop()
        assert node0.proc.returncode == 0, node0.log()[-2000:]
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        _stop_pair(node0, node1)


def test_two_nodes_of_tensor_parallel_ranks(moe_folder, tmp_path):
    """`-tp 2` too: each node runs its rank's core and tensor-parallel worker (their rendezvous
    local to the node), the experts over all four processes, each index's expert-parallel
    group across the nodes through node 0's store."""
    prompts = random_prompts(128, [23, 9, 35], seed=8)
    lens = [12, 5, 20]
    want = offline_greedy(moe_folder, prompts, lens, device="cpu", dtype="float32", page_size=4,
                          max_num_batched_tokens=16, kv_cache_gb=0.01)  # fmt: skip
    node0, node1 = _start_pair(moe_folder, tmp_path, "-tp", "2")
    try:
        assert concurrent_token_ids(node0, str(moe_folder), prompts, lens) == want
        mem = httpx.get(node0.base_url + "/memory", timeout=10).json()
        assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
        node0.stop()
        assert node0.proc.returncode == 0, node0.log()[-2000:]
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        _stop_pair(node0, node1)


def test_a_killed_node_stops_the_other_with_a_clear_error(moe_folder, tmp_path):
    node0, node1 = _start_pair(moe_folder, tmp_path)
    try:
        body = {"model": str(moe_folder), "prompt": [5, 6, 7], "max_tokens": 200,
                "stream": True, "ignore_eos": True}  # fmt: skip
        kill_mid_stream(node0, body, lambda: os.killpg(node1.pid, signal.SIGKILL))
        log = node0.log()
        # node 1's lost link, or (when node 0's rank saw it first) its failed collective
        assert re.search(r"engine core is gone \(dp rank 1: lost the link to its engine core on "
                         r"node 1|engine core is gone \(dp rank 0: .*data-parallel rank 1 on "
                         "other nodes failed", log), log[-3000:]  # fmt: skip
    finally:
        _stop_pair(node0, node1)
