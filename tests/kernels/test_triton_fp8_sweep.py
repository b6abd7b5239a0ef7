"""The fp8 attention sweep (benchmarks/fp8_attention_sweep.py) in its CPU mode, and the tile
config override it relies on: every candidate config checked against the torch reference under
the interpreter, so the one GPU run finds them all working.

Names contain `triton` (`pytest -k triton`); SWASERVE_TEST_TRITON_CUDA=1 runs the in-process
tests compiled on CUDA (the sweep's --tiny pass always runs interpreted, in a subprocess).
"""

from __future__ import annotations

import os

_CUDA = os.environ.get("SWASERVE_TEST_TRITON_CUDA") == "1"
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from swaserve.attention.kernels.paged_attention import (  # noqa: E402
    FP8,
    FP8_DECODE_TILE,
    attention_config,
)
from tests.kernels.test_triton_attention import make_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_triton_fp8_sweep_tiny(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SWASERVE_TEST_TRITON_CUDA", None)
    script = ROOT / "benchmarks" / "fp8_attention_sweep.py"
    r = subprocess.run(
        [sys.executable, str(script), "--tiny", "--out", str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads((tmp_path / "fp8_attention_sweep.json").read_text())
    assert data["mode"] == "tiny" and data["failed"] == []
    decode = [c for c in data["checks"] if c["check"].startswith("fp8 decode")]
    assert len(decode) >= 10 and all(c["ok"] for c in data["checks"])


def test_triton_fp8_attention_config():
    dec = attention_config(128, 4, 1, FP8)
    assert (dec.block_m, dec.block_q) == (16, 4)
    assert (dec.block_n, dec.num_warps, dec.num_stages) == FP8_DECODE_TILE
    assert dec.fp8_fp16_dot and dec.fp8_v_cvt_regs
    # prefill tiles and other caches are unchanged by the fp8 decode tile
    assert attention_config(128, 4, 2048, FP8) == attention_config(128, 4, 2048)
    assert attention_config(128, 4, 1, torch.bfloat16) == attention_config(128, 4, 1)
    assert attention_config(256, 2, 1, FP8).fp8_fp16_dot
    assert not attention_config(256, 2, 2048, FP8).fp8_fp16_dot  # wgmma q operand would spill


@pytest.mark.parametrize("kv_dtype", [FP8, None])
def test_triton_config_override(kv_dtype):
    case = make_case([1, 5, 1], [150, 3, 20], group=4, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    default = case.run(scale=0.2)
    cfg = attention_config(32, 4, 5, kv_dtype)
    assert torch.equal(case.run(scale=0.2, config=cfg), default)
    # another tile and the bf16-dot fp8 path: same result up to rounding
    other = dataclasses.replace(cfg, block_n=32, num_warps=8, fp8_fp16_dot=False)
    assert (case.run(scale=0.2, config=other).float() - default.float()).abs().max() < 3e-2
    with pytest.raises(AssertionError):  # block_m must be block_q x next_pow2(group)
        case.run(scale=0.2, config=dataclasses.replace(cfg, block_q=cfg.block_q * 2))
