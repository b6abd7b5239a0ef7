"""Memory and prefix cache under stress, through the real engine (issue 10).

Randomized workloads (tests/stress.py): tiny hybrid Gemma 3 models, random arrivals, shared
prefixes cut near page and window boundaries, aborts, small pools, host and disk tiers whose
loads land late; outputs equal the cache-off engine's, `check_integrity()` after every step, and
at idle every page is free or owned once by the cache. The seeds that found bugs are fixed
cases here; a sweep over fresh seeds runs too (SWASERVE_STRESS_WORKLOADS sets its size).
"""

from __future__ import annotations

import random

import pytest

from swaserve import Engine, SamplingParams
from swaserve.memory.groups import build_layout
from swaserve.memory.manager import page_bytes
from tests.helpers import save_random_hf_model, tiny_gemma3_config
from tests.stress import Models, run_sweep, run_workload, sweep_size


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Models(tmp_path_factory.mktemp("stress_models"))


# ---- bug 2: a stale hit attached after eviction (the real Engine) --------------------------


@pytest.fixture(scope="module")
def window3(tmp_path_factory):
    """One sliding layer of window 3 and one full layer."""
    cfg = tiny_gemma3_config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, sliding_window=3, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
        eos_token_id=1,
    )
    folder = tmp_path_factory.mktemp("tiny_gemma3_window3")
    save_random_hf_model(cfg, folder)
    return str(folder)


def _pool_gb(windows: list[int | None], page_size: int, num_pages: int) -> float:
    """--kv-cache-gb for a pool of exactly num_pages page ids (NULL included): 1 KV head of 8
    float32 dims."""
    return (num_pages + 0.5) * page_bytes(build_layout(windows), page_size, 1, 8, 4) / 2**30


def test_stale_hit_is_not_attached_after_eviction(window3):
    """Admission locked a hit, evicted to make room, then unlocked it; the unlock tidied away a
    node of the hit (a split node whose end lost its window, kept only by the pin) and the
    scheduler attached the hit anyway: StopIteration in RadixCache.attach killed the engine.
    Page size 3, a 23-page pool, 2 tokens per step, 2 sequences, 7 prompts sharing prefixes."""
    rng = random.Random(59)
    base = [rng.randrange(2, 64) for _ in range(30)]
    prompts = []
    for _ in range(7):
        cut = rng.randrange(0, 25)
        prompts.append(base[:cut] + [rng.randrange(2, 64) for _ in range(rng.randrange(1, 10))])
    params = SamplingParams(max_tokens=rng.randrange(1, 8), temperature=0, ignore_eos=True)
    windows = [3, None]
    eng = Engine(model=window3, device="cpu", page_size=3, kv_cache_gb=_pool_gb(windows, 3, 24),
                 max_num_batched_tokens=2, max_num_seqs=2)
    assert eng.core.memory.pool.capacity == 23
    ref = Engine(model=window3, device="cpu", page_size=3, kv_cache_gb=_pool_gb(windows, 3, 400),
                 disable_prefix_cache=True)
    got = eng.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    want = ref.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.outputs[0].finish_reason == "length" for o in got)
    assert eng.memory_stats()["cache_hits"] > 0
    eng.core.memory.check_integrity()


# ---- randomized workloads ------------------------------------------------------------------

# Seeds whose workloads failed on the way to the fixes, kept as fixed cases. On main before
# issue 10 (with the context capped to the pool, so that only real failures remain), 16 of 800
# seeds aborted a request that fits alone; the causes seen: a node shared mid-way by a running
# request (bug 3), pages of the request's own path that the tree held twice (it computed them
# while another request did), the tail window of an internal node pinning the last free pages
# (kept as an offload copy too). Later seeds failed on intermediate versions of the fixes.
FAILED_ON_MAIN = [73, 83, 196, 328, 346, 384, 414, 416, 478, 539, 543, 613, 646, 649, 664, 703]
FAILED_ON_THE_WAY = [5, 150, 295, 304, 311, 330]


@pytest.mark.parametrize("seed", FAILED_ON_MAIN + FAILED_ON_THE_WAY)
def test_stress_seeds_that_found_bugs(seed, models, tmp_path):
    run_workload(seed, models, tmp_path)


@pytest.mark.slow
def test_stress_sweep(models, tmp_path):
    """Fresh seeds, about 2 minutes on an idle 2-core machine."""
    totals = run_sweep(range(10_000, 10_000 + sweep_size(800)), models, tmp_path)
    # The sweep must exercise what it claims to: hits, evictions, host loads, preemptions,
    # prompts prefilled ahead and parked.
    for key in ("cache_hits", "evictions", "host_loads", "preemptions", "parks", "requests"):
        assert totals.get(key, 0) > 0, (key, totals)


# ---- with speculation (issue 11) -------------------------------------------------------------

# Seeds whose speculative workloads failed: 143 (a seeded request, newest and short of pages,
# preempted itself; recomputed, it sampled its last token without drafts: other tokens than
# alone in a roomy pool). The abort of a lone seeded request whose verify chunk did not fit
# (seed 243 before max_model_len left room for a verify chunk) is in test_spec_seeded_schedule.
SPEC_FAILED = [143]


@pytest.mark.parametrize("seed", SPEC_FAILED)
def test_spec_stress_seeds_that_found_bugs(seed, models, tmp_path):
    run_workload(seed, models, tmp_path, spec=True)


def _check_spec_coverage(totals: dict[str, int]) -> None:
    for key in ("spec_verify", "spec_accepted", "drafts_compared", "cache_hits", "requests"):
        assert totals.get(key, 0) > 0, (key, totals)
    assert totals["spec_proposed"] > totals["spec_accepted"], totals  # rejections too


def test_spec_stress_fresh_seeds(models, tmp_path):
    """A few fresh seeds in the fast suite (n-gram, oracle and DFlash workloads)."""
    _check_spec_coverage(run_sweep(range(20_000, 20_040), models, tmp_path, spec=True))


@pytest.mark.slow
def test_spec_stress_sweep(models, tmp_path):
    """Fresh seeds, about 3 minutes on an idle 2-core machine."""
    totals = run_sweep(range(21_000, 21_000 + sweep_size(600)), models, tmp_path, spec=True)
    _check_spec_coverage(totals)
    for key in ("preemptions", "host_loads", "evictions"):
        assert totals.get(key, 0) > 0, (key, totals)
