"""The GPU benchmark scripts run end to end in their tiny mode (CPU: tiny random models, a few
requests): correctness check, both engines, JSON log, markdown table printed last."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _table(out: str) -> list[str]:
    lines = out.strip().splitlines()
    assert lines[-1].startswith("| ") and lines[-1].endswith(" |"), lines[-3:]
    return [ln for ln in lines if ln.startswith("|")]


def test_window_vs_full_tiny(tmp_path, capsys):
    rc = _script("window_vs_full").main(["--tiny", "--out", str(tmp_path)])
    assert rc == 0
    rows = _table(capsys.readouterr().out)
    assert rows[2].startswith("| window-aware") and rows[3].startswith("| all-full")
    rec = json.loads((tmp_path / "window_vs_full.json").read_text())
    assert rec["correctness"]["passed"]
    aware, full = rec["results"]["window-aware"], rec["results"]["all-full"]
    assert full["groups"] == [["full", None, 6]]
    assert len(aware["groups"]) > 1
    assert aware["max_concurrent"] > full["max_concurrent"] >= 1
    assert aware["bytes_per_request"] < full["bytes_per_request"]
    for r in (aware, full):
        assert r["output_tokens"] == rec["num_requests"] * rec["new_tokens"]
        assert r["output_tok_s"] > 0 and r["peak_running"] >= 1


def test_fp8_vs_bf16_tiny(tmp_path, capsys):
    rc = _script("fp8_vs_bf16").main(["--tiny", "--out", str(tmp_path)])
    assert rc == 0
    rows = _table(capsys.readouterr().out)
    assert rows[2].startswith("| bf16") and rows[3].startswith("| fp8_e4m3")
    rec = json.loads((tmp_path / "fp8_vs_bf16.json").read_text())
    check = rec["correctness"]
    assert 0 <= check["match_rate"] <= 1 and check["tokens_total"] == 4 * 32
    bf16, fp8 = rec["results"]["bf16"], rec["results"]["fp8_e4m3"]
    assert (bf16["kv_dtype"], fp8["kv_dtype"]) == ("bfloat16", "float8_e4m3fn")
    assert fp8["kv_bytes_per_token"] * 2 == bf16["kv_bytes_per_token"]
    assert rec["ratios_fp8_over_bf16"]["capacity_tokens"] >= 1.9 and rec["capacity_target_met"]
    assert fp8["max_concurrent"] > bf16["max_concurrent"]
    for r in (bf16, fp8):
        assert r["output_tokens"] == rec["num_requests"] * rec["new_tokens"]


@pytest.mark.slow  # rank processes for each layout x step (~1 min)
def test_scale_out_tiny(tmp_path, capsys, monkeypatch):
    """benchmarks/scale_out.py on CPU: TP=2, DP=2+EP=2 and DP=2 x TP=2 + EP=4 on a tiny gpt-oss
    give the first layout's tokens; the n-gram step reports committed tokens per verify step for
    each DP rank (one under plain TP); a layout the engine refuses is a row with its error."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = _script("scale_out").main(
        ["--tiny", "--layouts", "tp2", "dp2-ep", "dp2-tp2", "dp3-ep", "--steps", "throughput-8",
         "spec"]
    )
    assert rc == 0
    _table(capsys.readouterr().out)
    rows = {(r["step"], r["layout"]): r for r in map(
        json.loads, (tmp_path / "scale_out.jsonl").read_text().splitlines())}  # fmt: skip
    for layout in ("tp2", "dp2-ep", "dp2-tp2"):
        r = rows["throughput-8", layout]
        assert r["tokens_equal"] is True and r["output_tok_per_s"] > 0, r
    assert rows["throughput-8", "dp2-ep"]["memory"]["ranks_pages_total"][1] > 0
    for layout, ranks in (("tp2", {"0"}), ("dp2-ep", {"0", "1"}), ("dp2-tp2", {"0", "1"})):
        spec = rows["spec", layout]["spec_per_rank"]
        assert set(spec) == ranks, (layout, spec)
        assert all(v["verify_steps"] > 0 and v["tokens_per_verify"] > 1 for v in spec.values())
    # 3 ranks do not divide 4 experts: the engine's error at start is the row
    assert "must divide the model's experts" in rows["throughput-8", "dp3-ep"]["error"]


