"""Tensor parallelism on CPU (gloo), 2 ranks: greedy tokens and logprobs of TP=2 equal TP=1 in
float32 (within 1e-4) on tiny random Llama (a vocabulary not divisible by 2, one KV head, so KV
heads replicated), Qwen3 (tied embeddings), Gemma 3 (prompts past its window, prefix hits with
copy-on-write mirrored), Qwen3-MoE and gpt-oss; chunked prefill throughout. The weights of each
rank's shard equal the slices of the full tensors (checkpoint and dummy); a killed worker is a
clear error within seconds; flags that do not run with TP are refused, the host and disk tiers
accepted (test_tp_host_cache.py runs them); the NCCL guard decides.

Engines start once per model (a module-scoped fixture per model, one TP=2 engine alive at a
time). The server with -tp 2 is the slow test at the end.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from swaserve.config import EngineConfig
from swaserve.distributed.layers import shard_model
from swaserve.distributed.nccl_guard import apply_nccl_guard, nccl_graph_register
from swaserve.distributed.parallel_state import TPGroup
from swaserve.weights.loader import build_model, load_hf_config
from tests.helpers import (
    assert_same_outputs,
    engine_prompt_logits,
    random_prompts,
    save_random_hf_models,
    spawned_children,
)

TOL = 1e-4
ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16,
              kv_cache_gb=0.01)  # fmt: skip
COMMON = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256)


def _configs() -> dict:
    t = transformers
    return {
        # vocabulary 129: padded to 130 over 2 ranks; one KV head: replicated on both ranks
        "llama": t.LlamaConfig(
            **COMMON, vocab_size=129, intermediate_size=96, num_key_value_heads=1,
            num_hidden_layers=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        ),
        "qwen3": t.Qwen3Config(
            **COMMON, vocab_size=128, intermediate_size=96, num_key_value_heads=2,
            num_hidden_layers=2, tie_word_embeddings=True,
        ),
        "gemma3": t.Gemma3TextConfig(
            **COMMON, vocab_size=128, intermediate_size=96, num_key_value_heads=2,
            num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            final_logit_softcapping=3.0,
        ),
        # fused q|k|v and gate|up in the checkpoint, split at load, then sharded
        "phi3": t.Phi3Config(
            **COMMON, vocab_size=128, intermediate_size=96, num_key_value_heads=2,
            num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False,
        ),
        "qwen3_moe": t.Qwen3MoeConfig(
            **COMMON, vocab_size=128, intermediate_size=96, num_key_value_heads=2,
            num_hidden_layers=3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
        ),
        "gpt_oss": t.GptOssConfig(
            **COMMON, vocab_size=128, intermediate_size=32, num_key_value_heads=2,
            num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            tie_word_embeddings=False,
        ),
    }  # fmt: skip


NAMES = list(_configs())


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return save_random_hf_models(_configs(), tmp_path_factory)


@pytest.fixture(scope="module", params=NAMES)
def pair(request, folders):
    """(name, TP=1 engine, TP=2 engine) on the same checkpoint; one pair alive at a time."""
    name = request.param
    # Dense weights on both (the TP ranks never pack theirs for oneDNN, ops/cpu_pack.py): the
    # tests compare their parameters.
    one = Engine(model=str(folders[name]), disable_fused_ops=True, **ENGINE)
    two = Engine(model=str(folders[name]), tensor_parallel_size=2, **ENGINE)
    yield name, one, two
    two.core.shutdown()


def test_greedy_tokens_and_logprobs_equal_tp1(pair):
    name, one, two = pair
    vocab = one.core.hf_config.vocab_size
    prompts = random_prompts(vocab, [37, 9, 23, 50])  # chunks of 16: prefill in pieces, mixed steps
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    assert_same_outputs(
        one.generate(prompt_token_ids=prompts, sampling_params=params),
        two.generate(prompt_token_ids=prompts, sampling_params=params),
    )
    two.core.memory.check_integrity()
    # rank 0's live weights: its slices of the TP=1 model's
    full = dict(one.core.model.named_parameters())
    with torch.device("meta"):
        shards = shard_model(type(one.core.model)(one.core.hf_config), TPGroup.layout_only(0, 2))
    for pname, p in two.core.model.named_parameters():
        want = (
            shards[pname].take(full[pname], p.shape[shards[pname].dim])
            if pname in shards
            else full[pname]
        )
        assert torch.equal(p, want), pname


@pytest.mark.parametrize("pair", ["gemma3"], indirect=True)
def test_ngram_speculation_under_tp_equals_tp1(pair, folders):
    """n-gram drafting with TP = 2 (verify chunks are forwards on every rank, drafts and
    acceptance on rank 0): the tokens and logprobs of TP = 1 without speculation, through
    chunked prefill, windows and full, partial and zero acceptances."""
    from tests.unit.test_spec_engine import _check_counters, _histogram, _repetitive

    name, one, _ = pair
    prompts = _repetitive(random.Random(0), 4, 5, 8)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    spec = Engine(model=str(folders[name]), tensor_parallel_size=2, speculative_algorithm="ngram",
                  speculative_num_draft_tokens=3, disable_adaptive_speculation=True, **ENGINE)
    try:
        got = spec.generate(prompt_token_ids=prompts, sampling_params=params)
        spec.core.memory.check_integrity()
    finally:
        spec.core.shutdown()
    assert_same_outputs(one.generate(prompt_token_ids=prompts, sampling_params=params), got)
    _check_counters(got)
    h = _histogram(got)
    assert h[0] > 0 and h[-1] > 0 and len(h) == 4, h  # zero and full acceptances happened


@pytest.mark.parametrize("pair", ["llama", "gemma3"], indirect=True)
def test_prompt_logits_equal_tp1(pair):
    """Every position's logits (the vocabulary gathered, its padding cut) through chunked
    prefill: a padded vocabulary (Llama), softcapped logits (Gemma 3)."""
    name, one, two = pair
    ids = random_prompts(one.core.hf_config.vocab_size, [40], seed=3)[0]
    want, got = engine_prompt_logits(one, ids), engine_prompt_logits(two, ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("pair", ["gemma3"], indirect=True)
def test_prefix_hits_and_copy_on_write_mirrored(pair):
    """Gemma 3: prompts past the window share a prefix that ends inside a page: the hit's
    last page is copied (copy-on-write) on every rank, and outputs still equal TP=1."""
    name, one, two = pair
    copies = []
    mirror = two.core.cache.mover.mirror
    two.core.cache.mover.mirror = lambda s, d: (copies.append((list(s), list(d))), mirror(s, d))
    try:
        base = random_prompts(128, [30], seed=5)[0]
        first = [base + [1, 2, 3]]
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
        assert_same_outputs(
            one.generate(prompt_token_ids=first, sampling_params=params),
            two.generate(prompt_token_ids=first, sampling_params=params),
        )
        second = [base[:27] + [7, 8, 9, 10, 11], base[:29] + [12] * 9]
        a = one.generate(prompt_token_ids=second, sampling_params=params)
        b = two.generate(prompt_token_ids=second, sampling_params=params)
    finally:
        two.core.cache.mover.mirror = mirror
    assert_same_outputs(a, b)
    assert [o.num_cached_tokens for o in b] == [o.num_cached_tokens for o in a]
    assert all(o.num_cached_tokens > 8 for o in b)  # hits reach past the window
    assert copies, "no copy-on-write page copy was mirrored"
    two.core.memory.check_integrity()


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dummy", [False, True])
def test_shards_are_slices_of_the_full_tensors(folders, name, dummy):
    """Both ranks, loaded from the checkpoint (per-expert and interleaved expert layouts
    included) or drawn as dummy weights: every parameter equals its slice of the full one;
    vocabulary padding is zero."""
    hf = load_hf_config(folders[name])
    cpu = torch.device("cpu")
    full = dict(build_model(hf, folders[name], torch.float32, cpu, dummy, 0).named_parameters())
    for rank in range(2):
        tp = TPGroup.layout_only(rank, 2)
        model = build_model(hf, folders[name], torch.float32, cpu, dummy, 0, tp)
        with torch.device("meta"):
            shards = shard_model(type(model)(hf), tp)
        assert any(k.endswith("w13") for k in shards) == (name != "llama")
        for pname, p in model.named_parameters():
            if pname not in shards:
                assert torch.equal(p, full[pname]), pname
                continue
            s = shards[pname]
            assert torch.equal(p, s.take(full[pname], p.shape[s.dim])), pname
            assert p.shape[s.dim] * 2 >= full[pname].shape[s.dim], pname


def test_killed_worker_is_a_clear_error_within_seconds(folders):
    engine = Engine(model=str(folders["llama"]), tensor_parallel_size=2, **ENGINE)
    try:
        worker = engine.core.parallel.procs[1]
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        prompts = random_prompts(129, [20] * 4)
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 .*killed by SIGKILL"):
            for _ in range(1000):  # until the kill lands, mid-step or between steps
                engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="rank 1"):  # and it stays down
            engine.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    finally:
        engine.core.shutdown()


def test_flags_refused_with_tp_name_themselves(folders):
    # DFlash runs with -tp (test_dflash_tp.py), inside expert-parallel ranks too
    # (test_dflash_ep.py)
    EngineConfig(tensor_parallel_size=2, speculative_algorithm="dflash")
    EngineConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
                 speculative_algorithm="dflash")
    # the prefix cache's host and disk tiers run under TP (test_tp_host_cache.py)
    cfg = EngineConfig(tensor_parallel_size=2, host_cache_gb=1.0, disk_cache_dir="/tmp/x")
    assert (cfg.host_cache_gb, cfg.disk_cache_dir) == (1.0, "/tmp/x")
    with pytest.raises(ValueError, match=r"^invalid --tensor-parallel-size 0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"^invalid --nnodes 3 .*divide"):
        EngineConfig(tensor_parallel_size=2, nnodes=3)
    with pytest.raises(ValueError, match=r"^invalid --nnodes 2 .*--dist-init-addr"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match=r"^invalid --dist-init-addr 'nohost'"):
        EngineConfig(dist_init_addr="nohost")
    # A model that does not split: an error before any worker starts.
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 must divide .* heads \(4\)"):
        Engine(model=str(folders["qwen3"]), tensor_parallel_size=3, **ENGINE)


def test_tp_flag_and_its_short_form():
    import argparse

    from swaserve.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv in (["-tp", "2"], ["--tensor-parallel-size", "2"]):
        cfg = EngineConfig(**engine_kwargs(p.parse_args(argv)))
        assert cfg.tensor_parallel_size == 2 and cfg.nnodes == 1 and cfg.dist_init_addr is None
    argv = ["-tp", "2", "--host-cache-gb", "1", "--disk-cache-dir", "/tmp/x"]
    cfg = EngineConfig(**engine_kwargs(p.parse_args(argv)))
    assert (cfg.host_cache_gb, cfg.disk_cache_dir) == (1.0, "/tmp/x")


def test_nccl_graph_register_guard():
    # graphs on and more than one rank: off, unless the user chose
    assert nccl_graph_register({}, cuda_graphs=True, tensor_parallel=2) == "0"
    assert nccl_graph_register({}, cuda_graphs=True, tensor_parallel=1, data_parallel=4) == "0"
    assert nccl_graph_register({"NCCL_GRAPH_REGISTER": "1"}, True, 8) is None
    assert nccl_graph_register({}, cuda_graphs=False, tensor_parallel=8) is None
    assert nccl_graph_register({}, cuda_graphs=True, tensor_parallel=1) is None
    env: dict[str, str] = {}
    apply_nccl_guard(True, 2, env)
    assert env == {"NCCL_GRAPH_REGISTER": "0"}
    env = {"NCCL_GRAPH_REGISTER": "1"}
    apply_nccl_guard(True, 2, env)
    assert env == {"NCCL_GRAPH_REGISTER": "1"}


@pytest.mark.parametrize("pair", ["llama"], indirect=True)
def test_fp8_kv_scales_agree_over_the_ranks(pair, folders):
    """FP8 KV: each rank calibrates on its heads, the scales are the largest over the ranks:
    those one process gets, and the same tokens."""
    _, one, _ = pair
    kw = {**ENGINE, "kv_cache_dtype": "fp8_e4m3"}
    one8 = Engine(model=str(folders["llama"]), disable_fused_ops=True, **kw)  # dense: as TP
    two8 = Engine(model=str(folders["llama"]), tensor_parallel_size=2, **kw)
    try:
        for a, b in (
            (one8.core.kv.k_scales, two8.core.kv.k_scales),
            (one8.core.kv.v_scales, two8.core.kv.v_scales),
        ):
            assert a == pytest.approx(b, rel=1e-6)
        prompts = random_prompts(129, [30, 11], seed=7)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        a = one8.generate(prompt_token_ids=prompts, sampling_params=params)
        b = two8.generate(prompt_token_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    finally:
        two8.core.shutdown()


@pytest.mark.slow
def test_server_with_tp2_then_a_worker_dies(folders, tmp_path):
    """`swaserve serve -tp 2`: completions equal the offline TP=1 engine's; a killed worker
    makes the server exit non-zero, its log naming the rank."""
    import httpx

    from tests.e2e.conftest import RunningServer

    folder = str(folders["llama"])
    srv = RunningServer(
        [
            "--model",
            folder,
            "-tp",
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--page-size",
            "4",
            "--kv-cache-gb",
            "0.01",
        ],
        tmp_path / "tp2.log",
    )
    try:
        srv.wait_ready(timeout=300)
        prompts = random_prompts(129, [25, 9], seed=11)
        want = Engine(model=folder, disable_fused_ops=True, **ENGINE).generate(  # dense: as TP
            prompt_token_ids=prompts,
            sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        )
        for ids, w in zip(prompts, want):
            r = httpx.post(srv.base_url + "/completions", timeout=60, json={
                "model": folder, "prompt": ids, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})  # fmt: skip
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == w.token_ids
        workers = spawned_children(srv.core_pid())
        assert len(workers) == 1
        start = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        assert srv.proc.wait(timeout=20) != 0
        assert time.monotonic() - start < 15
        assert "tensor-parallel rank 1" in srv.log() and "SIGKILL" in srv.log()
    finally:
        srv.stop()
