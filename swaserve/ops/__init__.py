"""Fused Triton kernels for the shared model blocks, as a removable layer (docs/architecture.md §7).

`enable_fused_ops(model)` switches a built model's RMSNorm, Rotary, GatedMLP, Attention and
SparseMoE modules to the kernels here (rmsnorm.py, rotary.py, activation.py, fused_moe.py) and
to merged q/k/v and gate/up GEMMs (merge.py), and lets Llama-family models run steps of a few
tokens through the decode GEMV (gemv.py, norms and residual adds fused into it; the environment
variable SWASERVE_GEMV_ROWS caps the step size, 0 turns it off); without it every block runs
its eager torch code, the reference.
Importing this package does not import Triton.
"""

from __future__ import annotations

import os

from torch import nn


def enable_fused_ops(model: nn.Module, enabled: bool = True) -> int:
    """Set `fused = enabled` on every RMSNorm, Rotary, GatedMLP and Attention of `model`;
    returns how many modules were switched. Enabling first merges the projections (the state
    dict is unchanged, no weight memory is added); the merged layout stays when disabling, the
    eager path reads the same memory through the per-projection views."""
    from swaserve.models.blocks import Attention, GatedMLP, RMSNorm, Rotary
    from swaserve.models.llama import LlamaModel
    from swaserve.models.moe import SparseMoE

    if enabled:  # import Triton and the kernels now, not inside the first forward
        import swaserve.ops.activation  # noqa: F401
        import swaserve.ops.fused_moe  # noqa: F401
        import swaserve.ops.gemv  # noqa: F401
        import swaserve.ops.rmsnorm  # noqa: F401
        import swaserve.ops.rotary  # noqa: F401
        from swaserve.ops.merge import merge_projections

        merge_projections(model)
    switched = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, Rotary, GatedMLP, Attention, SparseMoE)):
            module.fused = enabled
            switched += 1
        elif isinstance(module, LlamaModel):
            module.gemv_rows = gemv_rows(module.embed_tokens.embedding_dim) if enabled else 0
            module._gemv_ready = None
    return switched


def gemv_rows(hidden_size: int) -> int:
    """Steps of at most this many tokens take the decode GEMV path: SWASERVE_GEMV_ROWS (0:
    never; at most `gemv.MAX_DOT_ROWS`), else `gemv.SMALL_MODEL_ROWS` on models of hidden size
    at most `gemv.SMALL_HIDDEN` (speculative verify steps and small decode batches: the GEMV's
    row tiles beat cuBLAS with its separate launches there) and `gemv.MAX_ROWS` on larger ones
    (Llama-8B's shapes: cuBLAS wins past two rows)."""
    from swaserve.ops.gemv import MAX_DOT_ROWS, MAX_ROWS, SMALL_HIDDEN, SMALL_MODEL_ROWS

    env = os.environ.get("SWASERVE_GEMV_ROWS")
    if env is not None:
        return max(0, min(MAX_DOT_ROWS, int(env)))
    return SMALL_MODEL_ROWS if hidden_size <= SMALL_HIDDEN else MAX_ROWS
