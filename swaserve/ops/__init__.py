"""Fused Triton kernels for the shared model blocks, as a removable layer (DESIGN §1).

`enable_fused_ops(model)` switches a built model's RMSNorm, Rotary and GatedMLP modules to the
kernels here (rmsnorm.py, rotary.py, activation.py); without it every block runs its eager torch
code, the reference. Importing this package does not import Triton.
"""

from __future__ import annotations

from torch import nn


def enable_fused_ops(model: nn.Module, enabled: bool = True) -> int:
    """Set `fused = enabled` on every RMSNorm, Rotary and GatedMLP of `model`; returns how many
    modules were switched."""
    from swaserve.models.blocks import GatedMLP, RMSNorm, Rotary

    if enabled:  # import Triton and the kernels now, not inside the first forward
        import swaserve.ops.activation  # noqa: F401
        import swaserve.ops.rmsnorm  # noqa: F401
        import swaserve.ops.rotary  # noqa: F401
    switched = 0
    for module in model.modules():
        if isinstance(module, (RMSNorm, Rotary, GatedMLP)):
            module.fused = enabled
            switched += 1
    return switched
