"""Gemma 4 text (E2B, E4B, 31B, and the MoE 26B-A4B): Gemma 3's sliding/full
layers with what Gemma 4 changed, as transformers' `Gemma4ForCausalLM` computes it:

- Per-kind attention shapes: full layers have their own head size (`global_head_dim`, 512
  against 256) and, with `attention_k_eq_v`, their own KV-head count
  (`num_global_key_value_heads`) and no v_proj (V is the raw K projection). The pool keeps each
  layer's own K/V rows (`GroupLayout.kv_shapes`: a page's bytes are the same for every group).
- q/k norms (weight used as it is, not 1 + w), V normed without a scale, attention scale 1.
- Proportional rope on full layers (`blocks.rope_inv_freq`), plain rope on sliding ones.
- KV sharing: the last `num_kv_shared_layers` layers project no K/V; each reads the K/V of the
  last earlier layer of its kind (`kv_sources`; no pool slots of their own), and with
  `use_double_wide_mlp` their MLP is twice as wide.
- Per-layer embeddings (PLE, E2B/E4B): a second embedding table `[vocab, layers x P]` plus a
  projection of the scaled token embedding, normed and mixed, give each layer a P-vector that
  gates a projection added to its output.
- MoE (26B-A4B): routed experts beside every layer's dense MLP (`Gemma4Experts`), the two
  outputs normed and summed.
- Each layer's output multiplied by its `layer_scalar`; final logits soft-capped.

The multimodal checkpoint (Gemma4ForConditionalGeneration) serves its text model: the
`model.language_model.` prefix is read as `model.`; the vision and audio towers are skipped.
Bidirectional attention over all tokens (`use_bidirectional_attention: "all"`) is refused.
On the GPU the layers take the fused kernels (norms, the post-attention add-norm, the q/k norms
and rotary with the K/V store, the merged q/k/v and gate/up GEMMs, the fused MoE); not the
decode GEMV, which is Llama's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from swaserve.engine.forward_batch import ForwardBatch
from swaserve.models.blocks import (
    ACTIVATIONS,
    Attention,
    AttentionSpec,
    GatedMLP,
    RMSNorm,
    Rotary,
    add_rmsnorm,
    layer_type_names,
    layer_windows,
    rope_attention_scaling,
    rope_inv_freq,
)
from swaserve.models.gemma3 import Gemma3ForCausalLM
from swaserve.models.moe import SparseMoE

# checkpoint suffix of a layer's MoE parts -> Gemma4Experts parameter (the rest kept)
_MOE_RENAMES = {
    "router.proj.weight": "experts.router.weight",
    "router.scale": "experts.router_scale",
    "router.per_expert_scale": "experts.per_expert_scale",
    "experts.gate_up_proj": "experts.w13",  # [E, 2I, H], gate rows first: SparseMoE's layout
    "experts.down_proj": "experts.w2",
}
_MOE_RENAME = re.compile(r"(model\.layers\.\d+\.)(" + "|".join(map(re.escape, _MOE_RENAMES)) + ")")


def _is_full(config: Any, layer: int) -> bool:
    return layer_type_names(config)[layer] == "full_attention"


def layer_attention_shape(config: Any, layer: int) -> tuple[int, int]:
    """(kv_heads, head_dim) of layer `layer` in the checkpoint (before tensor parallelism):
    transformers' per-layer config where it has one, else the global fields (full layers:
    `global_head_dim`, and with `attention_k_eq_v` `num_global_key_value_heads`)."""
    plc = getattr(config, "per_layer_config", None)
    if plc is not None:
        c = plc[layer]
        return int(c.num_key_value_heads), int(c.head_dim)
    kv, hd = config.num_key_value_heads, config.head_dim
    if _is_full(config, layer):
        hd = getattr(config, "global_head_dim", None) or hd
        if getattr(config, "attention_k_eq_v", False):
            kv = getattr(config, "num_global_key_value_heads", None) or kv
    return int(kv), int(hd)


def kv_sources(config: Any) -> list[int]:
    """Per layer, the layer whose K/V it attends to: itself, or for the last
    `num_kv_shared_layers` layers the last earlier (non-shared) layer of the same kind."""
    n = config.num_hidden_layers
    first = n - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    types = layer_type_names(config)
    out = list(range(n))
    for layer in range(max(first, 0), n):
        same = [j for j in range(first) if types[j] == types[layer]]
        if not same:
            raise ValueError(f"Gemma 4 layer {layer} shares K/V but no earlier "
                             f"{types[layer]} layer has its own")
        out[layer] = same[-1]
    return out


def _scaleless_rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Gemma4Attention(Attention):
    """A layer with its own K/V: the shared Attention block plus V's scaleless norm; with
    `attention_k_eq_v` (full layers) the checkpoint's k_proj is loaded as v_proj too
    (`Gemma4ForCausalLM.map_checkpoint`), so q/k/v still run as one GEMM."""

    def __init__(self, spec: AttentionSpec, hidden: int, rotary: Rotary, eps: float,
                 bias: bool) -> None:  # fmt: skip
        super().__init__(spec, hidden, rotary, bias=bias, qk_norm_eps=eps)
        self.v_norm_eps = eps

    def v_norm(self, v: torch.Tensor) -> torch.Tensor:
        return _scaleless_rmsnorm(v, self.v_norm_eps)


class Gemma4SharedAttention(nn.Module):
    """A KV-shared layer: q/o projections and the q norm only; it attends to its source
    layer's K/V in the pool (the backend's `kv_stored` path, k = v = None)."""

    tp_query_only = True  # tensor parallelism: q/o cut by heads (distributed/layers.py)

    def __init__(self, spec: AttentionSpec, hidden: int, rotary: Rotary, eps: float,
                 bias: bool) -> None:  # fmt: skip
        super().__init__()
        self.spec = spec
        h, d = spec.num_heads, spec.head_dim
        self.q_proj = nn.Linear(hidden, h * d, bias=bias)
        self.o_proj = nn.Linear(h * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, eps)
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, s.num_heads, s.head_dim))
        q, _ = self.rotary(positions, q, q[:, :0])  # no keys to turn: zero heads
        out = fb.backend.forward(q, None, None, s, None, fb, kv_stored=True)
        return self.o_proj(out.reshape(t, s.num_heads * s.head_dim))


class Gemma4Experts(SparseMoE):
    """Gemma 4's routed experts (26B-A4B), beside the dense MLP of every layer. The router reads
    the residual stream (not the experts' input): norm without scale, times `router_scale` and
    hidden^-1/2, a linear map to expert logits, softmax over all experts in float32, top-k,
    renormalised, each weight then times its expert's `per_expert_scale`. The experts see
    `pre_feedforward_layernorm_2` of the stream; gelu(tanh) gate times up."""

    one_init = ("router_scale", "per_expert_scale")  # dummy weights: scales at 1

    def __init__(self, config: Any) -> None:
        h = config.hidden_size
        super().__init__(
            h, config.moe_intermediate_size, config.num_experts, config.top_k_experts,
            scoring="softmax_topk", renormalize=True, activation=config.hidden_activation,
        )  # fmt: skip
        self.router_scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.eps = config.rms_norm_eps

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = _scaleless_rmsnorm(h, self.eps) * self.router_scale * h.shape[-1] ** -0.5
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        return weights.to(h.dtype), ids

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Experts of `x`, routed by the residual stream `h`."""
        if self.ep is not None:
            raise NotImplementedError("expert parallelism for Gemma 4's MoE")
        weights, ids = self.route(h)
        b2 = self.b2 if self.tp is None or self.tp.rank == 0 else None
        out = self.run_experts(x, weights, ids, b2)
        return out if self.tp is None else self.tp.all_reduce(out)


class Gemma4DecoderLayer(nn.Module):
    one_init = ("layer_scalar",)  # dummy weights: the output scale at 1, not 0

    def __init__(self, config: Any, layer_id: int, window: int | None, layer_type: str,
                 source: int) -> None:  # fmt: skip
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        kv_heads, hd = layer_attention_shape(config, layer_id)
        spec = AttentionSpec(layer_id, config.num_attention_heads, kv_heads, hd, 1.0, window)
        rotary = Rotary(rope_inv_freq(config, hd, layer_type),
                        rope_attention_scaling(config, layer_type))  # fmt: skip
        bias = bool(getattr(config, "attention_bias", False))
        shared = source != layer_id
        cls = Gemma4SharedAttention if shared else Gemma4Attention
        self.self_attn = cls(spec, h, rotary, eps, bias)
        wide = 2 if shared and getattr(config, "use_double_wide_mlp", False) else 1
        self.mlp = GatedMLP(h, config.intermediate_size * wide, config.hidden_activation)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.experts = Gemma4Experts(config) if getattr(config, "enable_moe_block", False) \
            else None  # fmt: skip
        if self.experts is not None:
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.ple:
            self.act = ACTIVATIONS[config.hidden_activation]
            self.per_layer_input_gate = nn.Linear(h, self.ple, bias=False)
            self.per_layer_projection = nn.Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, ple: torch.Tensor | None,
                fb: ForwardBatch) -> torch.Tensor:  # fmt: skip
        a = self.self_attn(positions, self.input_layernorm(h), fb)
        # h += post_attention_layernorm(a), x = pre_feedforward_layernorm(h): one fused launch
        x, h = add_rmsnorm(a, h, self.pre_feedforward_layernorm, self.post_attention_layernorm)
        m = self.mlp(x)
        if self.experts is not None:  # dense MLP and routed experts, each normed, summed
            e = self.experts(h, self.pre_feedforward_layernorm_2(h))
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(e)
        h = h + self.post_feedforward_layernorm(m)
        if self.ple:
            g = self.act(self.per_layer_input_gate(h)) * ple
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return h * self.layer_scalar.to(h.dtype)


