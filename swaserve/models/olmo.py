"""The post-norm family: OLMo 2, OLMo 3 and EXAONE 4.

Their decoder layer has no pre-norm: each sublayer reads the residual stream as it is and its
output is normed before the add,

    h = h + post_attention_layernorm(self_attn(h))
    h = h + post_feedforward_layernorm(mlp(h))

then the final `norm`, the head (untied unless the config ties it) and nothing else. The
architectures differ only in attention:

- OLMo 2 (`Olmo2ForCausalLM`): RMSNorms on q and k over the WHOLE projections (`[H D]` and
  `[Hkv D]`, not per head; `Attention(qk_norm_whole=True)`, applied before the head views, the
  rotary and the K/V store, so the fused prologue only rotates and stores); one rope; every
  layer full attention.
- OLMo 3 (`Olmo3ForCausalLM`): OLMo 2's layer with `layer_types` (by default three sliding
  layers of `sliding_window` in four) and rope settings per layer type (`rope_parameters`
  keyed by type: RoPE scaling, e.g. YaRN, only on the full layers; `blocks.rope_inv_freq`
  reads the layer's own entry).
- EXAONE 4 (`Exaone4ForCausalLM`): per-head q/k RMSNorms (Qwen3's); sliding layers from
  `layer_types` (built by its config from `sliding_window_pattern`). When `sliding_window` is
  set, the global layers use no rotary at all (NoPE): a zero-frequency `Rotary` (cos 1, sin 0)
  leaves q and k as they are on every path, as SmolLM3's NoPE layers in llama.py.

Engine mapping: windows per layer come from `blocks.layer_windows` (the KV pool's attention
groups); the fused (Triton) and CPU-packed paths run through the shared blocks. These models
have no decode GEMV path (`LlamaDecoderLayer.forward_gemv` fuses a pre-norm into the q/k/v and
gate/up GEMVs, which a post-norm layer does not have). Under tensor parallelism the whole-
projection q/k norms are cut with their heads and sum their squares over the ranks
(`swaserve.distributed.layers.ProjectionRMSNorm`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from swaserve.engine.forward_batch import ForwardBatch
from swaserve.models.blocks import (
    Attention,
    GatedMLP,
    RMSNorm,
    Rotary,
    attention_spec,
    head_dim_of,
    head_logits,
    layer_windows,
    residual_stack,
    rope_attention_scaling,
    rope_inv_freq,
)


class PostNormDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        window: int | None,
        layer_type: str | None,
        qk_norm_whole: bool,
        nope_global: bool,
    ) -> None:
        super().__init__()
        hd = head_dim_of(config)
        eps = config.rms_norm_eps
        spec = attention_spec(config, layer_id, window)
        inv_freq = rope_inv_freq(config, hd, layer_type)
        # EXAONE 4: with windows configured, only the sliding layers rotate (global: NoPE)
        if nope_global and getattr(config, "sliding_window", None) and window is None:
            rotary = Rotary(torch.zeros_like(inv_freq), 1.0)
        else:
            rotary = Rotary(inv_freq, rope_attention_scaling(config, layer_type))
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = Attention(
            spec, config.hidden_size, rotary, bias=bias, qk_norm_eps=eps,
            qk_norm_whole=qk_norm_whole,
        )  # fmt: skip
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The residual stream h after this layer (no normed copy travels between layers)."""
        h = h + self.post_attention_layernorm(self.self_attn(positions, h, fb))
        return h + self.post_feedforward_layernorm(self.mlp(h))


class PostNormModel(nn.Module):
    def __init__(self, config: Any, qk_norm_whole: bool, nope_global: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        windows = layer_windows(config)
        # the rope entry of each layer: its `layer_types` name (OLMo 3 keys rope_parameters by
        # it), None without layer types (one rope for all)
        types = list(getattr(config, "layer_types", None) or [None] * len(windows))
        self.layers = nn.ModuleList(
            PostNormDecoderLayer(config, i, w, types[i], qk_norm_whole, nope_global)
            for i, w in enumerate(windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(fb.input_ids)
        return residual_stack(self.layers, self.norm, h, fb)


class Olmo2ForCausalLM(nn.Module):
    qk_norm_whole = True  # q/k RMSNorms over the whole projections (OLMo 2/3)
    nope_global = False  # full layers without rotary when windows are set (EXAONE 4)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = PostNormModel(config, self.qk_norm_whole, self.nope_global)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self, hidden)


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2's layer; sliding layers and per-type rope come from the config."""


class Exaone4ForCausalLM(Olmo2ForCausalLM):
    qk_norm_whole = False
    nope_global = True
