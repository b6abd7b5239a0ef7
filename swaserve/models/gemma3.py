"""Gemma 3 text (and Gemma 2: the same layer without q/k norms, attention soft-capped; see
Gemma2ForCausalLM; VaultGemma: Gemma 2 without post-norms): sliding/full `layer_types` with
per-kind rope, q/k norms, sandwich norms, `query_pre_attn_scalar`, (1 + w) RMSNorm, tied
embeddings scaled by sqrt(hidden), and soft-capping of the final logits when configured
(attention soft-capping: see below)."""

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
    add_rmsnorm,
    attention_spec,
    head_dim_of,
    head_logits,
    layer_type_names,
    layer_windows,
    rope_attention_scaling,
    rope_inv_freq,
)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, window: int | None, layer_type: str, gemma2: bool,
        post_norms: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        hd = head_dim_of(config)
        eps = config.rms_norm_eps
        spec = attention_spec(
            config, layer_id, window, config.query_pre_attn_scalar**-0.5,
            # Gemma 3 keeps `attn_logit_softcapping` in its config but the reference
            # implementation never applies it; Gemma 2's does.
            softcap=getattr(config, "attn_logit_softcapping", None) if gemma2 else None,
        )  # fmt: skip
        rotary = Rotary(
            rope_inv_freq(config, hd, layer_type), rope_attention_scaling(config, layer_type)
        )
        self.self_attn = Attention(
            spec,
            config.hidden_size,
            rotary,
            bias=getattr(config, "attention_bias", False),
            qk_norm_eps=None if gemma2 else eps,  # Gemma 2 has no q/k norms
            qk_norm_unit_offset=True,
        )
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_activation)
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, eps, unit_offset=True)
        # VaultGemma has no post-norms: each sublayer's output joins the stream as it is
        post = (lambda: RMSNorm(h, eps, unit_offset=True)) if post_norms else (lambda: None)
        self.post_attention_layernorm = post()
        self.pre_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.post_feedforward_layernorm = post()

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        h: torch.Tensor,
        next_norm: RMSNorm,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x = input_layernorm(h) of the residual stream h; returns (next_norm(h'), h') of the
        output stream h'. Each sublayer output is post-normed (where the layer has post-norms),
        added to the stream and the sum pre-normed for the next sublayer: one kernel on the
        fused path."""
        a = self.self_attn(positions, x, fb)
        x, h = add_rmsnorm(a, h, self.pre_feedforward_layernorm, self.post_attention_layernorm)
        return add_rmsnorm(self.mlp(x), h, next_norm, self.post_feedforward_layernorm)


class Gemma3Model(nn.Module):
    gemma2 = False
    post_norms = True  # post_attention_layernorm and post_feedforward_layernorm (not VaultGemma)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        types = layer_type_names(config)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, w, types[i], self.gemma2, self.post_norms)
            for i, w in enumerate(layer_windows(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        emb = self.embed_tokens(fb.input_ids)
        # As Hugging Face: the scale is rounded to the weights' dtype before multiplying.
        h = emb * torch.tensor(self.embed_scale, dtype=emb.dtype)
        x = self.layers[0].input_layernorm(h)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        last = len(self.layers) - 1
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms, strict=True)):
            x, h = layer(fb.positions, x, h, next_norm, fb)
            if fb.keep_layers:
                fb.keep(i, h, x, i == last)
        return x


class Gemma3ForCausalLM(nn.Module):
    model_class = Gemma3Model

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = head_logits(self, hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma2Model(Gemma3Model):
    gemma2 = True


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: Gemma 3's layer without q/k norms, with attention logits soft-capped
    (`attn_logit_softcapping`, 50) and one rope for both layer kinds; alternating sliding and
    full layers (its `layer_types`) and final-logit soft-capping (30) as in Gemma 3's config."""

    model_class = Gemma2Model


class VaultGemmaModel(Gemma2Model):
    post_norms = False


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    """VaultGemma: Gemma 2 without the post-attention and post-feedforward norms (its layer is
    input_layernorm -> attention -> add, pre_feedforward_layernorm -> MLP -> add); everything
    else as Gemma 2: soft-capped attention and final logits, `query_pre_attn_scalar`, the
    embedding scaled by sqrt(hidden), (1 + w) norms, tied head, `layer_types`."""

    model_class = VaultGemmaModel
