"""Llama family (SmolLM2, Llama 3): pre-norm decoder, rotary, SiLU-gated MLP.

Qwen2, Qwen3, Mistral, Phi-3, SmolLM3 and Granite reuse this file's layer with small switches
(qwen2.py, qwen3.py, mistral.py, phi3.py, granite.py; SmolLM3's NoPE layers are read here);
CWM is this class as it is (registry.py).
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
    add_rmsnorm,
    attention_spec,
    head_dim_of,
    head_logits,
    head_module,
    layer_windows,
    residual_stack,
    rope_attention_scaling,
    rope_inv_freq,
)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, window: int | None, qk_norm: bool, qkv_bias: bool
    ) -> None:
        super().__init__()
        hd = head_dim_of(config)
        spec = attention_spec(config, layer_id, window)
        inv_freq = rope_inv_freq(config, hd, None)
        # SmolLM3's NoPE layers (no_rope_layers[i] == 0): zero frequencies rotate by nothing
        # (cos 1, sin 0), so every fused rotary path leaves q and k as they are
        if not getattr(config, "no_rope_layers", None) or config.no_rope_layers[layer_id]:
            rotary = Rotary(inv_freq, rope_attention_scaling(config, None))
        else:
            rotary = Rotary(torch.zeros_like(inv_freq), 1.0)
        self.self_attn = Attention(
            spec,
            config.hidden_size,
            rotary,
            bias=getattr(config, "attention_bias", False) or qkv_bias,
            qk_norm_eps=config.rms_norm_eps if qk_norm else None,
            o_bias=getattr(config, "attention_bias", False),
        )
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=getattr(config, "mlp_bias", False),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        h: torch.Tensor,
        next_norm: RMSNorm,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x = input_layernorm(h) of the residual stream h; returns (next_norm(h'), h') of the
        output stream h', so each residual add runs inside the norm that follows it."""
        a = self.self_attn(positions, x, fb)
        x, h = add_rmsnorm(a, h, self.post_attention_layernorm)
        return add_rmsnorm(self.mlp(x), h, next_norm)

    def gemv_ready(self) -> bool:
        """The decode GEMV path (`forward_gemv`) can run this layer: a dense MLP, fused, merged
        projections on one device (tensor parallelism's row-parallel o/down add their
        all-reduce, where a residual add inside the GEMV would count the residual once per
        rank), in the model's dtype or all fp8 (`--quantization fp8`: e4m3 codes and their
        scales, read as weights-only fp8)."""
        attn, mlp = self.self_attn, self.mlp
        if not (isinstance(mlp, GatedMLP) and attn.fused and mlp.fused):
            return False  # MoE layers (gpt-oss, Qwen3-MoE) or the eager blocks
        dense = (
            attn.qkv_weight is not None and mlp.gate_up_weight is not None
            and type(attn.o_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
        )  # fmt: skip
        return dense or all(_fp8_on_one_device(m) for m in self._gemv_linears())

    def _gemv_linears(self) -> list:
        a, m = self.self_attn, self.mlp
        return [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]

    def _gemv_operands(self) -> list[tuple]:
        """(weight, bias, per-row scale or None) of q|k|v, o, gate|up and down, as `gemv` takes
        them: the merged tensors in the model's dtype, or the Fp8Linears' codes and scales."""
        a, m = self.self_attn, self.mlp
        if a.qkv_weight is not None:
            return [(a.qkv_weight, a.qkv_bias, None), (a.o_proj.weight, a.o_proj.bias, None),
                    (m.gate_up_weight, m.gate_up_bias, None),
                    (m.down_proj.weight, m.down_proj.bias, None)]  # fmt: skip
        return [(f.weight, f.bias, f.weight_scale) for f in self._gemv_linears()]

    def forward_gemv(
        self, positions: torch.Tensor, h: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """This layer on a few rows (swaserve/ops/gemv.py): each RMSNorm rides in front of the
        GEMV it feeds, the gated activation in front of down, and each residual add behind o
        and down, so the layer is four GEMVs and the attention launches. Takes and returns the
        residual stream (no normed copy between layers)."""
        from swaserve.ops.gemv import default_config, gemv, row_config

        attn, mlp = self.self_attn, self.mlp
        rows = h.shape[0]
        (w, b, s), (wo, bo, so), (wgu, bgu, sgu), (wd, bd, sd) = self._gemv_operands()
        # the q/k/v GEMV also rotates q/k and stores K/V where the model allows (RopeStore)
        qkv_cfg = row_config(rows, "qkv") or default_config(rows, w.shape[0], w.shape[1], norm=True)
        store = attn.gemv_rope_store(positions, fb, qkv_cfg.block_n)
        qkv = gemv(h, w, b, norm=self.input_layernorm, config=qkv_cfg, rope_store=store,
                   weight_scale=s)  # fmt: skip
        a = attn.attend(positions, qkv, fb, kv_stored=store is not None)
        h = gemv(a, wo, bo, residual=h, config=row_config(rows, "o"), weight_scale=so)
        gu = gemv(h, wgu, bgu, norm=self.post_attention_layernorm,
                  config=row_config(rows, "gate_up"), weight_scale=sgu)  # fmt: skip
        return gemv(gu, wd, bd, residual=h, act=mlp.act_name, config=row_config(rows, "down"),
                    weight_scale=sd)  # fmt: skip


def _fp8_on_one_device(module: nn.Module | None) -> bool:
    """An Fp8Linear whose output is whole on this device (not a row-parallel partial sum)."""
    from swaserve.ops.fp8_linear import Fp8Linear

    return isinstance(module, Fp8Linear) and module.tp is None


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qk_norm: bool = False, qkv_bias: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, w, qk_norm, qkv_bias)
            for i, w in enumerate(layer_windows(config))
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The embedding output times this (Granite's `embedding_multiplier`, granite.py) on every
        # path; not folded into the table, which may be the tied head.
        self.embed_scale = 1.0
        # Steps of at most this many tokens take the decode GEMV path (`forward_gemv`); set by
        # `swaserve.ops.enable_fused_ops`, 0 (off) on the eager path.
        self.gemv_rows = 0
        self._gemv_ready: bool | None = None

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(fb.input_ids)
        if self.embed_scale != 1.0:
            h = h * self.embed_scale  # a Python float, as transformers multiplies
        if self.takes_gemv(h.shape[0]):
            return self._forward_gemv(h, fb)
        x = self.layers[0].input_layernorm(h)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        last = len(self.layers) - 1
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms, strict=True)):
            x, h = layer(fb.positions, x, h, next_norm, fb)
            if fb.keep_layers:
                fb.keep(i, h, x, i == last)
        return x

    def takes_gemv(self, rows: int) -> bool:
        """A step of `rows` tokens runs the decode GEMV path (each layer's `forward_gemv`)."""
        if not 0 < rows <= self.gemv_rows:  # an empty step (an idle rank's) keeps the other path
            return False
        if self._gemv_ready is None:
            self._gemv_ready = all(layer.gemv_ready() for layer in self.layers)
        return self._gemv_ready

    def _forward_gemv(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return residual_stack(self.layers, self.norm, h, fb, "forward_gemv")


class LlamaForCausalLM(nn.Module):
    qk_norm = False  # per-head RMSNorm on q and k (Qwen3)
    biased_qkv = False  # q/k/v projections with bias, o without (Qwen2)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, qk_norm=self.qk_norm, qkv_bias=self.biased_qkv)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 1 and self.model.takes_gemv(1):  # one row: the GEMV is faster
            from swaserve.ops.gemv import gemv

            return gemv(hidden, head_module(self).weight)
        return head_logits(self, hidden)
