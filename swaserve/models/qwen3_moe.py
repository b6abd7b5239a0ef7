"""Qwen3-MoE: the Qwen3 layer (q/k norms, sliding windows when the config has them) with a
`SparseMoE` MLP on the sparse layers (every `decoder_sparse_step`-th, except `mlp_only_layers`)
and the dense `GatedMLP` of `intermediate_size` elsewhere.

Routing: softmax over all experts in float32, top-k, renormalised when `norm_topk_prob`.
Checkpoints: the Hub's one Linear per expert (`mlp.experts.<e>.{gate,up,down}_proj.weight`,
also what transformers 5 writes) or transformers' fused in-memory layout
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj`); the
router is `mlp.gate.weight`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from swaserve.models.blocks import rope_attention_scaling
from swaserve.models.llama import LlamaForCausalLM
from swaserve.models.moe import SparseMoE, Target, per_expert_targets

# checkpoint suffix -> SparseMoE parameter (the rest of the name is kept)
_RENAMES = {
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.experts.gate_up_proj": "mlp.w13",
    "mlp.experts.down_proj": "mlp.w2",
}
_RENAME = re.compile(r"(.*\.)(" + "|".join(re.escape(k) for k in _RENAMES) + ")")


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, config: Any) -> None:
        # Llama's layers, then the MoE parts swapped in (the loader builds on the meta device,
        # so the replaced GatedMLPs never hold memory).
        super().__init__(config)
        scaling = rope_attention_scaling(config, None)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.rotary.attention_scaling = scaling
            if is_sparse_layer(config, i):
                layer.mlp = SparseMoE(
                    config.hidden_size,
                    config.moe_intermediate_size,
                    config.num_experts,
                    config.num_experts_per_tok,
                    scoring="softmax_topk",
                    renormalize=bool(config.norm_topk_prob),
                )

    def map_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Target]:
        """Checkpoint tensors -> parameters (see `swaserve.weights.loader`)."""
        for name, t in tensors:
            per_expert = per_expert_targets(name, t)
            if per_expert is not None:
                yield from per_expert
                continue
            m = _RENAME.fullmatch(name)
            yield (m[1] + _RENAMES[m[2]] if m else name), None, t
