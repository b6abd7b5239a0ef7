"""gpt-oss: the Llama stack (q/k/v/o with bias from `attention_bias`, sliding and full layers
from `layer_types`, final RMSNorm, untied head) with a learned sink logit per attention head,
YaRN rotary (cos/sin scaled by its mscale), and a `SparseMoE` in every layer: a router with bias,
top-k of the logits then softmax over those k, and clamped SwiGLU experts with biases.

Checkpoints keep transformers' expert layout, gate and up interleaved on the last dim:
`mlp.experts.gate_up_proj` [E, H, 2I], `gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H],
`down_proj_bias` [E, H]; the released ones store the two weights in MXFP4 (`*_blocks`,
`*_scales`: [E, out, in/32, 16] and [E, out, in/32]), dequantised here at load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from swaserve.models.blocks import rope_attention_scaling
from swaserve.models.llama import LlamaForCausalLM
from swaserve.models.moe import SparseMoE, Target, interleaved_targets
from swaserve.weights.mxfp4 import join_mxfp4

_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?")


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        # Llama's layers, then the MoE parts swapped in (the loader builds on the meta device,
        # so the replaced GatedMLPs never hold memory).
        super().__init__(config)
        scaling = rope_attention_scaling(config, None)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.sinks = nn.Parameter(torch.zeros(config.num_attention_heads))
            attn.rotary.attention_scaling = scaling
            layer.mlp = SparseMoE(
                config.hidden_size,
                config.intermediate_size,
                config.num_local_experts,
                config.num_experts_per_tok,
                scoring="topk_softmax",
                router_bias=True,
                expert_bias=True,
                activation="swigluoai",
                limit=float(getattr(config, "swiglu_limit", 7.0)),
            )

    def map_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Target]:
        """Checkpoint tensors -> parameters (see `swaserve.weights.loader`)."""
        # MXFP4 weights dequantised into the bf16 checkpoints' layout: [E, in, out]
        for name, t in join_mxfp4(tensors, self.lm_head.weight.dtype, transpose=True):
            m = _EXPERTS.fullmatch(name)
            if m is None:
                yield name, None, t
                continue
            mlp, proj, bias = m[1], m[2], m[3] is not None
            if proj == "gate_up_proj":
                yield from interleaved_targets(f"{mlp}.b13" if bias else f"{mlp}.w13", t)
            elif bias:
                yield f"{mlp}.b2", None, t
            else:  # [E, I, H] -> [E, H, I]
                yield f"{mlp}.w2", None, t.transpose(1, 2)
