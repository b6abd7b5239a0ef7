"""Cohere2 (Command R7B, Command A): a parallel decoder block over sliding and full layers.

Per layer, one input norm feeds attention and the MLP side by side:

    x = LayerNorm(h);  h' = h + attn(x) + mlp(x)

- LayerNorm (`CohereLayerNorm`): mean-subtracted, scaled by a weight, no bias (eps
  `layer_norm_eps`), in float32; the final norm is the same.
- Sliding layers (`layer_types`, `sliding_window`) rotate q and k with Cohere's INTERLEAVED
  rotary (pairs 2i, 2i+1 share frequency i); full-attention layers have no rotary at all (NoPE).
- The logits are the tied embedding's times `logit_scale`.

How it maps to the engine: the interleaved rotary becomes the engine's half-split (neox) rotary
exactly by permuting, at load (`map_checkpoint`), the rows of q_proj and k_proj within each head,
even dims first, then odd: with P that permutation, neox(P q) = P interleaved(q) for every
position, and (P q) . (P k) = q . k, so the attention scores are unchanged while every rotary
path (eager torch, the Triton rope/store prologue, the decode GEMV's) runs as for Llama. v and o
are untouched (the attention output stays in v's layout). NoPE layers get a zero-frequency
rotary (cos 1, sin 0), as SmolLM3's in llama.py; their q/k rows are permuted too, which changes
nothing there (q . k is permutation-invariant).

The layer reuses the shared `Attention` and `GatedMLP`, so CPU packing (ops/cpu_pack.py), the
fused Triton projections and tensor parallelism apply to them as to Llama's. It has no RMSNorm
in front of its projections and no residual behind each of them, so it does not take Llama's
decode GEMV path (`LlamaDecoderLayer.forward_gemv`); its norms run in torch on every path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from swaserve.engine.forward_batch import ForwardBatch
from swaserve.models.blocks import (
    Attention,
    GatedMLP,
    Rotary,
    attention_spec,
    head_dim_of,
    head_logits,
    layer_windows,
    residual_stack,
    rope_attention_scaling,
    rope_inv_freq,
)
from swaserve.models.moe import Target


class CohereLayerNorm(nn.Module):
    """LayerNorm with a weight and no bias, computed in float32 (Cohere's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        out = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), None, self.eps)
        return out.to(dtype)


def interleaved_to_half(head_dim: int) -> torch.Tensor:
    """The row order within one head that turns interleaved rotary into half-split rotary:
    [0, 2, 4, ..., 1, 3, 5, ...] (new row j < D/2 is old row 2j, new row D/2 + j old 2j + 1)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, window: int | None) -> None:
        super().__init__()
        hd = head_dim_of(config)
        spec = attention_spec(config, layer_id, window)
        inv_freq = rope_inv_freq(config, hd, None)
        if inv_freq.shape[0] * 2 != hd:
            # the reference's default rotary turns every dim (it ignores a partial factor)
            raise ValueError(f"Cohere2: partial rotary is not supported (head_dim {hd})")
        if window is None:  # NoPE: zero frequencies rotate by nothing
            rotary = Rotary(torch.zeros_like(inv_freq), 1.0)
        else:
            rotary = Rotary(inv_freq, rope_attention_scaling(config, None))
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = Attention(spec, config.hidden_size, rotary, bias=bias)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)
        # Tensor parallelism: the TP group once o_proj and down_proj are set to leave their
        # partial sums unreduced (`_reduce_once`); False on one device. None: not looked at yet.
        self._tp: Any = None

    def forward(self, positions: torch.Tensor, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The residual stream after this layer: h + attn(x) + mlp(x), x = input_layernorm(h)."""
        tp = self._reduce_once()
        x = self.input_layernorm(h)
        out = self.self_attn(positions, x, fb)
        if tp:  # each rank's attn + mlp partial sums, reduced once (the residual is not)
            return h + tp.all_reduce(out + self.mlp(x))
        return h + out + self.mlp(x)

    def _reduce_once(self) -> Any:
        """Under tensor parallelism (o_proj and down_proj row-parallel, distributed/layers.py)
        the two sublayer outputs are summed before one all-reduce instead of two: switch the
        projections' own all-reduce off on first use and return the group; False otherwise."""
        if self._tp is None:
            o, down = self.self_attn.o_proj, self.mlp.down_proj
            tp = getattr(o, "tp", None)
            if tp is not None and getattr(down, "tp", None) is tp and hasattr(o, "reduce"):
                o.reduce = down.reduce = False
                self._tp = tp
            else:
                self._tp = False
        return self._tp


class Cohere2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Cohere2DecoderLayer(config, i, w) for i, w in enumerate(layer_windows(config))
        )
        self.norm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(fb.input_ids)
        return residual_stack(self.layers, self.norm, h, fb)


class Cohere2ForCausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = Cohere2Model(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logit_scale = float(getattr(config, "logit_scale", 1.0))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self, hidden) * self.logit_scale

    def map_checkpoint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Target]:
        """Checkpoint tensors -> parameters (see `swaserve.weights.loader`): q_proj and k_proj
        rows (and biases) reordered within each head by `interleaved_to_half`, whole heads
        kept together, so a tensor-parallel shard of whole heads cuts the permuted tensor as
        it would the original one."""
        hd = head_dim_of(self.config)
        perm = interleaved_to_half(hd)
        for name, t in tensors:
            if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
                rows = t.shape[0]
                t = t.reshape(rows // hd, hd, *t.shape[1:])[:, perm].reshape(t.shape)
            yield name, None, t
