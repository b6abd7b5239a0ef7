"""Granite (IBM Granite 3.x dense) and GraniteSWA: the Llama stack with muP multipliers.

Granite is Llama with four scalars from its config:

    h0 = embed(ids) * embedding_multiplier
    h' = h + residual_multiplier * attn(norm(h))       (and the same for the MLP)
    scores = q . k * attention_multiplier             (instead of 1 / sqrt(head_dim))
    logits = head(norm(h)) / logits_scaling

How it maps to the engine, so that every path of the Llama layer (eager torch, CPU packing, the
fused add+norm kernels, the decode GEMV `LlamaDecoderLayer.forward_gemv`, tensor parallelism)
runs it unchanged:

- `residual_multiplier` is folded into the weights (and biases) of o_proj and down_proj at load
  (`map_checkpoint`): residual_multiplier * (W x + b) = (residual_multiplier W) x +
  residual_multiplier b. Exact in real arithmetic; in float32 equal up to rounding (the folded
  weight is rounded once, where transformers rounds the product once). The scaling is
  elementwise, so a tensor-parallel shard of the folded tensor is the folded shard.
- `embedding_multiplier` multiplies the embedding output in `LlamaModel.forward`
  (`embed_scale`), ahead of both the layer loop and the GEMV path; it is not folded into the
  table, which may be the tied head.
- `attention_multiplier` is the layers' `AttentionSpec.scale`, which every backend reads.
- `logits_scaling` divides the logits in `compute_logits` (the head's GEMV included). The CPU
  greedy head (ops/greedy_head.py) takes the raw head's argmax: it serves only a positive
  power-of-two `logits_scaling` (Granite 3.x ships 8 and 16), by which division is exact.

GraniteSWA (`granite_swa`) adds sliding-window layers (`layer_types`, `sliding_window`), a rope
base per layer (`layer_rope_theta`, 0: no rotary on that layer) and a learned sink per head. Its
reference applies the sink after attention, out * sigmoid(lse - sink) with lse the logsumexp of
the row's scaled logits; with S = exp(lse), sigmoid(lse - sink) = S / (S + exp(sink)), which is
the softmax with `sink` as one extra logit in the denominator: gpt-oss's sinks, which the
attention backends take (`Attention.sinks`, split with the heads under tensor parallelism).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from swaserve.models.blocks import Rotary, head_dim_of, rope_attention_scaling, rope_inv_freq
from swaserve.models.llama import LlamaForCausalLM
from swaserve.models.moe import Target

# the projections whose output joins the residual stream: residual_multiplier is folded into them
_RESIDUAL_OUT = (".self_attn.o_proj.", ".mlp.down_proj.")


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model.embed_scale = float(config.embedding_multiplier)
        self.residual_multiplier = float(config.residual_multiplier)
        self.logits_scaling = float(config.logits_scaling)  # read by greedy_head.greedy_head_for
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.spec = dataclasses.replace(attn.spec, scale=float(config.attention_multiplier))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # a division, as transformers does (not a product with the rounded reciprocal)
        return super().compute_logits(hidden) / self.logits_scaling

    def map_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Target]:
        """Checkpoint tensors -> parameters (see `swaserve.weights.loader`): o_proj and
        down_proj weights and biases times `residual_multiplier`, in float32 (the loader then
        casts to the model's dtype, one rounding)."""
        r = self.residual_multiplier
        for name, t in tensors:
            if r != 1.0 and any(part in name for part in _RESIDUAL_OUT):
                t = t.float() * r
            yield name, None, t


class GraniteSWAForCausalLM(GraniteForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        hd = head_dim_of(config)
        thetas = getattr(config, "layer_rope_theta", None)
        scaling = rope_attention_scaling(config, None)
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            attn.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))
            if thetas is None:
                continue
            # one rope base per layer (the Llama layer took the global one); 0: no rotary, as
            # SmolLM3's NoPE layers (zero frequencies: cos 1, sin 0 on every rotary path)
            if thetas[i]:
                at_theta = copy.copy(config)
                at_theta.rope_parameters = {**config.rope_parameters, "rope_theta": thetas[i]}
                attn.rotary = Rotary(rope_inv_freq(at_theta, hd, None), scaling)
            else:
                attn.rotary = Rotary(torch.zeros_like(attn.rotary.inv_freq_host), 1.0)
