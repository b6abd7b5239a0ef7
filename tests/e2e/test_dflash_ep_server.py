"""`swaserve serve -dp 2 --enable-expert-parallel --speculative-algorithm dflash
--speculative-draft-model PATH` on CPU: concurrent requests over both ranks give the greedy
tokens of one offline process without speculation, each response's `spec_decoding` shows verify
steps, with drafts accepted over the requests; an idle server then answers a request on one rank
(the other idle in its every step). The tiny Qwen3-MoE target and DFlash drafter of
tests/unit/test_dflash_ep.py, which checks the drafts and metrics in the offline Engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from swaserve import Engine, SamplingParams
from tests.e2e.conftest import RunningServer
from tests.unit.test_dflash_engine import _prompts
from tests.unit.test_dflash_ep import ENGINE, save_moe_target_and_drafter

pytestmark = pytest.mark.slow  # starts its own server (two core processes)

FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-gb", "0.01", "--page-size", "4",
         "--max-num-batched-tokens", "16", "--max-num-seqs", "2"]  # fmt: skip


def _complete(srv: RunningServer, model: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_served_dflash_equals_one_process(tmp_path):
    target, drafter = save_moe_target_and_drafter(tmp_path)
    args = ["--model", target, "-dp", "2", "--enable-expert-parallel", "--speculative-algorithm",
            "dflash", "--speculative-draft-model", drafter, "--disable-adaptive-speculation",
            *FLAGS]  # fmt: skip
    prompts, lens = _prompts(), [20, 16, 24, 12]
    off = Engine(model=target, **ENGINE)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
    want = [o.token_ids for o in off.generate(prompt_token_ids=prompts, sampling_params=params,
                                              use_tqdm=False)]  # fmt: skip
    srv = RunningServer(args, tmp_path / "server.log")
    try:
        srv.wait_ready(timeout=180)
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda a: _complete(srv, target, *a), zip(prompts, lens)))
        for g, w in zip(got, want, strict=True):
            assert g["choices"][0]["token_ids"] == w
            assert g["spec_decoding"]["spec_verify_ct"] > 0
        assert sum(g["spec_decoding"]["spec_accepted_drafts"] for g in got) > 0
        alone = _complete(srv, target, prompts[1], 16)  # one rank busy, the other idle
        assert alone["choices"][0]["token_ids"] == want[1]
        assert alone["spec_decoding"]["spec_verify_ct"] > 0
    finally:
        srv.stop()
