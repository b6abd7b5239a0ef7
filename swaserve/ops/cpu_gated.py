"""A gated MLP's `act(gate) * up` on the CPU (issue 14, item 4): one packed GEMM for gate|up
and a native pass (`NativeGatedProj`), or two oneDNN GEMMs with epilogues (`PackedGatedProj`).

`NativeGatedProj` (SiLU and tanh-GELU where native/act_mul.c is built: `cpu_pack` prefers it):
oneDNN runs the merged [2I, K] GEMM faster than the two halves apart, and native/act_mul.c
computes act(g) * u in one pass over its output. Gemma 3 270M, 16 rows, one MLP's gate|up:
~615-650 us against the post-op pair's ~685-700 (2 threads); at a 1,602-row prefill about
even (the pass is memory-bound there, ~1.1 ms a layer). In the engine, four A/B pairs: the
MLPs' time -4% in decode steps, -2% in the prefill step, ~1.3% of a run (benchmarks/RESULTS.md,
stop 41's session).
Its activations are a few float32 ulps from torch's formulas where the result is not tiny; in
tanh-GELU's far negative tail (x < ~-4) it is the closer of the two (torch's 1 + tanh(y)
cancels there), tested against float64.

`PackedGatedProj`:
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

from swaserve.ops import cpu_native
from swaserve.ops.cpu_linear import PackedWeight

# blocks.ACTIVATIONS name -> oneDNN eltwise post-op (attr, algorithm) of `_linear_pointwise`
POST_OPS = {"silu": ("swish", ""), "gelu_pytorch_tanh": ("gelu", "tanh"), "gelu": ("gelu", "none")}


def available(act: str) -> bool:
    """Whether this torch has the binary post-op and `act` has an eltwise one."""
    return act in POST_OPS and hasattr(torch.ops.mkldnn._linear_pointwise, "binary")


# blocks.ACTIVATIONS name -> native/act_mul.c's code
NATIVE_ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


def native_available(act: str) -> bool:
    """Whether native/act_mul.c is built and has `act`."""
    return act in NATIVE_ACTS and cpu_native.available()


class NativeGatedProj(nn.Module):
    """x -> act(x Wg^T + bg) * (x Wu^T + bu) `[..., I]` from one packed float32 GEMM of the
    stacked weight [Wg; Wu] `[2I, K]` (and bias), then native/act_mul.c's pass."""

    def __init__(self, gate_up: PackedWeight, bias: torch.Tensor | None, act: str) -> None:
        super().__init__()
        if gate_up.shape[0] % 2:
            raise ValueError(f"gate|up {tuple(gate_up.shape)}: an odd number of rows")
        if not native_available(act):
            raise ValueError(f"no native gated pass for activation {act!r}")
        self.gate_up, self.act = gate_up, act
        self.bias = None if bias is None else nn.Parameter(bias.detach(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, (n2, k) = x.shape[:-1], self.gate_up.shape
        n = n2 // 2
        gu = self.gate_up.linear(x.reshape(-1, k), self.bias)  # [T, 2I], contiguous
        out = gu.new_empty(gu.shape[0], n)
        if gu.shape[0]:
            cpu_native.library().swa_act_mul(
                out.data_ptr(), gu.data_ptr(), n2, gu.shape[0], n, NATIVE_ACTS[self.act]
            )
        return out.view(*lead, n)

    def extra_repr(self) -> str:
        return f"in_features={self.gate_up.shape[1]}, out_features={self.gate_up.shape[0] // 2}, " \
            f"act={self.act}, packed gate|up, native"


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
