"""Two "machines" on loopback: `swaserve serve -tp 2 --nnodes 2 --node-rank 0` (HTTP, engine
core, tensor-parallel rank 0) and `--node-rank 1` (rank 1 only), meeting at --dist-init-addr.
The pair serves the official client's requests with the greedy tokens of one process; a
SIGTERM to node 0 stops node 1's rank too; a killed node 1 takes node 0's server down with an
error naming the rank instead of a hang."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import kill_mid_stream
from tests.e2e.two_nodes import check_clean_stop, kill_node, start_pair, stop_pair

pytestmark = pytest.mark.slow  # two server processes of their own


def _start_pair(folder, tmp_path):
    flags = ["--model", str(folder), "-tp", "2", "--nnodes", "2", "--device", "cpu",
             "--kv-cache-gb", "0.05"]  # fmt: skip
    return start_pair(flags, tmp_path, timeout=180)


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
        check_clean_stop(node0, node1, tmp_path)
    finally:
        stop_pair(node0, node1)


def test_a_killed_node_stops_the_other_with_a_clear_error(tiny_model_folder, tmp_path):
    node0, node1 = _start_pair(tiny_model_folder, tmp_path)
    try:
        body = {"model": str(tiny_model_folder), "prompt": [5, 6, 7], "max_tokens": 2000,
                "stream": True, "ignore_eos": True}  # fmt: skip
        kill_mid_stream(node0, body, lambda: kill_node(node1))
        assert "tensor-parallel rank 1 on other nodes failed" in node0.log(), node0.log()[-3000:]
    finally:
        stop_pair(node0, node1)
