"""Two "machines" on loopback: `swaserve serve -tp 2 --nnodes 2 --node-rank 0` (HTTP, engine
core, tensor-parallel rank 0) and `--node-rank 1` (rank 1 only), meeting at --dist-init-addr.
The pair serves the official client's requests with the greedy tokens of one process; a
SIGTERM to node 0 stops node 1's rank too; a killed node 1 takes node 0's server down with an
error naming the rank instead of a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.conftest import RunningServer, free_port, kill_mid_stream

pytestmark = pytest.mark.slow  # two server processes of their own


def _node1(folder, addr: str, log_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "swaserve.cli", "serve", "--model", str(folder), "-tp", "2",
           "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, "--device", "cpu",
           "--kv-cache-gb", "0.05"]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 (the process owns it; closed with the test)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    # its own session: killing the group is the whole machine going away (launcher and rank)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _start_pair(folder, tmp_path) -> tuple[RunningServer, subprocess.Popen]:
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(folder, addr, tmp_path / "node1.log")  # waits for node 0's rendezvous
    node0 = RunningServer(
        ["--model", str(folder), "-tp", "2", "--nnodes", "2", "--node-rank", "0",
         "--dist-init-addr", addr, "--device", "cpu", "--kv-cache-gb", "0.05"],
        tmp_path / "node0.log",
    )  # fmt: skip
    try:
        node0.wait_ready(timeout=180)
    except BaseException:
        node1.kill()
        raise
    return node0, node1


def test_two_nodes_serve_with_one_process_tokens(tiny_model_folder, tmp_path):
    from openai import OpenAI

    from swaserve import Engine, SamplingParams

    prompts = [[5, 17, 99, 3, 250], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    one = Engine(model=str(tiny_model_folder), device="cpu", kv_cache_gb=0.05)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # one at a time, as the server gets them: the same batch shapes
    want = [one.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids for p in prompts]
    del one
    node0, node1 = _start_pair(tiny_model_folder, tmp_path)
    try:
        client = OpenAI(base_url=node0.base_url, api_key="none")
        for ids, tokens in zip(prompts, want):
            r = client.completions.create(
                model=str(tiny_model_folder), prompt=ids, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            got = r.choices[0].model_extra.get("token_ids")
            assert got == tokens, (got, tokens)
        assert node1.poll() is None  # node 1 serves as long as node 0 does
        node0.stop()
        assert node0.proc.returncode == 0, node0.log()[-2000:]
        assert node1.wait(timeout=30) == 0, (tmp_path / "node1.log").read_text()[-2000:]
    finally:
        node0.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_a_killed_node_stops_the_other_with_a_clear_error(tiny_model_folder, tmp_path):
    node0, node1 = _start_pair(tiny_model_folder, tmp_path)
    try:
        body = {"model": str(tiny_model_folder), "prompt": [5, 6, 7], "max_tokens": 2000,
                "stream": True, "ignore_eos": True}  # fmt: skip
        kill_mid_stream(node0, body, lambda: os.killpg(node1.pid, signal.SIGKILL))
        assert "tensor-parallel rank 1 on other nodes failed" in node0.log(), node0.log()[-3000:]
    finally:
        node0.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
