"""The DFlash drafter on the fused path (Triton RMSNorm, rotary, merged gate/up with the fused
activation; what `build_proposer` switches on beside a CUDA target) equals its eager torch code:
the context projection, each layer's context K/V, and a batched block forward, float32, on the
tiny Qwen3 (full drafter layers) and Gemma 3 (a sliding drafter layer) drafters of
test_dflash_engine. Runs the kernels under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from swaserve.ops import enable_fused_ops
from swaserve.speculative.dflash_model import BatchedContext, load_dflash_drafter
from tests.unit.test_dflash_engine import models  # noqa: F401

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item())


def test_fused_drafter_equals_eager(models, monkeypatch):  # noqa: F811
    import swaserve.ops.rmsnorm as rms
    import swaserve.ops.rotary as rot

    calls = []
    for mod, name in ((rot, "apply_rotary"), (rms, "rmsnorm")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n),
                                                                          _r(*a, **k))[1])
    target_dir, drafter_dir, target, _, _ = models
    device = "cuda" if torch.cuda.is_available() else "cpu"
    eager = load_dflash_drafter(drafter_dir, target.config, device, torch.float32)
    fused = copy.deepcopy(eager)
    assert enable_fused_ops(fused) > 0
    cfg = eager.cfg
    g = torch.Generator().manual_seed(3)
    t, n_ids = 11, len(cfg.target_layer_ids)
    feats = torch.randn(t, n_ids * cfg.hidden_size, generator=g).to(device)
    positions = torch.arange(5, 5 + t, device=device)
    with torch.inference_mode():
        ctx_e, ctx_f = eager.project_context(feats), fused.project_context(feats)
        _close(ctx_f, ctx_e)
        for j in range(cfg.num_layers):
            e, f = eager.context_kv(j, ctx_e, positions), fused.context_kv(j, ctx_e, positions)
            _close(f.k, e.k)
            _close(f.v, e.v)
        # two blocks of B rows over 6 context keys each (the second sees only 4 of them)
        r, b, c = 2, cfg.block_size, 6
        embeds = torch.randn(r, b, cfg.hidden_size, generator=g).to(device)
        starts = torch.tensor([6, 4], device=device)
        block_pos = starts[:, None] + torch.arange(b, device=device)[None, :]
        cols = torch.arange(c, device=device)
        ctx = []
        for _ in range(cfg.num_layers):
            shape = (r, c, cfg.num_kv_heads, cfg.head_dim)
            k = torch.randn(*shape, generator=g).to(device)
            v = torch.randn(*shape, generator=g).to(device)
            ctx.append(BatchedContext(k, v, cols[None, :].expand(r, c),
                                      cols[None, :] < starts[:, None]))
        want = eager.forward_blocks(embeds, block_pos, ctx)
        got = fused.forward_blocks(embeds, block_pos, ctx)
        _close(got, want)
    assert {"apply_rotary", "rmsnorm"} <= set(calls)  # the kernels ran, not the eager code
