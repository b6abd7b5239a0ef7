"""Phi-3 / Phi-4-mini: the Llama layer, with q|k|v and gate|up stored fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, split here at load), partial rotary where `rope_parameters` says
so (Phi-4-mini: 0.75), and `sliding_window` on every layer when set (Phi-3-mini-4k: 2047).
LongRoPE (the 128k checkpoints) is refused by `blocks.rope_inv_freq`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from swaserve.models.blocks import head_dim_of
from swaserve.models.llama import LlamaForCausalLM
from swaserve.models.moe import Target

_FUSED = re.compile(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")


class Phi3ForCausalLM(LlamaForCausalLM):
    def map_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Target]:
        """Checkpoint tensors -> parameters (see `swaserve.weights.loader`)."""
        c, hd = self.config, head_dim_of(self.config)
        q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
        for name, t in tensors:
            m = _FUSED.fullmatch(name)
            if m is None:
                yield name, None, t
            elif m[2] == "self_attn.qkv_proj":
                for proj, part in zip(("q", "k", "v"), t.split([q, kv, kv])):
                    yield f"{m[1]}self_attn.{proj}_proj.weight", None, part
            else:  # gate first, as Phi3MLP chunks it
                gate, up = t.chunk(2)
                yield f"{m[1]}mlp.gate_proj.weight", None, gate
                yield f"{m[1]}mlp.up_proj.weight", None, up
