"""The DFlash drafter (block diffusion; `dflash` on PyPI, z-lab): Qwen3 decoder layers with no
embedding or head of their own, conditioned on the target's hidden states (docs/architecture.md,
Speculative decoding). Parameter names are the reference's, so its safetensors load 1:1.

One drafter forward over a request committed up to position c (its last committed token x_c
not yet run through the target):

    context  positions 0..c-1: h_p = the target's hidden states after the layers
             target_layer_ids, concatenated                             [T, n_ids * hidden]
             ctx_p = hidden_norm(fc(h_p))                               [T, hidden]
             per layer: K/V = k_norm(k_proj(ctx_p)) rotated at p, v_proj(ctx_p)
    block    positions c..c+B-1: tokens [x_c, mask x (B - 1)], embedded with the TARGET's raw
             embedding table * input_embedding_scale (not the target's own embedding scale)
             per layer: Q, K, V from the block; K/V = [context K/V ; block K/V]
    output   final norm; row i (i >= 1) is the draft for position c + i itself (not the next
             one); logits = target head(row) * output_multiplier, softcapped if set

A context K/V depends only on its own position's target hidden state, never on the block, so
an engine computes it once per committed token (`context_kv`) and keeps it like any KV
(`forward_block`). Attention is by position: a block query at q sees a key at k iff

    causal layer (sliding by default)   k <= q
    sliding layer with window W         q - k < W   (and k - q < W if not causal)

and a full non-causal layer sees every context key and the whole block. In the reference the
keys are the contiguous positions 0..c+B-1 (or a sliding layer's tail of them), so its
index-based mask is this one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from swaserve.models.blocks import GatedMLP, RMSNorm, Rotary, rope_inv_freq
from swaserve.speculative.dflash_config import DFlashConfig, load_dflash_config

if TYPE_CHECKING:
    from swaserve.distributed.parallel_state import TPGroup
    from swaserve.distributed.sharding import Shard

# SDPA backends for the drafter's masked attention. Not cuDNN: PyTorch picks it on H100/H200
# for these boolean-masked shapes and it builds a new plan for every new context width,
# ~100 ms of host time per call (measured: 42 ms per token at batch 1, against 1.1 without
# speculation); the memory-efficient kernel takes the mask as a bias at no such cost.
_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


class ContextKV(NamedTuple):
    """One draft layer's keys and values of context tokens: k rotated at `positions`."""

    k: Tensor  # [T, Hkv, D]
    v: Tensor  # [T, Hkv, D]
    positions: Tensor  # [T] int64


