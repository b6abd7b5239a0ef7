"""GPU only (skipped elsewhere): mixed CUDA graphs (engine/mixed_graph.py) give the same tokens
and logprobs as the steps they replace (piecewise graphs) on batches mixing decodes and
prefill chunks, prefix hits past Gemma's window, with bf16 and fp8 KV, and under KV pressure
with the prefill cap on (`kv_bound_step_tokens`); the graphs really ran."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_piecewise_cuda import (  # noqa: F401
    _prompts,
    assert_graph_outputs,
    outputs_of,
    tiny,
)
from tests.helpers import check_integrity_every_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run(folder: str, mixed: int, **kw) -> tuple[list, list]:
    from swaserve import Engine, SamplingParams

    e = Engine(model=folder, page_size=16, max_num_batched_tokens=96, cuda_graph_max_bs=4,
               mixed_cuda_graph_max_tokens=mixed, **kw)  # fmt: skip
    g = e.core.runner.mixed
    assert (g is not None) == (mixed > 0)
    replays = []
    if g is not None:
        assert g.graphs and set(g.graphs) == set(g.buckets)
        run = g.run
        g.run = lambda *a, r=replays, f=run: r.append(len(a[0])) or f(*a)
    check_integrity_every_step(e)
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    outs = e.generate(prompt_token_ids=_prompts(), sampling_params=p, use_tqdm=False)
    return outputs_of(outs), replays


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"),
                                      ("bfloat16", "fp8_e4m3")])
def test_mixed_graphs_equal_piecewise(tiny, name, dtype, kv):  # noqa: F811
    want, _ = _run(tiny[name], 0, dtype=dtype, kv_cache_dtype=kv, kv_cache_gb=0.05)
    got, replays = _run(tiny[name], 96, dtype=dtype, kv_cache_dtype=kv, kv_cache_gb=0.05)
    assert len(replays) > 5, "the mixed graphs did not run"
    assert max(replays) > 4, "no mixed step above the decode graphs' batch"
    assert_graph_outputs(got, want, dtype)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_mixed_graphs_under_kv_pressure(tiny, name):  # noqa: F811
    """A pool of a few requests' pages, the prefill cap on: capped steps (decodes + a chunk
    of at most R - decodes tokens) replay the mixed graphs; outputs equal an uncapped eager
    run's."""
    kw = dict(dtype="float32", kv_cache_gb=0.002)
    want, _ = _run(tiny[name], 0, kv_bound_step_tokens=0, piecewise_cuda_graph_max_tokens=0,
                   **kw)  # fmt: skip
    got, replays = _run(tiny[name], 96, kv_bound_step_tokens=32, **kw)
    assert len(replays) > 5
    assert_graph_outputs(got, want, "float32")
