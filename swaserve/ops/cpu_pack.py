"""Which weights of a built model go to oneDNN's packed layout on the CPU (float32), as a
removable layer: `--disable-fused-ops` keeps every weight dense (the eager reference).

`pack_cpu_weights(model)`, called once after loading and before the KV pool is allocated:

- every `Attention`: q/k/v become one packed GEMM (`qkv_proj`; q_proj, k_proj and v_proj are
  removed), o_proj a `PackedLinear`;
- every `GatedMLP`: gate|up one packed GEMM with the activation and the product in a native
  pass (`gated_proj` = `cpu_gated.NativeGatedProj`; SiLU and tanh-GELU with the native
  kernels built), else gate and up two packed GEMMs with them in oneDNN epilogues
  (`cpu_gated.PackedGatedProj`), else, for an activation oneDNN has no post-op for, one packed
  GEMM (`gate_up_proj`) and torch's ops; gate_proj and up_proj are removed, down_proj becomes a
  `PackedLinear`;
- the head: a tied embedding table becomes a `PackedEmbedding` whose `PackedWeight` also serves
  the head's GEMM (`swaserve.models.blocks.head_logits`); an untied `lm_head` a `PackedLinear`.

Each dense weight is dropped as soon as its packed copy exists, so at most one weight (the
largest: the vocabulary table) is held twice, for a moment, during start-up; done before the KV
pool exists, that moment stays below the engine's steady peak (benchmarks/RESULTS.md).
Only exact `nn.Linear` / `nn.Embedding` modules with float32 CPU weights are packed (tensor
-parallel layers subclass them and keep their own forward); other modules (MoE routers and
experts, a DFlash drafter) keep their weights. Readers of a packed module's `.weight` get a
RuntimeError naming this file; `swaserve.ops.cpu_linear.dense_weight` gives a dense copy.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from swaserve.ops import cpu_gated
from swaserve.ops.cpu_linear import PackedEmbedding, PackedLinear, PackedWeight, available


def _packable(*modules: nn.Module) -> bool:
    for m in modules:
        if type(m) not in (nn.Linear, nn.Embedding):
            return False
        if m.weight.dtype != torch.float32 or m.weight.device.type != "cpu":
            return False
    return True


def _packed_linear(linears: list[nn.Linear]) -> PackedLinear:
    """One PackedLinear computing the outputs of `linears` concatenated (rows in order)."""
    if len(linears) == 1:
        weight, bias = linears[0].weight, linears[0].bias
    else:
        weight = torch.cat([m.weight for m in linears])
        biases = [m.bias for m in linears]
        bias = None if biases[0] is None else torch.cat(biases)
    return PackedLinear(PackedWeight(weight), bias)


@torch.no_grad()
def pack_cpu_weights(model: nn.Module) -> int:
    """Pack the model's float32 CPU projections and head (see the module doc); returns how many
    weights were packed (0 where oneDNN is not available)."""
    from swaserve.models.blocks import Attention, GatedMLP

    if not available():
        return 0
    packed = 0
    for module in list(model.modules()):
        if isinstance(module, Attention) and not module.fused and module.qkv_proj is None:
            qkv = [module.q_proj, module.k_proj, module.v_proj]
            if _packable(*qkv, module.o_proj):
                module.qkv_proj = _packed_linear(qkv)
                for name in ("q_proj", "k_proj", "v_proj"):
                    delattr(module, name)
                module.o_proj = _packed_linear([module.o_proj])
                packed += 2
        elif isinstance(module, GatedMLP) and not module.fused and module.gate_up_proj is None:
            gate_up = [module.gate_proj, module.up_proj]
            if _packable(*gate_up, module.down_proj):
                if cpu_gated.native_available(module.act_name):  # one GEMM, a native pass
                    merged = _packed_linear(gate_up)
                    module.gated_proj = cpu_gated.NativeGatedProj(
                        merged.packed, merged.bias, module.act_name
                    )
                elif cpu_gated.available(module.act_name):  # act(gate) * up in GEMM epilogues
                    gp, up = gate_up
                    module.gated_proj = cpu_gated.PackedGatedProj(
                        PackedWeight(gp.weight), PackedWeight(up.weight), gp.bias, up.bias,
                        module.act_name,
                    )
                else:
                    module.gate_up_proj = _packed_linear(gate_up)
                del module.gate_proj, module.up_proj
                module.down_proj = _packed_linear([module.down_proj])
                packed += 2
    packed += _pack_head(model)
    if packed:
        _trim_heap()
        from swaserve.ops import cpu_prologue

        cpu_prologue.enable(model)  # the norms and q/k prologue in few ops, same roundings
    return packed


def _trim_heap() -> None:
    """Give the freed dense weights' pages back to the OS: glibc keeps freed chunks below its
    mmap threshold in the heap (~75 MB resident for Gemma 3 270M without this)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _pack_head(model: nn.Module) -> int:
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if getattr(model, "tie_word_embeddings", False):
        if embed is None or not _packable(embed):
            return 0
        weight = PackedWeight(embed.weight)
        if not weight.gatherable:  # no lookups from its layout: the table stays dense
            return 0
        inner.embed_tokens = PackedEmbedding(weight)
        return 1
    head = getattr(model, "lm_head", None)
    if head is None or not _packable(head):
        return 0
    model.lm_head = _packed_linear([head])
    return 1
