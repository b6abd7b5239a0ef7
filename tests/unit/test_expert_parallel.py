"""Data-parallel attention + expert-parallel MoE on CPU (gloo), 2 ranks, offline
(`Engine(data_parallel_size=2, enable_expert_parallel=True)`: rank 0 here, rank 1 spawned).

Against one process on the same checkpoint, in float32: greedy tokens equal and logprobs /
logits within 1e-4 on tiny random Qwen3-MoE (a dense layer among the sparse ones) and gpt-oss
(router and expert biases, sliding layers), through chunked prefill (16-token steps) and a
prefix hit. The idle-rank cases: one rank without requests for many steps while the other
decodes (it runs idle forwards), an abort on either rank mid-decode, unequal batches every
step; a killed rank is a clear error naming it within seconds. Each rank's memory manager
passes check_integrity() after every case. Every test runs under a deadline (no hang).

Engines start once per model (module-scoped, one 2-rank engine alive at a time); the bad
flags fail before any process starts.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from swaserve.config import EngineConfig
from swaserve.distributed.expert_parallel import local_experts
from swaserve.distributed.expert_shards import shard_experts
from swaserve.models.moe import SparseMoE
from swaserve.weights.loader import build_model, load_hf_config
from tests.helpers import engine_prompt_logits, save_random_hf_models

TOL = 1e-4
ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_num_batched_tokens=16,
              kv_cache_gb=0.01)  # fmt: skip
EP = dict(data_parallel_size=2, enable_expert_parallel=True)
COMMON = dict(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256)
VOCAB = 128


def _configs() -> dict:
    t = transformers
    return {
        "qwen3_moe": t.Qwen3MoeConfig(
            **COMMON, vocab_size=VOCAB, intermediate_size=96, num_key_value_heads=2,
            num_hidden_layers=3, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
        ),
        "gpt_oss": t.GptOssConfig(
            **COMMON, vocab_size=VOCAB, intermediate_size=32, num_key_value_heads=2,
            num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            tie_word_embeddings=False,
        ),
        "llama": t.LlamaConfig(
            **COMMON, vocab_size=VOCAB, intermediate_size=96, num_key_value_heads=2,
            num_hidden_layers=2,
        ),
    }  # fmt: skip


MOE = ["qwen3_moe", "gpt_oss"]


@contextlib.contextmanager
def deadline(seconds: int):
    """TimeoutError in the test's thread if it takes longer; a hang inside a collective (where
    no Python signal handler runs) ends the process with every thread's traceback 30 s later:
    a failure, never a blocked run."""

    def fire(*_):
        raise TimeoutError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    faulthandler.dump_traceback_later(seconds + 30, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return save_random_hf_models(_configs(), tmp_path_factory)


@pytest.fixture(scope="module", params=MOE)
def pair(request, folders):
    """(name, one-process engine, DP=2 + EP=2 engine) on one checkpoint."""
    name = request.param
    # dense weights on both (the EP ranks never pack theirs for oneDNN, like TP's)
    one = Engine(model=str(folders[name]), disable_fused_ops=True, **ENGINE)
    with deadline(120):
        two = Engine(model=str(folders[name]), **EP, **ENGINE)
    yield name, one, two
    two.core.shutdown()


def _prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)


def drive(core, requests: list[tuple], on_step=None) -> dict:
    """Add `requests` [(id, prompt ids, params, dp rank)] to an EngineCore (the rank ignored)
    or a DPExpertCore, step until none is left; {id: [tokens, logprobs, cached, finish]}.
    `on_step(i)` runs after step i."""
    out = {}
    for rid, ids, params, rank in requests:
        extra = {"dp_rank": rank} if hasattr(core, "local") else {}
        core.add_request(rid, ids, params, **extra)
        out[rid] = [[], [], 0, None]
    i = 0
    with deadline(120):
        while core.has_unfinished():
            for o in core.step():
                rec = out[o.request_id]
                rec[0] += o.new_token_ids
                rec[1] += [lp.logprob for lp in o.new_logprobs or []]
                rec[2] = o.num_cached_tokens
                rec[3] = o.finish_reason
            if on_step is not None:
                on_step(i)
            i += 1
    return out


def _assert_close(a: dict, b: dict, ids: list[str]) -> None:
    for rid in ids:
        assert a[rid][0] == b[rid][0], rid
        assert max(abs(x - y) for x, y in zip(a[rid][1], b[rid][1], strict=True)) < TOL, rid


# ---- against one process ----------------------------------------------------------------------


def test_greedy_tokens_and_logprobs_equal_one_process(pair):
    name, one, two = pair
    prompts = _prompts([37, 9, 23, 50])  # 16-token steps: prefill in chunks, mixed steps
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    a = one.generate(prompt_token_ids=prompts, sampling_params=params)
    with deadline(120):
        b = two.generate(prompt_token_ids=prompts, sampling_params=params)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert abs(lx.logprob - ly.logprob) < TOL, (lx, ly)
            assert max(abs(p - q) for (_, p), (_, q) in zip(lx.top, ly.top)) < TOL
    stats = two.memory_stats()  # both ranks served some of them
    assert [r["dp_rank"] for r in stats["ranks"]] == [0, 1]
    assert two.core.placement.routed[0] > 0 and two.core.placement.routed[1] > 0
    two.core.check_integrity()


def test_prompt_logits_equal_one_process(pair):
    """Every position's logits of a prompt on rank 0, while rank 1 prefills another prompt of
    a different length in the same steps (the exchange carries both ranks' tokens)."""
    name, one, two = pair
    ids, other = _prompts([40, 23], seed=3)
    want = engine_prompt_logits(one, ids)
    local = two.core.local
    captured: list[torch.Tensor] = []
    forward = local.runner.forward
    local.runner.forward = lambda fb: captured.append(forward(fb)) or captured[-1]
    try:
        p = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        drive(two.core, [("a", ids, p, 0), ("b", other, _params(4), 1)])
    finally:
        local.runner.forward = forward
    got = local.runner.logits(torch.cat(captured)[: len(ids)])
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < TOL
    two.core.check_integrity()


def check_prefix_hit_on_rank_1(one: Engine, many: Engine, base: list[int]) -> None:
    """A 30-token prompt `base` on rank 1 of `many`, then two sharing 27 and 29 of its tokens:
    one process's tokens, logprobs and cached-token counts (hits on rank 1's own cache)."""
    first = [("p0", base + [1, 2, 3], _params(6), 1)]
    second = [("p1", base[:27] + [7, 8, 9, 10, 11], _params(6), 1),
              ("p2", base[:29] + [12] * 9, _params(6), 1)]  # fmt: skip
    a = {**drive(one.core, first), **drive(one.core, second)}
    b = {**drive(many.core, first), **drive(many.core, second)}
    _assert_close(a, b, ["p0", "p1", "p2"])
    assert [b[r][2] for r in ("p1", "p2")] == [a[r][2] for r in ("p1", "p2")]
    assert all(b[r][2] >= 24 for r in ("p1", "p2"))  # hits on rank 1's own prefix cache
    many.core.check_integrity()


@pytest.mark.parametrize("pair", ["qwen3_moe"], indirect=True)
def test_prefix_hit_on_one_rank(pair):
    _, one, two = pair
    check_prefix_hit_on_rank_1(one, two, _prompts([30], seed=5)[0])


# ---- idle ranks -------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_idle_forwards(core):
    """Inside: one entry in the yielded list per idle forward of rank 0 (this process)."""
    idle: list[int] = []
    ep = core.local.ep
    idle_forward = ep.idle_forward
    ep.idle_forward = lambda: (idle.append(1), idle_forward())
    try:
        yield idle
    finally:
        ep.idle_forward = idle_forward


def check_one_rank_idle(one: Engine, many: Engine, ids: list[int], n: int) -> None:
    """Rank 1 of `many` without requests while rank 0 decodes n tokens of `ids`, then the other
    way round: one process's tokens and logprobs, and the idle rank 0 runs an idle forward in
    every step of rank 1 (and none while it has work)."""
    with counting_idle_forwards(many.core) as idle:
        ref = drive(one.core, [("r", ids, _params(n), 0)])
        on0 = drive(many.core, [("r", ids, _params(n), 0)])
        assert not idle  # rank 0 had work in every step
        on1 = drive(many.core, [("s", ids, _params(n), 1)])
    _assert_close(ref, on0, ["r"])
    _assert_close(ref, {"r": on1["s"]}, ["r"])
    assert len(idle) >= n  # rank 0 joined every one of rank 1's steps without tokens
    many.core.check_integrity()


@pytest.mark.parametrize("pair", ["gpt_oss"], indirect=True)
def test_one_rank_idle_for_many_steps(pair):
    """The idle rank runs an idle forward in every step and serves its experts."""
    _, one, two = pair
    check_one_rank_idle(one, two, _prompts([11], seed=7)[0], 40)


@pytest.mark.parametrize("pair", ["qwen3_moe"], indirect=True)
@pytest.mark.parametrize("abort_rank", [1, 0])
def test_abort_on_one_rank_mid_decode(pair, abort_rank):
    _, one, two = pair
    p0, p1 = _prompts([13, 21], seed=9)
    reqs = [("a0", p0, _params(30), 0), ("a1", p1, _params(30), 1)]
    victim, keeper = f"a{abort_rank}", f"a{1 - abort_rank}"
    ref = drive(one.core, [r for r in reqs if r[0] == keeper])

    def abort(i: int) -> None:
        if i == 8:
            two.core.abort_requests([victim])

    got = drive(two.core, reqs, on_step=abort)
    _assert_close(ref, got, [keeper])
    assert got[victim][3] is None and 0 < len(got[victim][0]) < 30  # stopped mid-decode
    assert not two.core.placement.requests
    two.core.check_integrity()


@pytest.mark.parametrize("pair", ["gpt_oss"], indirect=True)
def test_unequal_batches_every_step(pair):
    """Rank 0 three requests of different lengths and output lengths, rank 1 one: the ranks'
    token counts differ in every step, both ranks go idle at different times."""
    _, one, two = pair
    prompts = _prompts([5, 17, 30, 11], seed=11)
    reqs = [("u0", prompts[0], _params(20), 0), ("u1", prompts[1], _params(7), 0),
            ("u2", prompts[2], _params(13), 0), ("u3", prompts[3], _params(25), 1)]  # fmt: skip
    ref = {}
    for r in reqs:
        ref.update(drive(one.core, [r]))
    got = drive(two.core, reqs)
    _assert_close(ref, got, [r[0] for r in reqs])
    two.core.check_integrity()


# ---- the decode-only workspace (--moe-decode-max-tokens-per-rank) ---------------------------


def _watch_decode_path(core) -> tuple[list[int], list[int], callable]:
    """On rank 0 (this process): the rows each fixed-path dispatch gathered, and the decode
    tokens of each batch the scheduler made. Returns (rows, decode tokens, undo)."""
    local = core.local
    ex, sched = local.ep.decode_exchange, local.scheduler
    rows: list[int] = []
    decode_tokens: list[int] = []
    dispatch, schedule = ex.dispatch, sched.schedule

    def watched_dispatch(*args):
        out = dispatch(*args)
        rows.append(out[0].shape[0])
        return out

    def watched_schedule():
        batch = schedule()
        decode_tokens.append(sum(
            n for r, n in zip(batch.requests, batch.num_new_tokens)
            if r.num_computed_tokens == r.num_tokens - 1
        ))  # fmt: skip
        return batch

    ex.dispatch, sched.schedule = watched_dispatch, watched_schedule

    def undo() -> None:
        ex.dispatch, sched.schedule = dispatch, schedule

    return rows, decode_tokens, undo


def _ep_engine(folder, **kw) -> Engine:
    with deadline(120):
        return Engine(model=str(folder), **EP, **ENGINE, **kw)


def test_cap_below_the_running_decodes(folders):
    """Cap 2 with 4 decoding requests per rank: every request finishes with one process's
    tokens, no rank's decode step carries more than 2 tokens (rank 0's scheduler watched, both
    ranks' over-cap counters 0), and every fixed-path exchange gathers D x N = 4 rows."""
    one = Engine(model=str(folders["qwen3_moe"]), disable_fused_ops=True, **ENGINE)
    prompts = _prompts([9, 14, 6, 11, 13, 7, 10, 5], seed=21)
    reqs = [(f"c{i}", p, _params(10), i % 2) for i, p in enumerate(prompts)]
    ref = {}
    for r in reqs:
        ref.update(drive(one.core, [r]))
    two = _ep_engine(folders["qwen3_moe"], moe_decode_max_tokens_per_rank=2)
    try:
        rows, decode_tokens, undo = _watch_decode_path(two.core)
        try:
            got = drive(two.core, reqs)
        finally:
            undo()
        _assert_close(ref, got, [r[0] for r in reqs])
        assert max(decode_tokens) == 2
        ranks = two.memory_stats()["ranks"]
        layers = len(two.core.local.ep._layers)
        for r in ranks:  # 4 x 9 decode tokens 2 a step (uncapped: about 9 decode steps)
            assert r["moe_decode_over_cap"] == 0 and r["moe_decode_steps"] >= 15
            assert r["moe_workspace_bytes"] > 0
        assert rows and set(rows) == {2 * 2}
        assert len(rows) == ranks[0]["moe_decode_steps"] * layers
        two.core.check_integrity()
    finally:
        two.core.shutdown()


def test_cap_off_equals_one_process(folders):
    """--moe-decode-max-tokens-per-rank 0: no workspace, every step on the variable path."""
    one = Engine(model=str(folders["gpt_oss"]), disable_fused_ops=True, **ENGINE)
    prompts = _prompts([12, 7, 19], seed=23)
    reqs = [(f"o{i}", p, _params(8), i % 2) for i, p in enumerate(prompts)]
    ref = {}
    for r in reqs:
        ref.update(drive(one.core, [r]))
    two = _ep_engine(folders["gpt_oss"], moe_decode_max_tokens_per_rank=0)
    try:
        assert two.core.local.ep.decode_exchange is None
        got = drive(two.core, reqs)
        _assert_close(ref, got, [r[0] for r in reqs])
        for r in two.memory_stats()["ranks"]:
            assert r["moe_workspace_bytes"] == 0 and r["moe_decode_steps"] == 0
            assert r["moe_prefill_steps"] > 0
        two.core.check_integrity()
    finally:
        two.core.shutdown()


@pytest.mark.parametrize("pair", ["gpt_oss"], indirect=True)
def test_default_cap_is_the_largest_decode_step(pair):
    """Default N = min(budget 16, max_num_seqs 256): decode steps gather D x 16 rows; the
    workspace's bytes are in memory_stats() on each rank."""
    _, one, two = pair
    ids = _prompts([10, 6], seed=25)
    reqs = [("d0", ids[0], _params(6), 0), ("d1", ids[1], _params(9), 1)]
    rows, _, undo = _watch_decode_path(two.core)
    try:
        got = drive(two.core, reqs)
    finally:
        undo()
    ref = {**drive(one.core, reqs[:1]), **drive(one.core, reqs[1:])}
    _assert_close(ref, got, ["d0", "d1"])
    assert two.core.local.ep.cap == 16 and rows and set(rows) == {2 * 16}
    h, k = 64, 2  # hidden size, top-k of the config
    want = (2 * 2 + 2) * 16 * h * 4 + (2 + 1) * 16 * 2 * k * 4
    assert [r["moe_workspace_bytes"] for r in two.memory_stats()["ranks"]] == [want, want]


# ---- failures ---------------------------------------------------------------------------------


def test_killed_rank_is_a_clear_error_within_seconds(folders):
    with deadline(120):
        engine = Engine(model=str(folders["qwen3_moe"]), **EP, **ENGINE)
    try:
        worker = engine.core.parallel.procs[1]
        params = _params(200)
        prompts = _prompts([20] * 4)
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with (
            deadline(60),
            pytest.raises(RuntimeError, match=r"data-parallel rank 1 .*killed by SIGKILL"),
        ):
            for _ in range(1000):  # until the kill lands, mid-step or between steps
                engine.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert time.monotonic() - start < 10
        with pytest.raises(RuntimeError, match="data-parallel rank 1"):  # and it stays down
            engine.generate(prompt_token_ids=prompts[:1], sampling_params=params)
    finally:
        engine.core.shutdown()


def test_bad_flags_fail_at_start(folders):
    with pytest.raises(ValueError, match=r"^invalid --enable-expert-parallel .*--data-parallel"):
        EngineConfig(enable_expert_parallel=True)
    EngineConfig(**EP, speculative_algorithm="dflash")  # runs: test_dflash_ep.py
    for kwargs, flag in [
        (dict(moe_decode_max_tokens_per_rank=-1), "--moe-decode-max-tokens-per-rank"),
        (dict(nnodes=3, dist_init_addr="127.0.0.1:1"), "--nnodes"),  # 3 does not divide -dp 2
    ]:
        with pytest.raises(ValueError, match=rf"^invalid {flag} "):
            EngineConfig(**EP, **kwargs)
    start = time.monotonic()  # before any process starts: fast
    with pytest.raises(ValueError, match=r"--enable-expert-parallel needs a mixture-of-experts"):
        Engine(model=str(folders["llama"]), **EP, **ENGINE)
    with pytest.raises(ValueError, match=r"--data-parallel-size 3 .*experts per layer \(8\)"):
        Engine(model=str(folders["qwen3_moe"]), data_parallel_size=3,
               enable_expert_parallel=True, **ENGINE)  # fmt: skip
    assert time.monotonic() - start < 5


# ---- pieces, in one process -------------------------------------------------------------------


def test_scheduler_decode_cap_round_robin():
    """Cap 3 over 5 decoding requests: at most 3 decode tokens a step (a verify counts its
    1 + drafts), taken round robin, so every request runs at least once in any 3 steps."""
    from swaserve.engine.request import Request
    from swaserve.engine.scheduler import Scheduler
    from swaserve.memory.groups import build_layout
    from swaserve.memory.manager import MemoryManager

    memory = MemoryManager(build_layout([None]), 4, 200)
    sched = Scheduler(memory, max_num_seqs=8, max_num_batched_tokens=64)
    sched.decode_cap = 3
    reqs = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100), 100) for i in range(5)]
    for r in reqs:
        sched.add(r)
    ran: list[set[str]] = []
    for step in range(12):
        if step == 6:  # r0 verifies 2 drafts from now on: 3 tokens, a step of its own
            reqs[0].draft_token_ids = [7, 7]
        batch = sched.schedule()
        if step:  # step 0 admits the prompts (not capped); every later chunk is a decode
            assert sum(batch.num_new_tokens) <= 3
            ran.append({r.request_id for r in batch.requests})
        for r, n in zip(batch.requests, batch.num_new_tokens):
            r.num_computed_tokens += n - len(r.draft_token_ids)  # drafts rejected
            r.output_token_ids.append(5)
            if r.draft_token_ids:
                r.draft_token_ids = [7, 7]
        sched.retire()
        memory.check_integrity()
    for i in range(len(ran) - 2):
        assert set().union(*ran[i : i + 3]) >= {"r1", "r2", "r3", "r4"}, ran
    assert {"r0"} in ran[5:]  # the verify alone in its step


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("dummy", [False, True])
def test_expert_shards_are_slices_of_the_full_tensors(folders, name, dummy):
    hf = load_hf_config(folders[name])
    cpu = torch.device("cpu")
    full = dict(build_model(hf, folders[name], torch.float32, cpu, dummy, 0).named_parameters())
    for rank in range(2):
        model = build_model(hf, folders[name], torch.float32, cpu, dummy, 0, ep=(rank, 2))
        with torch.device("meta"):
            shards = shard_experts(type(model)(hf), rank, 2)
        assert shards and all(k.rsplit(".", 1)[1] in ("w13", "b13", "w2", "b2") for k in shards)
        for pname, p in model.named_parameters():
            want = shards[pname].take(full[pname]) if pname in shards else full[pname]
            assert torch.equal(p, want), pname


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_local_experts_of_all_ranks_sum_to_the_moe(activation):
    """Each rank's share (its experts, the others' skipped, padding ids -1) summed over the
    ranks is the whole layer's output."""
    torch.manual_seed(0)
    moe = SparseMoE(16, 8, 6, 2, "softmax_topk", True, router_bias=True, expert_bias=True,
                    activation=activation)  # fmt: skip
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    x = torch.randn(9, 16)
    with torch.no_grad():
        weights, ids = moe.route(x)
        ids[-1] = -1  # a padding row: no expert anywhere
        want = moe(x[:-1])
        total = torch.zeros_like(x)
        for lo, hi in ((0, 2), (2, 4), (4, 6)):
            part = SparseMoE(16, 8, 2, 2, "softmax_topk", True, expert_bias=True,
                             activation=activation)  # fmt: skip
            for leaf in ("w13", "b13", "w2", "b2"):
                getattr(part, leaf).copy_(getattr(moe, leaf)[lo:hi])
            part.expert_range = (lo, hi)
            total += local_experts(part, x, weights, ids)
    assert torch.allclose(total[:-1], want, atol=1e-5)
    assert not total[-1].any()