class BatchedContext(NamedTuple):
    """One draft layer's context K/V of R requests, padded to C: rows past a request's own
    context have `valid` False (their keys are never seen)."""

    k: Tensor  # [R, C, Hkv, D]
    v: Tensor  # [R, C, Hkv, D]
    positions: Tensor  # [R, C] int64
    valid: Tensor  # [R, C] bool


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        h, kvh, d, bias = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.window = cfg.layer_windows[layer_idx]
        self.causal = cfg.layer_causal[layer_idx]
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Normed, not yet rotated keys and values [T, Hkv, D] of inputs [T, hidden]."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        return k, self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)

    def kv(self, x: Tensor, positions: Tensor, rotary: Rotary) -> tuple[Tensor, Tensor]:
        k, v = self._keys_values(x)
        # Rotary turns q and k together; a query of zero heads turns the keys alone (and
        # never the same tensor twice, which the in-place fused path would do).
        _, k = rotary(positions, k[:, :0], k)
        return k, v

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        ctx: ContextKV,
        rotary: Rotary,
        visible: Tensor | None = None,
    ) -> Tensor:
        """`visible` [B, T_ctx + B] (training: several blocks at once) is ANDed with the
        positional rule: which context keys and which block rows each row may see at all."""
        b = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(b, self.num_heads, self.head_dim))
        k, v = self._keys_values(x)
        q, k = rotary(positions, q, k)
        k = torch.cat((ctx.k, k))
        v = torch.cat((ctx.v, v))
        mask = self.mask(positions, torch.cat((ctx.positions, positions)))
        if visible is not None:
            mask = visible if mask is None else mask & visible
        with sdpa_kernel(_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=mask,
                scale=self.head_dim**-0.5,
                enable_gqa=True,
            )
        return self.o_proj(out.transpose(0, 1).reshape(b, self.num_heads * self.head_dim))

    def forward_batched(
        self, x: Tensor, positions: Tensor, ctx: BatchedContext, rotary: Rotary
    ) -> Tensor:
        """R blocks at once: x [R, B, hidden], positions [R, B]; each block sees its own
        valid context and its own rows (the positional rule on top)."""
        r, b, _ = x.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        flat = x.reshape(r * b, -1)
        q = self.q_norm(self.q_proj(flat).view(r * b, h, d))
        k, v = self._keys_values(flat)
        q, k = rotary(positions.reshape(-1), q, k)
        keys = torch.cat((ctx.k, k.view(r, b, hkv, d)), dim=1)
        values = torch.cat((ctx.v, v.view(r, b, hkv, d)), dim=1)
        k_pos = torch.cat((ctx.positions, positions), dim=1)
        own = torch.ones(r, b, dtype=torch.bool, device=x.device)
        mask = torch.cat((ctx.valid, own), dim=1)[:, None, :].expand(r, b, -1)
        rule = self.mask(positions, k_pos)
        if rule is not None:
            mask = mask & rule
        with sdpa_kernel(_SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q.view(r, b, h, d).transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask[:, None],
                scale=d**-0.5,
                enable_gqa=True,
            )
        return self.o_proj(out.transpose(1, 2).reshape(r, b, h * d))

    def mask(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """[B, Tk] bool, True where the query sees the key (the module docstring's rule);
        None for a full non-causal layer, which sees everything."""
        if not self.causal and self.window is None:
            return None
        dist = q_pos[..., :, None] - k_pos[..., None, :]  # q - k (batched: [R, B, Tk])
        visible = dist >= 0 if self.causal else torch.ones_like(dist, dtype=torch.bool)
        if self.window is not None:
            visible &= dist < self.window
            if not self.causal:
                visible &= -dist < self.window
        return visible


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_batched(
        self, x: Tensor, positions: Tensor, ctx: BatchedContext, rotary: Rotary
    ) -> Tensor:
        x = x + self.self_attn.forward_batched(self.input_layernorm(x), positions, ctx, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        ctx: ContextKV,
        rotary: Rotary,
        visible: Tensor | None = None,
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx, rotary, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """One request's block at a time: tensors are [tokens, ...], no batch dimension."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DFlashLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # One rotary for every layer, sliding or not (the reference's single rotary_emb).
        rope = SimpleNamespace(rope_parameters=dict(cfg.rope_parameters))
        self.rotary_emb = Rotary(rope_inv_freq(rope, cfg.head_dim, None))

    def embed_block(
        self, token_ids: Tensor, target_embedding: Callable[[Tensor], Tensor] | Tensor
    ) -> Tensor:
        """Block inputs [B, hidden] from the target's raw embedding table [V, hidden] (or its
        lookup function): the reference scales by the drafter's input_embedding_scale only
        (Gemma's own sqrt(hidden) embedding scale is not applied unless the checkpoint sets it
        there)."""
        if isinstance(target_embedding, Tensor):
            rows = F.embedding(token_ids, target_embedding)
        else:
            rows = target_embedding(token_ids)
        return rows * self.cfg.input_embedding_scale

    def project_context(self, target_hidden: Tensor) -> Tensor:
        """[T, n_ids * hidden] target hidden states -> [T, hidden] drafter context."""
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(self, layer_idx: int, ctx_projected: Tensor, positions: Tensor) -> ContextKV:
        """Layer `layer_idx`'s K/V of context tokens (`project_context` output) at `positions`:
        computed once per committed token and cached by the caller."""
        k, v = self.layers[layer_idx].self_attn.kv(ctx_projected, positions, self.rotary_emb)
        return ContextKV(k, v, positions)

    def forward_block(
        self,
        block_embeds: Tensor,
        block_positions: Tensor,
        ctx_kv: Sequence[ContextKV],
        visible: Tensor | None = None,
    ) -> Tensor:
        """The block's final hidden states [B, hidden], given each layer's context K/V (all
        the context a layer may see: everything for full layers, at least the window's tail
        for sliding ones). `visible` [B, T_ctx + B]: see DFlashAttention.forward."""
        x = block_embeds
        for layer, ctx in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, block_positions, ctx, self.rotary_emb, visible)
        return self.norm(x)

    def forward_blocks(
        self, block_embeds: Tensor, block_positions: Tensor, ctx: Sequence[BatchedContext]
    ) -> Tensor:
        """R blocks' final hidden states [R, B, hidden] (`forward_block` for a batch)."""
        x = block_embeds
        for layer, c in zip(self.layers, ctx, strict=True):
            x = layer.forward_batched(x, block_positions, c, self.rotary_emb)
        return self.norm(x)

    def forward(
        self,
        target_hidden: Tensor,
        ctx_positions: Tensor,
        block_embeds: Tensor,
        block_positions: Tensor,
    ) -> Tensor:
        """Both steps at once, with no cache (tests, one-off drafts)."""
        ctx = self.project_context(target_hidden)
        kv = [self.context_kv(i, ctx, ctx_positions) for i in range(len(self.layers))]
        return self.forward_block(block_embeds, block_positions, kv)

    def compute_logits(self, hidden: Tensor, head: Callable[[Tensor], Tensor] | Tensor) -> Tensor:
        """Draft logits from the target's head (a module/function or its [V, hidden] weight)."""
        logits = F.linear(hidden, head) if isinstance(head, Tensor) else head(hidden)
        logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap is not None else logits


def load_dflash_drafter(
    folder: str | Path,
    target_config: Any,
    device: torch.device | str,
    dtype: torch.dtype,
    tp: TPGroup | None = None,
) -> DFlashDrafter:
    """The drafter in `folder` (config.json checked against the target's HF config, then its
    *.safetensors with every tensor present and none unexpected), in eval mode; with `tp`
    (size > 1) rank tp.rank's shard (distributed/layers.py, `shard_drafter`)."""
    folder = Path(folder)
    cfg = load_dflash_config(folder, target_config)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    shards: dict[str, Shard] = {}
    if tp is not None and tp.size > 1:
        from swaserve.distributed.layers import shard_drafter

        shards = shard_drafter(model, tp)
    model = model.to(dtype).to_empty(device=device)
    _load_weights(model, folder, shards)
    model.rotary_emb.restore_buffers(torch.device(device))
    return model.eval().requires_grad_(False)


def _load_weights(model: nn.Module, folder: Path, shards: dict[str, Shard]) -> None:
    """`shards`: the parameters that hold one rank's part; each checkpoint tensor has the full
    parameter's shape and is cut as it is copied."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"DFlash drafter folder {folder} has no *.safetensors weights")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # recomputed from the config
                    continue
                if name not in params:
                    raise ValueError(f"{path}: unexpected tensor {name!r} for a DFlash drafter")
                t = f.get_tensor(name)
                shard = shards.get(name)
                want = shard.full_shape if shard is not None else tuple(params[name].shape)
                if tuple(t.shape) != want:
                    raise ValueError(
                        f"{path}: tensor {name!r} has shape {tuple(t.shape)}, the config gives "
                        f"{want}"
                    )
                with torch.no_grad():
                    if shard is not None:
                        shard.copy_into(params[name].data, None, t)
                    else:
                        params[name].copy_(t)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        names = ", ".join(p.name for p in files)
        raise ValueError(
            f"{folder} ({names}): missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}"
        )