def test_pd_transfer_tiny(tmp_path, capsys, monkeypatch):
    """benchmarks/pd_transfer.py on CPU: NIXL moves a tiny layout's DRAM pages between two
    processes, checked on the decode side; window-aware against every layer full."""
    from tests.transfer_helpers import NIXL_MISSING

    if NIXL_MISSING is not None:
        pytest.skip(f"NIXL: {NIXL_MISSING}")
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.syspath_prepend(str(BENCH))  # its decode process imports it by name (spawn)
    import pd_transfer

    assert pd_transfer.main(["--device", "cpu", "--tiny", "--placements", "random"]) == 0
    rows = _table(capsys.readouterr().out)
    assert len(rows) == 2 + 2 * 2  # header, rule, 2 prompts x 2 layouts
    recs = [json.loads(x) for x in (tmp_path / "pd_transfer.jsonl").read_text().splitlines()]
    by = {(r["layout"], r["prompt_tokens"]): r for r in recs}
    assert all(r["correct"] and r["done_ms"] > 0 and r["copy_gb_s"] > 0 for r in recs)
    # 200 tokens, window 24, pages of 16: the full group's 13 pages + 2 SWA groups x 2 pages,
    # pages of 2 layer slots; every layer full: 13 pages of 6 slots
    aware, full = by["window-aware", 200], by["all-full", 200]
    assert aware["pages"] == 13 + 2 * 2 and full["pages"] == 13
    assert full["bytes"] * 17 == aware["bytes"] * 13 * 3


def test_schedule_sim_drives_the_real_scheduler():
    """benchmarks/schedule_sim.py: every prompt token is computed (preempted ones again), the
    KV-bound cap turns the waves of prefill steps into steps mixing chunks and decodes."""
    sim = _script("schedule_sim")
    off = sim.simulate("fp8-16k", sim.GPUS["h100"], 0)
    capped = sim.simulate("fp8-16k", sim.GPUS["h100"], 192)
    for row in (off, capped):
        assert row["prefill_tokens"] >= 64 * 16000
        assert row["steps"] == row["mixed"] + row["decode_only"] + row["prefill_only"]
        assert row["seconds"] > 0
    assert capped["mixed"] > 10 * off["mixed"]


def test_schedule_sim_floor_bounds_its_schedules():
    """schedule_sim.floor: no simulated schedule beats it (the model's rates are below the
    ceilings); the offline run's decode steps are its longest output, the KV-bound ones more;
    a window bounds the keys a decode reads."""
    sim = _script("schedule_sim")
    for workload in ("fp8-16k", "hybrid-prefill"):
        low = sim.floor(workload, sim.GPUS["h200"])
        assert 0 < low["overlapped_s"] <= low["floor_s"] < sim.simulate(
            workload, sim.GPUS["h200"], 0)["seconds"]  # fmt: skip
        assert low["floor_s"] == pytest.approx(low["gemm_s"] + low["attention_s"], abs=0.11)
    assert sim.floor("offline", sim.GPUS["h200"])["decode_steps"] == 1024
    assert sim.floor("fp8-16k", sim.GPUS["h200"])["decode_steps"] > 1024  # 16 GiB binds


def test_schedule_sim_prefill_ahead_through_the_host_tier():
    """schedule_sim with the real radix cache and a host tier: prompts prefilled ahead park
    and come back as hits, every prompt token computed about once, faster than without."""
    sim = _script("schedule_sim")
    off = sim.simulate("hybrid-prefill", sim.GPUS["h200"], 0)
    ahead = sim.simulate("hybrid-prefill", sim.GPUS["h200"], 0, host_gib=40, ahead=192)
    assert ahead["parks"] > 5 and ahead["host_gib_moved"] > 0
    assert 48 * 7936 <= ahead["prefill_tokens"] < 48 * 7936 * 1.01
    assert ahead["seconds"] < off["seconds"]
