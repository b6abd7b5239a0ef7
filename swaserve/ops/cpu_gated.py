"""A gated MLP's `act(gate) * up` on the CPU as two oneDNN GEMMs with epilogues (issue 14,
item 4).

`GatedMLP` on packed weights ran one GEMM for gate|up, then the activation, the product and a
copy as three torch passes over the [T, 2I] output. oneDNN applies "post-ops" to a GEMM's
output tile while it is still in cache: the gate GEMM carries the activation (its eltwise
post-op), and the up GEMM multiplies by the activated gate (a binary post-op reading the other
tensor). Gemma 3 270M in `benchmarks/cpu_step.py`, 2 threads of this project's CPU: the MLPs
of a run's prefill step 1,129 -> 1,070 ms, of its decode steps (16 rows) 905 -> 827 ms, -2.5%
of the run (benchmarks/RESULTS.md; one layer with its weights hot in cache gains more, 75 -> 57
ms at 1,530 rows, but in the engine the weights stream from memory).

Numerics: the GEMMs are the packed ones as before (float32, oneDNN's sums); the product
rounds as torch's multiply; oneDNN's activations (vector exp/tanh/erf, by ISA) differ from
torch's by a few float32 ulps of their output: ~3 for SiLU and tanh-GELU on this project's
AVX-512 CPU, erf-GELU bit-equal there (tests/unit/test_cpu_gated.py allows 16). The
activations without a post-op keep the merged GEMM (`cpu_pack`).
"""

from __future__ import annotations

import torch
from torch import nn

from swaserve.ops.cpu_linear import PackedWeight

# blocks.ACTIVATIONS name -> oneDNN eltwise post-op (attr, algorithm) of `_linear_pointwise`
POST_OPS = {"silu": ("swish", ""), "gelu_pytorch_tanh": ("gelu", "tanh"), "gelu": ("gelu", "none")}


def available(act: str) -> bool:
    """Whether this torch has the binary post-op and `act` has an eltwise one."""
    return act in POST_OPS and hasattr(torch.ops.mkldnn._linear_pointwise, "binary")


class PackedGatedProj(nn.Module):
    """x -> act(x Wg^T + bg) * (x Wu^T + bu) `[..., I]` for packed float32 `gate` and `up`
    weights `[I, K]` (the two halves `GatedMLP.gate_up_proj` used to hold merged)."""

    def __init__(
        self,
        gate: PackedWeight,
        up: PackedWeight,
        gate_bias: torch.Tensor | None,
        up_bias: torch.Tensor | None,
        act: str,
    ) -> None:
        super().__init__()
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        if not available(act):
            raise ValueError(f"no oneDNN post-op for activation {act!r}")
        self.gate, self.up, self.act = gate, up, act
        self.attr, self.algorithm = POST_OPS[act]
        self.gate_bias = None if gate_bias is None else nn.Parameter(gate_bias.detach(), False)
        self.up_bias = None if up_bias is None else nn.Parameter(up_bias.detach(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, (n, k) = x.shape[:-1], self.gate.shape
        x2 = x.reshape(-1, k).contiguous()
        if x2.shape[0] == 0:
            return x.new_empty(*lead, n)
        ops = torch.ops.mkldnn
        g = ops._linear_pointwise(x2, self.gate.packed, self.gate_bias, self.attr, [],
                                  self.algorithm)  # fmt: skip
        return ops._linear_pointwise.binary(x2, g, self.up.packed, self.up_bias, "mul").view(
            *lead, n
        )

    def extra_repr(self) -> str:
        return f"in_features={self.gate.shape[1]}, out_features={self.gate.shape[0]}, " \
            f"act={self.act}, packed"