class Gemma4Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention='all' is not a causal "
                             "LM; swaserve serves causal attention only")
        h, n = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_scale = h**0.5
        types, sources = layer_type_names(config), kv_sources(config)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, i, w, types[i], sources[i])
            for i, w in enumerate(layer_windows(config))
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.ple = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.ple:
            p = self.ple
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, n * p)
            self.ple_embed_scale = p**0.5
            self.per_layer_model_projection = nn.Linear(h, n * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps)

    def _per_layer_inputs(self, ids: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """[T, layers, P]: (norm(proj(emb) / sqrt(hidden)) + ple(ids) * sqrt(P)) / sqrt(2)."""
        n, p = len(self.layers), self.ple
        tok = self.embed_tokens_per_layer(ids)
        tok = (tok * torch.tensor(self.ple_embed_scale, dtype=tok.dtype)).view(-1, n, p)
        proj = self.per_layer_model_projection(emb) * emb.shape[-1] ** -0.5
        proj = self.per_layer_projection_norm(proj.view(-1, n, p))
        return (proj + tok) * 2.0**-0.5

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        emb = self.embed_tokens(fb.input_ids)
        # As Hugging Face: the scale is rounded to the weights' dtype before multiplying.
        h = emb * torch.tensor(self.embed_scale, dtype=emb.dtype)
        ple = self._per_layer_inputs(fb.input_ids, h) if self.ple else None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(fb.positions, h, None if ple is None else ple[:, i], fb)
            if fb.keep_layers and i != last:
                fb.keep(i, h, h, False)
        x = self.norm(h)
        if fb.keep_layers:
            fb.keep(last, h, x, True)
        return x


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 3's head (tied, final soft-capping) over Gemma4Model."""

    model_class = Gemma4Model

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._k_eq_v = {
            i for i, layer in enumerate(self.model.layers)
            if isinstance(layer.self_attn, Gemma4Attention) and _is_full(config, i)
            and getattr(config, "attention_k_eq_v", False)
        }  # fmt: skip

    def kv_layout(self) -> tuple[list[tuple[int, int]], list[int]]:
        """(per-layer (kv_heads, head_dim) as built, i.e. per rank under TP; per-layer K/V
        source) for the pool (`memory.groups.model_layout`)."""
        sources = kv_sources(self.config)
        specs = [layer.self_attn.spec for layer in self.model.layers]
        return [(specs[s].num_kv_heads, specs[s].head_dim) for s in sources], sources

    def map_checkpoint(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, int | None, torch.Tensor]]:
        """The text model's tensors under this module's names: the multimodal checkpoint's
        `model.language_model.` read as `model.`, its towers and embedders skipped; a full
        layer with `attention_k_eq_v` gets its k_proj as v_proj too."""
        for name, t in tensors:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            elif name.startswith(("model.vision_tower.", "model.audio_tower.",
                                  "model.embed_vision.", "model.embed_audio.")):
                continue
            m = _MOE_RENAME.fullmatch(name)
            if m:
                name = m[1] + _MOE_RENAMES[m[2]]
            yield name, None, t
            parts = name.split(".")
            if (len(parts) > 4 and parts[:2] == ["model", "layers"]
                    and parts[3:5] == ["self_attn", "k_proj"]
                    and int(parts[2]) in self._k_eq_v):
                yield ".".join(parts[:4] + ["v_proj"] + parts[5:]), None, t
