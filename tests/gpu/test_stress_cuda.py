"""GPU only (skipped elsewhere): the randomized workloads of tests/stress.py on CUDA, where host
and disk tier loads land on a real side stream (instead of the CPU emulation) and attention
runs in the Triton kernels, with CUDA graphs for decode. float32: the same greedy ties and
logprob tolerance as on the CPU. SWASERVE_STRESS_WORKLOADS sets the number of workloads."""

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
