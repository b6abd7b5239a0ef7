"""GPU only: an engine gives its device memory back, dropped (`del`, reference counting
alone) or shut down, with every graph path on (decode, piecewise, verify graphs), for plain
decoding, n-gram and DFlash speculation. tests/unit/test_engine_release.py checks the same
objects on the CPU; CUDA graphs, their memory pools and the drafter exist only here."""

from __future__ import annotations

import gc

import pytest
import torch

from swaserve import Engine, SamplingParams
from tests.unit.test_engine_release import folder  # noqa: F401  (the same tiny Llama)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

POOL_GB = 1.0
SLACK = 16 * 2**20


def _torch_caches() -> None:
    """torch keeps a cuBLAS workspace (32 MiB on Hopper) per stream that ran a GEMM, past any
    engine: each graph capture's side stream adds one. Not the engine's: cleared here."""
    torch._C._cuda_clearCublasWorkspaces()


def _allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _use(eng: Engine) -> None:
    repeat = [5, 6, 7, 8] * 12  # the n-gram drafter finds drafts in it
    out = eng.generate(prompt_token_ids=[repeat, repeat[:20], [9] * 70],
                       sampling_params=SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True),
                       use_tqdm=False)  # fmt: skip
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def _check_dropped(start) -> None:
    base = _allocated()
    eng = start()
    _use(eng)
    runner = eng.core.runner
    assert runner.graphs is not None and runner.piecewise is not None
    held = _allocated() - base
    assert held > 0.9 * POOL_GB * 2**30
    del runner
    gc.disable()  # reference counting only: a cycle would survive in the frozen generation
    try:
        del eng
        _torch_caches()
        left = _allocated() - base
    finally:
        gc.enable()
    assert left < SLACK, f"{left / 2**20:.0f} MiB of {held / 2**20:.0f} kept after `del`"


@pytest.mark.parametrize("extra", [{}, {"speculative_algorithm": "ngram"}],
                         ids=["plain", "ngram"])  # fmt: skip
def test_a_dropped_engine_returns_device_memory(folder, extra):  # noqa: F811
    _check_dropped(lambda: Engine(model=folder, kv_cache_gb=POOL_GB, cuda_graph_max_bs=8,
                                  **extra))


def test_a_dropped_dflash_engine_returns_device_memory(tmp_path):
    pytest.importorskip("dflash", reason="the dflash reference package (pip install --no-deps "
                        "dflash)")  # fmt: skip
    from tests.unit.test_dflash_engine import _reference, _target

    _target("qwen3").save_pretrained(tmp_path / "target")
    _reference("qwen3").save_pretrained(tmp_path / "drafter")
    _check_dropped(lambda: Engine(
        model=str(tmp_path / "target"), kv_cache_gb=POOL_GB, cuda_graph_max_bs=4,
        speculative_algorithm="dflash", speculative_draft_model=str(tmp_path / "drafter"),
        disable_adaptive_speculation=True))  # fmt: skip


def test_shutdown_returns_device_memory_a_cycle_would_keep(folder):  # noqa: F811
    base = _allocated()
    with Engine(model=folder, kv_cache_gb=POOL_GB, cuda_graph_max_bs=8) as eng:
        _use(eng)
        eng.core.kv.planted_cycle = eng.core  # `del` alone would keep all of it now
        reserved = torch.cuda.memory_reserved()
    assert _allocated() - base < SLACK  # shutdown clears torch's cuBLAS workspaces too
    assert torch.cuda.memory_reserved() < reserved - 0.9 * POOL_GB * 2**30  # back to the device
