"""CPU float32 linears through oneDNN with each weight reordered once (the CPU side of the
fast paths that `--disable-fused-ops` turns off).

At decode sizes (a few to a few hundred rows) `F.linear` on CPU reads its weight far below the
memory bandwidth: Gemma 3 270M's tied 262,144 x 640 head at 16 rows took 124 ms (5.3 GB/s)
against 54 ms through oneDNN with the weight in its own blocked layout (benchmarks/RESULTS.md,
CPU results), and the whole engine went from 59 to 86 tok/s on the issue-14 CPU workload, with
the same greedy tokens. The reordered copy is made once, at start; the dense weight stays (the
state dict, the embedding lookup of tied heads and the eager reference read it), so weights
take twice their memory on this path.

Only exact `nn.Linear` modules are switched (tensor-parallel layers subclass it and keep their
own forward), and the model's head through `packed_head`, which `compute_logits` reads. A
weight changed after `enable_cpu_packed_linears` would leave its copy stale: call it again.
"""

from __future__ import annotations

import types

import torch
from torch import nn


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None):
    """`F.linear(x, w, bias)` with `packed = w.to_mkldnn()`; x float32, any leading dims."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [None], "")
    return out.view(*lead, out.shape[-1])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, self.packed_weight, self.bias)


@torch.no_grad()
def enable_cpu_packed_linears(model: nn.Module) -> int:
    """Switch the float32 CPU `nn.Linear`s of `model` and its head to reordered weights;
    returns how many linears were switched (0 where oneDNN is not available)."""
    if not available():
        return 0
    switched = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is nn.Linear and w.device.type == "cpu" and w.dtype == torch.float32:
            module.packed_weight = w.detach().to_mkldnn()
            module.forward = types.MethodType(_forward, module)
            switched += 1
    inner = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    if getattr(model, "tie_word_embeddings", False) and inner is not None:
        w = inner.embed_tokens.weight
        if w.device.type == "cpu" and w.dtype == torch.float32:
            model.packed_head = w.detach().to_mkldnn()
    elif hasattr(lm_head, "packed_weight"):  # switched above: one copy serves both
        model.packed_head = lm_head.packed_weight
    return switched
