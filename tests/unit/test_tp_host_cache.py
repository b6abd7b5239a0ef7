"""The prefix cache's host and disk tiers under tensor parallelism (CPU, gloo, 2 real ranks):
rank 0 decides every store, load and demotion, each rank moves its own shard of the bytes
(memory/host_cache.py, the step wire's MOVES and LANDED). A device pool of 40 pages evicts each
conversation's cached prefix to the host tier (and on to disk), and continuing it loads the
pages back: greedy tokens and logprobs equal one process with the same flags, on tiny random
Llama (one KV head: replicated on both ranks) and Gemma 3 (windows of 8, prompts past them);
loads run late on rank 0 too (`emulate_async`, as a CUDA side stream would). A worker that
skipped a move would attend to stale KV in its heads and change the logprobs.
"""

from __future__ import annotations

import pytest

from swaserve import Engine, SamplingParams
from tests.helpers import assert_same_outputs, random_prompts, save_random_hf_models
from tests.unit.test_tensor_parallel import ENGINE, _configs

MODELS = ("llama", "gemma3")
TIERS = dict(kv_cache_gb=4e-5, host_cache_gb=2e-4)  # 40 device pages (one process), ~200 host


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    configs = _configs()
    return save_random_hf_models({n: configs[n] for n in MODELS}, tmp_path_factory)


def _conversations(engine: Engine) -> list:
    """Five 40-token prompts one at a time (each evicts the earlier ones' pages), then each
    continued after its output: a hit at the end of its cached prefix, loaded back from the
    tiers. Tree, tiers and pool agree after every request."""
    prompts = random_prompts(engine.core.hf_config.vocab_size, [40] * 5, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    outs = []
    for turn in range(2):
        for i, p in enumerate(prompts):
            prompt = p + outs[i].token_ids + [i + 1] if turn else p
            outs += engine.generate(prompt_token_ids=[prompt], sampling_params=params,
                                    use_tqdm=False)  # fmt: skip
            engine.core.cache.check_integrity()
            engine.core.memory.check_integrity()
    return outs


def _record(engine: Engine) -> tuple[list, list]:
    """What rank 0 tells its workers about the tiers: each flush's ops, each landed flush."""
    mover = engine.core.cache.mover
    moves, landed = [], []
    send_moves, send_landed = mover.mirror_moves, mover.mirror_landed
    mover.mirror_moves = lambda n, ops: (moves.extend(ops), send_moves(n, ops))
    mover.mirror_landed = lambda n: (landed.append(n), send_landed(n))
    return moves, landed


def _run(folder, tp: int, lag: int = 0, at_end=None, **flags) -> tuple[list, dict, list, list]:
    """The conversations on a fresh engine of `tp` ranks; its outputs, stats and mirrored
    messages (`lag`: rank 0's loads land that many flushes late; `at_end()` before it stops)."""
    engine = Engine(model=str(folder), tensor_parallel_size=tp, disable_fused_ops=True,
                    **{**ENGINE, **TIERS, **flags})  # fmt: skip
    try:
        if lag:
            engine.core.cache.mover.emulate_async(lag)
        moves, landed = _record(engine) if tp > 1 else ([], [])
        outs = _conversations(engine)
        if at_end is not None:
            at_end()
        return outs, engine.memory_stats(), moves, landed
    finally:
        engine.core.cache.close()
        engine.core.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "lag"), [("llama", 0), ("gemma3", 0), ("gemma3", 2)])
def test_host_tier_under_tp_equals_one_process(folders, name, lag):
    want, _, _, _ = _run(folders[name], 1)
    got, stats, moves, landed = _run(folders[name], 2, lag)
    assert_same_outputs(want, got)
    assert stats["host_loads"] > 0 and stats["cache_hit_tokens"] > 0, stats
    assert sum(o.num_cached_tokens for o in got) == stats["cache_hit_tokens"]
    assert any(src == 0 and dst is None for src, _, dst, _ in moves), "no host load mirrored"
    assert any(src is None and dst == 0 for src, _, dst, _ in moves), "no host store mirrored"
    assert bool(landed) == bool(lag)  # synchronous copies on CPU: nothing lands late


@pytest.mark.slow
def test_disk_tier_under_tp_equals_one_process(folders, tmp_path):
    """A host tier of a few pages: evicted prefixes go on to disk, a file per rank in its own
    folder, and come back from there."""
    flags = dict(host_cache_gb=1e-5, disk_cache_gb=0.001)
    want, _, _, _ = _run(folders["gemma3"], 1, disk_cache_dir=str(tmp_path / "one"), **flags)
    disk, seen = tmp_path / "two", []
    got, stats, moves, _ = _run(folders["gemma3"], 2, disk_cache_dir=str(disk), **flags,
                                at_end=lambda: seen.append(_ranks_files(disk)))  # fmt: skip
    assert_same_outputs(want, got)
    assert stats["disk_pages"] > 0 and stats["cache_hit_tokens"] > 0, stats
    assert any(src == 1 and dst is None for src, _, dst, _ in moves), "no disk load mirrored"
    assert any(src == 0 and dst == 1 for src, _, dst, _ in moves), "no demotion mirrored"
    assert list(seen[0]) == ["tp2-rank0", "tp2-rank1"] and all(
        len(files) == 1 for files in seen[0].values()
    ), seen
    assert not any(_ranks_files(disk).values())  # each rank removed its file when it stopped


def _ranks_files(folder) -> dict[str, list[str]]:
    if not folder.exists():
        return {}
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(folder.iterdir())}
