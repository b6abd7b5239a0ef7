"""Shared model blocks: norm, rotary embedding, MLP, paged attention layer.

Modules keep Hugging Face parameter names so a checkpoint's state dict maps 1:1
(`swaserve.weights.loader` checks that nothing is missing or unexpected).

RMSNorm, Rotary, GatedMLP and Attention run eager torch (the reference) unless `fused` is set on
them (`swaserve.ops.enable_fused_ops`), which routes them to the Triton kernels in `swaserve.ops`
and, for the projections, to one merged GEMM for q/k/v and one for gate/up (`swaserve.ops.merge`:
the per-projection weights become row views of the merged ones, so both paths share memory).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from swaserve.engine.forward_batch import ForwardBatch


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + w) (`unit_offset`), Llama by w."""

    fused = False
    # CPU float32: the float32 factor for one torch.rms_norm (swaserve/ops/cpu_prologue.py)
    cpu_scale: torch.Tensor | None = None

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from swaserve.ops.rmsnorm import rmsnorm

            return rmsnorm(x, self)
        if self.cpu_scale is not None:
            from swaserve.ops.cpu_prologue import rmsnorm

            return rmsnorm(self, x)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, x_norm: RMSNorm | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s), s) for the residual stream s = residual + x, or residual + x_norm(x) with a
    sandwich norm (Gemma); one kernel when `norm` is fused."""
    if norm.fused:
        from swaserve.ops.rmsnorm import fused_add_rmsnorm

        return fused_add_rmsnorm(x, residual, norm, x_norm)
    if norm.cpu_scale is not None:
        from swaserve.ops.cpu_prologue import add_rmsnorm as cpu_add_rmsnorm

        done = cpu_add_rmsnorm(x, residual, norm, x_norm)
        if done is not None:
            return done
    if x_norm is not None:
        x = x_norm(x)
    s = residual + x
    return norm(s), s


def _rope_params(config: Any, layer_type: str | None) -> dict:
    """The rope settings of one layer kind, from transformers v5 `rope_parameters` (possibly
    keyed by layer type) or the v4 `rope_theta` / `rope_scaling` fields."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and layer_type in rp and isinstance(rp[layer_type], dict):
        return dict(rp[layer_type])
    if isinstance(rp, dict) and "rope_theta" in rp:
        return dict(rp)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def rope_inv_freq(config: Any, head_dim: int, layer_type: str | None) -> torch.Tensor:
    """Inverse frequencies for rotary embedding: default, linear, llama3, yarn (which also
    scales cos/sin: `rope_attention_scaling`) and proportional (Gemma 4)."""
    p = _rope_params(config, layer_type)
    base = float(p["rope_theta"])
    if p.get("rope_type") == "proportional":  # Gemma 4's full layers
        return _proportional_inv_freq(p, head_dim, base)
    # transformers v5 keeps the partial factor in rope_parameters, v4 on the config
    dim = int(head_dim * p.get("partial_rotary_factor",
                               getattr(config, "partial_rotary_factor", 1.0)))
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / (base ** (steps / dim))
    kind = p.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(p["factor"])
    elif kind == "llama3":
        factor = float(p["factor"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_len = float(p["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, p, dim, base, _yarn_factor(config, p))
    elif kind != "default":
        raise ValueError(
            f"unsupported rope_type {kind!r} "
            "(supported: default, linear, llama3, yarn, proportional)"
        )
    return inv


def _proportional_inv_freq(p: dict, head_dim: int, base: float) -> torch.Tensor:
    """Proportional rope (Gemma 4): the first `partial_rotary_factor x head_dim / 2` pairs turn
    at `base^(-2i / head_dim)` (exponents over the whole head, unlike partial rotary), the
    other pairs not at all (frequency 0: cos 1, sin 0, exactly the identity); all over
    `factor`. The table spans the whole head, so the rotation is a plain rotate_half one."""
    angles = int(float(p.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    steps = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float()
    inv = torch.cat((1.0 / (base ** (steps / head_dim)),
                     torch.zeros(head_dim // 2 - angles, device="cpu")))
    return inv / float(p.get("factor", 1.0))


def _yarn_factor(config: Any, p: dict) -> float:
    factor = p.get("factor")
    if factor is None:  # as transformers: DeepSeek-style configs give the ratio implicitly
        factor = config.max_position_embeddings / p["original_max_position_embeddings"]
    return float(factor)


def _yarn_inv_freq(
    inv: torch.Tensor, p: dict, dim: int, base: float, factor: float
) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: dims that turn more than `beta_fast`
    times over the original context keep their frequency, those under `beta_slow` turns are
    interpolated (divided by `factor`), a linear ramp in between."""
    old_len = float(p["original_max_position_embeddings"])
    beta_fast, beta_slow = p.get("beta_fast") or 32.0, p.get("beta_slow") or 1.0

    def dim_of(turns: float) -> float:  # the dim whose wavelength fits `turns` times in old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero division
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    return (inv / factor) * (1 - keep) + inv * keep


def rope_attention_scaling(config: Any, layer_type: str | None) -> float:
    """The factor transformers multiplies cos and sin by: 1 except for yarn, where it is
    `attention_factor` or, by default, 0.1 ln(factor) + 1 (DeepSeek's mscale ratio when
    `mscale` and `mscale_all_dim` are given)."""
    p = _rope_params(config, layer_type)
    if p.get("rope_type", "default") != "yarn":
        return 1.0
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = _yarn_factor(config, p)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return mscale(p["mscale"]) / mscale(p["mscale_all_dim"])
    return mscale()


class Rotary(nn.Module):
    """Neox-style rotary embedding (rotate_half), as Hugging Face applies it, with cos and sin
    multiplied by `attention_scaling` in float32 (YaRN's mscale; 1 otherwise). The fused path
    rotates q and k in place."""

    fused = False

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.attention_scaling = attention_scaling
        # Kept on the host in float32: the loader builds models on the meta device and restores
        # this buffer after materialising (`restore_buffers`), never in a low-precision dtype.
        self.inv_freq_host = inv_freq.float().cpu()
        # layers whose rotary has the same key share one cos/sin table a step on the CPU path
        self.table_key = (self.inv_freq_host.numpy().tobytes(), attention_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def restore_buffers(self, device: torch.device) -> None:
        self.inv_freq = self.inv_freq_host.to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            from swaserve.ops.rotary import apply_rotary

            return apply_rotary(positions, q, k, self.inv_freq, scale=self.attention_scaling)
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        cos = cos.to(q.dtype)[:, None, :]
        sin = sin.to(q.dtype)[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    out = xr * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, xp), dim=-1) if xp.numel() else out


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    fused = False
    # [2 I, hidden] (and [2 I]) on the fused path; gate_proj/up_proj parameters are row views.
    gate_up_weight: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None

    def __init__(self, hidden: int, inter: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        self.act_name = act
        self.act = ACTIVATIONS[act]
        # gate|up as one GEMM with the weights packed for the CPU (swaserve/ops/cpu_pack.py);
        # gate_proj and up_proj are then removed.
        self.gate_up_proj: nn.Module | None = None
        # or act(gate) * up in one module (cpu_gated.PackedGatedProj: oneDNN post-ops)
        self.gated_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated_proj is not None:
            return self.down_proj(self.gated_proj(x))
        if self.gate_up_proj is not None:  # CPU-packed or fp8 (ops/fp8_linear.py)
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            if self.fused:
                from swaserve.ops.activation import act_and_mul

                return self.down_proj(act_and_mul(gate, up, self.act_name))
            return self.down_proj(self.act(gate) * up)
        if self.fused:
            from swaserve.ops.activation import act_and_mul

            gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
            return self.down_proj(act_and_mul(gate, up, self.act_name))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend needs to know about one attention layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None = None  # query q sees key k iff q - window < k <= q
    softcap: float | None = None


def attention_spec(
    config: Any, layer_id: int, window: int | None, scale: float | None = None, **extra: Any
) -> AttentionSpec:
    """The spec of layer `layer_id` from a Hugging Face config: its heads, head size (`head_dim`
    or hidden / heads) and window; the scale defaults to 1 / sqrt(head_dim)."""
    hd = head_dim_of(config)
    return AttentionSpec(
        layer_id=layer_id,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=hd,
        scale=hd**-0.5 if scale is None else scale,
        window=window,
        **extra,
    )


class Attention(nn.Module):
    """q/k/v/o projections, optional per-head q/k norms, rotary, then the paged backend."""

    fused = False
    # [(H + 2 Hkv) D, hidden] (and bias) on the fused path; q/k/v_proj parameters are row views.
    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    # CPU float32 (swaserve/ops/cpu_prologue.py): q/k norms and rotary in a few ops, with the
    # q and k norm factors stacked per head
    cpu_prologue = False
    cpu_qk_scale: torch.Tensor | None = None
    qk_norm_whole = False  # q/k norms over the whole projections (OLMo 2/3): see __init__
    # V's own norm, `[T, Hkv, D] -> [T, Hkv, D]`, before the store (Gemma 4: no scale)
    v_norm: Any = None

    def __init__(
        self,
        spec: AttentionSpec,
        hidden: int,
        rotary: Rotary,
        bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_unit_offset: bool = False,
        sinks: bool = False,
        o_bias: bool | None = None,
        qk_norm_whole: bool = False,
    ) -> None:
        """`bias`: q/k/v (and o, unless `o_bias` says otherwise: Qwen2 biases q/k/v only).
        `qk_norm_whole`: the q/k norms span the whole q and k projections (OLMo 2/3), not each
        head; they run on the flat projections before anything else (never in a prologue)."""
        super().__init__()
        self.spec = spec
        h, kvh, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(hidden, h * d, bias=bias)
        self.k_proj = nn.Linear(hidden, kvh * d, bias=bias)
        self.v_proj = nn.Linear(hidden, kvh * d, bias=bias)
        self.o_proj = nn.Linear(h * d, hidden, bias=bias if o_bias is None else o_bias)
        self.qk_norm_whole = qk_norm_whole and qk_norm_eps is not None
        if qk_norm_eps is not None:
            qd, kd = (h * d, kvh * d) if self.qk_norm_whole else (d, d)
            self.q_norm = RMSNorm(qd, qk_norm_eps, qk_norm_unit_offset)
            self.k_norm = RMSNorm(kd, qk_norm_eps, qk_norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(h)) if sinks else None
        self.rotary = rotary
        self._prologue = None  # QKPrologue, built on first use (`prologue`)
        # q|k|v as one GEMM with the weights packed for the CPU (swaserve/ops/cpu_pack.py);
        # q_proj, k_proj and v_proj are then removed.
        self.qkv_proj: nn.Module | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.qkv_proj is not None:
            return self.o_proj(self.attend(positions, self.qkv_proj(x), fb))
        if self.fused:
            return self.o_proj(
                self.attend(positions, F.linear(x, self.qkv_weight, self.qkv_bias), fb)
            )
        return self.o_proj(
            self._attend(positions, self.q_proj(x), self.k_proj(x), self.v_proj(x), fb)
        )

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch, kv_stored: bool = False
    ) -> torch.Tensor:
        """The attention output `[T, H D]`, before o_proj, from one merged q|k|v projection
        output (q, k, v are strided views of it). `kv_stored`: the projection already rotated
        q and k and stored k and v (the GEMV's `RopeStore`, `gemv_rope_store`)."""
        s = self.spec
        kv_dim = s.num_kv_heads * s.head_dim
        if self.cpu_prologue and not kv_stored:
            from swaserve.ops.cpu_prologue import qk_prologue

            q, k = qk_prologue(self, qkv, fb)
            v = qkv[:, qkv.shape[1] - kv_dim :].view(-1, s.num_kv_heads, s.head_dim)
            if self.v_norm is not None:
                v = self.v_norm(v)
            out = fb.backend.forward(q, k, v, s, self.sinks, fb)
            return out.reshape(q.shape[0], s.num_heads * s.head_dim)
        q, k, v = qkv.split([s.num_heads * s.head_dim, kv_dim, kv_dim], dim=-1)
        return self._attend(positions, q, k, v, fb, kv_stored)

    def _attend(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        fb: ForwardBatch, kv_stored: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        t = q.shape[0]
        s = self.spec
        if self.qk_norm_whole and not kv_stored:  # over all heads: before the head views
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, s.num_heads, s.head_dim)
        k = k.view(t, s.num_kv_heads, s.head_dim)
        v = v.view(t, s.num_kv_heads, s.head_dim)
        if self.v_norm is not None and not kv_stored:
            v = self.v_norm(v)
        prologue = None if kv_stored else self.prologue(fb.backend)
        if prologue is None and not kv_stored:
            if self.q_norm is not None and not self.qk_norm_whole:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        out = fb.backend.forward(q, k, v, s, self.sinks, fb, prologue=prologue,
                                 kv_stored=kv_stored)  # fmt: skip
        return out.reshape(t, s.num_heads * s.head_dim)

    def gemv_rope_store(self, positions: torch.Tensor, fb: ForwardBatch, block_n: int) -> Any:
        """The prologue for the q/k/v GEMV to finish (`swaserve.ops.gemv.RopeStore`), or None
        where it cannot: q/k norms (they need whole heads), partial rotary, a backend without
        the fused prologue, a tile of `block_n` columns that cannot own rotary half-tiles, or
        SWASERVE_GEMV_ROPE=0 (A/B runs)."""
        from swaserve.ops.gemv import RopeStore, rope_store_fits

        s = self.spec
        if (
            self.q_norm is not None
            or self.prologue(fb.backend) is None
            or not hasattr(fb.backend, "kv_destination")
            or not rope_store_fits(s.head_dim, self.rotary.inv_freq.shape[0], block_n)
            or os.environ.get("SWASERVE_GEMV_ROPE") == "0"
        ):
            return None
        k_cache, v_cache, slots, k_scale, v_scale = fb.backend.kv_destination(s.layer_id, fb)
        return RopeStore(
            positions, self.rotary.inv_freq, self.rotary.attention_scaling, slots, k_cache,
            v_cache, k_scale, v_scale, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
            s.head_dim,
        )

    def prologue(self, backend: object) -> Any:
        """The q/k norms and rotary for `backend` to apply, fused with its K/V store (one
        launch, swaserve/attention/kernels/rope_store.py), on the fused path of a backend that
        can; None: this module applies them itself (eager torch, or their own kernels)."""
        if not (self.fused and getattr(backend, "fuses_qk_prologue", False)):
            return None
        if self._prologue is None:
            from swaserve.attention.kernels.rope_store import QKPrologue

            if self.qk_norm_whole:  # already applied by `_attend`: rotary and the store only
                self._prologue = QKPrologue(self.rotary)
            else:
                self._prologue = QKPrologue(self.rotary, self.q_norm, self.k_norm)
        return self._prologue


def layer_windows(config: Any) -> list[int | None]:
    """Per layer: None for full attention, else the sliding window (from `layer_types`,
    or `sliding_window` on every layer for Mistral-style configs)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:  # SmolLM3, Qwen2: windows off
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    if window and getattr(config, "use_sliding_window", True):
        return [window] * n
    return [None] * n


def layer_type_names(config: Any) -> list[str]:
    return ["full_attention" if w is None else "sliding_attention" for w in layer_windows(config)]


def pool_row_shape(config: Any, layout: Any, tp_size: int = 1) -> tuple[int, int]:
    """(kv_heads, head_dim) of the KV pool's rows: one unit where the layers' shapes differ
    (`GroupLayout.kv_shapes`, read without the config's global per-layer fields, which
    transformers warns about), else the model's K/V head shape (this rank's heads under TP)."""
    if layout.kv_shapes is not None:
        return layout.row_shape(0, 0)
    from swaserve.distributed.layers import kv_heads_per_rank

    return kv_heads_per_rank(config.num_key_value_heads, tp_size), head_dim_of(config)


def drafter_layers(cfg: Any, config: Any, tp: Any = None) -> tuple[list, Any, Any]:
    """(windows, K/V shape, the target's one K/V shape as a thunk) of a DFlash drafter's pool
    layers (`cfg`: its DFlashConfig, or None: no drafter) for `memory.groups.model_layout`;
    shapes per rank under TP (`tp`)."""
    if cfg is None:
        return [], None, None
    from swaserve.distributed.layers import kv_heads_per_rank

    size = 1 if tp is None else tp.size
    shape = (kv_heads_per_rank(cfg.num_kv_heads, size), cfg.head_dim)
    return list(cfg.layer_windows), shape, lambda: (
        kv_heads_per_rank(config.num_key_value_heads, size), head_dim_of(config))


def head_dim_of(config: Any) -> int:
    hd = getattr(config, "head_dim", None)
    return hd if hd else config.hidden_size // config.num_attention_heads


def residual_stack(
    layers: nn.ModuleList,
    norm: nn.Module,
    h: torch.Tensor,
    fb: ForwardBatch,
    method: str = "forward",
) -> torch.Tensor:
    """Layers that each map the residual stream to the next (`layer.<method>(positions, h, fb)`,
    no normed copy between them), then the final norm; the hidden states DFlash reads are kept
    per layer as they come (`fb.keep`). Returns the normed output."""
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        h = getattr(layer, method)(fb.positions, h, fb)
        if fb.keep_layers and i != last:
            fb.keep(i, h, h, False)
    x = norm(h)
    if fb.keep_layers:
        fb.keep(last, h, x, True)
    return x


def head_module(model: nn.Module) -> nn.Module:
    """The module holding `model`'s vocabulary head: the tied embedding table or lm_head."""
    return model.model.embed_tokens if model.tie_word_embeddings else model.lm_head


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The raw logits (no soft-capping) of `model`'s head (`head_module`), which may hold its
    weight packed for the CPU (swaserve/ops/cpu_pack.py)."""
    head = head_module(model)
    packed = getattr(head, "packed", None)
    if packed is not None:
        return packed.linear(hidden)
    return F.linear(hidden, head.weight)
