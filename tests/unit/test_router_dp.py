"""Data-parallel routing (`--data-parallel-size`): the replica choice, the prefix LRU, the
merged /v1/memory stats, /metrics with dp_rank labels and the flag checks."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swaserve.config import EngineConfig
from swaserve.server.dp_client import merge_stats
from swaserve.server.metrics_dp import RankedMetrics
from swaserve.server.router_dp import PrefixAffinity, choose_replica, prefix_keys


def test_affinity_wins_over_a_less_loaded_replica():
    assert choose_replica([3, 0], [256, 0], margin=4) == 0


def test_load_margin_overrides_affinity():
    assert choose_replica([5, 0], [256, 0], margin=4) == 1
    assert choose_replica([4, 0], [256, 0], margin=4) == 0  # at the margin: still affine


def test_longest_prefix_wins_and_ties_among_affine_go_least_loaded():
    assert choose_replica([0, 0, 0], [64, 256, 0]) == 1
    assert choose_replica([2, 1, 0], [64, 64, 0]) == 1


def test_no_affinity_least_loaded_then_fewest_routed_then_lowest_rank():
    assert choose_replica([2, 1, 1], [0, 0, 0]) == 1
    assert choose_replica([1, 1, 1], [0, 0, 0], routed=[5, 7, 3]) == 2
    assert choose_replica([0, 0], [0, 0], routed=[1, 1]) == 0
    assert choose_replica([0, 0], [0, 0]) == 0


def test_full_replicas_are_skipped():
    assert choose_replica([0, 9], [0, 1024], eligible=[True, False]) == 0
    with pytest.raises(ValueError):
        choose_replica([1, 1], [0, 0], eligible=[False, False])


def test_prefix_keys_and_lru():
    long = list(range(300))
    assert [k for k, _ in prefix_keys(long)] == [64, 256]
    assert prefix_keys(list(range(63))) == []
    aff = PrefixAffinity(2, capacity=3)
    aff.record(1, prefix_keys(long))
    other = long[:100] + [7] * 200  # same first 64 tokens only
    assert aff.match(prefix_keys(other)) == [0, 64]
    assert aff.match(prefix_keys(long)) == [0, 256]
    aff.record(1, prefix_keys([5] * 64) + prefix_keys([6] * 64))  # evicts the oldest
    assert aff.match(prefix_keys(long)) == [0, 256]  # 256 was touched after 64
    aff.record(1, prefix_keys([8] * 64))
    assert aff.match(prefix_keys(long)) == [0, 0]


def test_n_samples_are_one_choice(monkeypatch):
    """A request with n > 1 goes to one replica with all its samples (one CoreClient.add)."""
    import asyncio

    from swaserve.sampling.params import SamplingParams
    from swaserve.server.dp_client import DPClient

    class Fake:
        def __init__(self) -> None:
            self.added: list[tuple[str, int]] = []
            self.dead = None
            self.max_in_flight = 8

        @property
        def num_in_flight(self) -> int:
            return sum(n for _, n in self.added)

        def add(self, rid, prompt, ids, params, queue, stream) -> None:
            self.added.append((rid, params.n))

        def is_live(self, rid) -> bool:
            return any(r == rid for r, _ in self.added)

    fakes = [Fake(), Fake()]
    dp = DPClient(fakes)  # type: ignore[arg-type]
    q: asyncio.Queue = asyncio.Queue()
    prompt = list(range(100))
    r0 = dp.add("a", None, prompt, SamplingParams(n=3, max_tokens=1), q, False)
    r1 = dp.add("b", None, [1, 2], SamplingParams(max_tokens=1), q, False)
    r2 = dp.add("c", None, prompt, SamplingParams(n=2, max_tokens=1), q, False)  # affinity
    assert (r0, r1, r2) == (0, 1, 0)
    assert fakes[0].added == [("a", 3), ("c", 2)] and fakes[1].added == [("b", 1)]
    from swaserve.server.ipc import QueueFull

    with pytest.raises(QueueFull):
        dp.add("d", None, [1], SamplingParams(n=8, max_tokens=1), q, False)


def test_merge_stats_totals_and_ranks():
    def one(used: int, free: int, running: int) -> dict:
        group = {"index": 0, "kind": "full", "window": None, "pages_used": used}
        mem = {"page_size": 16, "pages_total": 100, "pages_free": free, "groups": [group]}
        return {"num_running": running, "num_waiting": 0, "num_preemptions": 1, "memory": mem}

    merged = merge_stats([one(3, 97, 1), one(5, 95, 2)])
    mem = merged["memory"]
    assert (merged["num_running"], merged["num_preemptions"]) == (3, 2)
    assert (mem["page_size"], mem["pages_total"], mem["pages_free"]) == (16, 200, 192)
    assert mem["groups"] == [{"index": 0, "kind": "full", "window": None, "pages_used": 8}]
    assert [r["dp_rank"] for r in mem["ranks"]] == [0, 1]
    assert [r["pages_free"] for r in mem["ranks"]] == [97, 95]
    assert [r["num_running"] for r in mem["ranks"]] == [1, 2]


def test_metrics_carry_dp_rank_and_counters_stay_counters():
    m = RankedMetrics(2)
    m.ranks[0].prompt_tokens.inc(3)
    m.ranks[1].prompt_tokens.inc(5)
    m.ranks[1].kv_pages_used.labels(group="0:full").set(4)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams["swaserve:prompt_tokens"].type == "counter"
    samples = fams["swaserve:prompt_tokens"].samples
    assert {(s.labels["dp_rank"], s.value) for s in samples} == {("0", 3.0), ("1", 5.0)}
    kv = fams["swaserve:kv_pages_used"].samples
    assert [(s.labels, s.value) for s in kv] == [({"dp_rank": "1", "group": "0:full"}, 4.0)]
    assert all("dp_rank" in s.labels for f in fams.values() for s in f.samples)


def test_flag_checks():
    EngineConfig(model="x", data_parallel_size=2)
    EngineConfig(model="x", data_parallel_size=2, tensor_parallel_size=2)  # replicas of 2 ranks
    with pytest.raises(ValueError, match="--enable-expert-parallel.*--data-parallel-size >= 2"):
        EngineConfig(model="x", enable_expert_parallel=True)
    EngineConfig(model="x", data_parallel_size=2, enable_expert_parallel=True)  # MoE: checked
    # with the model (tests/unit/test_expert_parallel.py)
    with pytest.raises(ValueError, match="--data-parallel-size"):
        EngineConfig(model="x", data_parallel_size=0)


def test_replica_config_devices():
    from swaserve.server.launch import replica_config

    cfg = EngineConfig(model="x", data_parallel_size=2, device="cpu")
    assert [replica_config(cfg, i).device for i in (0, 1)] == ["cpu", "cpu"]
    assert replica_config(cfg, 1).data_parallel_size == 1
    one = EngineConfig(model="x")
    assert replica_config(one, 0) is one
