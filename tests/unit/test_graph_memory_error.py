"""The start-up error for CUDA graphs that do not fit beside the weights and the KV pool
(engine/memory_profile.graph_memory_error): still an out-of-memory error to a caller that
catches one, with the numbers and the flags that fix it. On an H100, Gemma-3-27B with
--kv-cache-gb 20 ran out of memory in the decode graphs' capture with only torch's message
(benchmarks/RESULTS.md, 2026-12-06)."""

from __future__ import annotations

import torch

from swaserve.config import EngineConfig
from swaserve.engine.memory_profile import graph_memory_error


def test_names_the_numbers_and_the_flags():
    gb = 2**30
    cfg = EngineConfig(model="m", kv_cache_gb=20, cuda_graph_max_bs=512)
    e = graph_memory_error(int(50.3 * gb), 20 * gb, int(79.2 * gb), cfg, 256, 2048)
    assert isinstance(e, torch.OutOfMemoryError)
    msg = str(e)
    for part in ("weights (50.3 GiB)", "KV pool (20.0 GiB, --kv-cache-gb 20)", "leave 8.9 of 79.2",
                 "decode batches up to 512", "mixed steps up to 256", "piecewise steps up to 2048",
                 "--enforce-eager", "--cuda-graph-max-bs"):  # fmt: skip
        assert part in msg, (part, msg)
    cfg = EngineConfig(model="m", gpu_memory_utilization=0.9)
    assert "--gpu-memory-utilization 0.9" in str(graph_memory_error(gb, gb, 8 * gb, cfg, 0, 0))
