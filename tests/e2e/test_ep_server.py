"""`swaserve serve -dp 2 --enable-expert-parallel` on CPU, a tiny random Qwen3-MoE (token ids
in, token ids out: it has no tokenizer): concurrent requests over both ranks give the greedy
tokens of one offline process; an idle server answers a new request at once (no rank left
waiting in a collective); /v1/memory has both ranks; a dense model is refused at start; one
rank's core killed: live requests fail, /health answers 503 naming the rank and the server
exits non-zero within seconds (last)."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from tests.e2e.conftest import RunningServer, check_dead_rank_1_stops_server
from tests.helpers import save_random_hf_model

pytestmark = pytest.mark.slow  # starts its own server (two core processes)

FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.01", "--page-size", "4",
         "--max-num-batched-tokens", "16"]  # fmt: skip
COMMON = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
              vocab_size=128, num_key_value_heads=2)  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    moe = transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=96, num_hidden_layers=3, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
    )  # fmt: skip
    dense = transformers.LlamaConfig(**COMMON, intermediate_size=96, num_hidden_layers=2)
    out = {}
    for name, cfg in (("moe", moe), ("dense", dense)):
        out[name] = tmp_path_factory.mktemp(name)
        save_random_hf_model(cfg, out[name])
    return out


@pytest.fixture(scope="module")
def ep_server(folders, tmp_path_factory):
    args = ["--model", str(folders["moe"]), "-dp", "2", "--enable-expert-parallel", *FLAGS]
    srv = RunningServer(args, tmp_path_factory.mktemp("ep") / "server.log")
    try:
        srv.wait_ready(timeout=180)
        yield srv
    finally:
        srv.stop()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (30, 7, 19, 41, 12, 3)]


def _complete(srv: RunningServer, folder, ids: list[int], max_tokens: int) -> list[int]:
    body = {"model": str(folder), "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_concurrent_requests_equal_one_process(ep_server, folders):
    prompts = _prompts()
    lens = [10, 25, 4, 17, 30, 8]  # unequal batches on both ranks, ranks idle at times
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda a: _complete(ep_server, folders["moe"], *a), zip(prompts, lens)))
    one = Engine(model=str(folders["moe"]), device="cpu", dtype="float32", page_size=4,
                 max_num_batched_tokens=16, kv_cache_gb=0.01, disable_fused_ops=True)  # fmt: skip
    want = [
        o.token_ids
        for o in one.generate(
            prompt_token_ids=prompts,
            sampling_params=[
                SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens
            ],  # fmt: skip
        )
    ]
    assert got == want
    mem = httpx.get(ep_server.base_url + "/memory", timeout=10).json()
    assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]


def test_an_idle_server_answers_at_once(ep_server, folders):
    time.sleep(1.5)  # both ranks idle: they poll and agree, nobody waits in a forward
    start = time.monotonic()
    assert len(_complete(ep_server, folders["moe"], [1, 2, 3], 3)) == 3
    assert time.monotonic() - start < 5


def test_dense_model_is_refused_at_start(folders):
    cmd = [sys.executable, "-m", "swaserve.cli", "serve", "--model", str(folders["dense"]),
           "-dp", "2", "--enable-expert-parallel", "--port", "0", *FLAGS]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--enable-expert-parallel needs a mixture-of-experts model" in r.stderr + r.stdout


def test_a_dead_rank_fails_requests_and_stops_the_server(ep_server, folders):
    body = {"model": str(folders["moe"]), "prompt": [5, 6, 7], "max_tokens": 200,
            "stream": True, "ignore_eos": True}  # fmt: skip
    check_dead_rank_1_stops_server(ep_server, body)
