"""GPU only (skipped elsewhere): the randomized workloads of tests/stress.py on CUDA, where host
and disk tier loads land on a real side stream (instead of the CPU emulation) and attention
runs in the Triton kernels, with CUDA graphs for decode (and verify, with speculation).
float32: the same greedy ties and logprob tolerance as on the CPU. SWASERVE_STRESS_WORKLOADS
sets the number of workloads."""

from __future__ import annotations

import pytest
import torch

from tests.stress import Models, run_sweep, sweep_size

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_stress_workloads_on_cuda(tmp_path):
    models = Models(tmp_path / "models", device="cuda")
    (tmp_path / "models").mkdir()
    totals = run_sweep(range(20_000, 20_000 + sweep_size(60)), models, tmp_path)
    assert totals.get("host_loads", 0) > 0 and totals.get("cache_hits", 0) > 0, totals


def test_spec_stress_workloads_on_cuda(tmp_path):
    """With speculation (tests/stress.py draw_spec): verify and DFlash drafter CUDA graphs,
    the drafter's context stored inside the decode and verify graphs."""
    models = Models(tmp_path / "models", device="cuda")
    (tmp_path / "models").mkdir()
    totals = run_sweep(range(21_000, 21_000 + sweep_size(30)), models, tmp_path, spec=True)
    assert totals.get("spec_accepted", 0) > 0 and totals.get("drafts_compared", 0) > 0, totals
