"""A DFlash drafter's config.json, read as the reference (`dflash` on PyPI, z-lab) reads it and
checked against its target's config (docs/architecture.md, Speculative decoding).

The drafter is a few Qwen3 decoder layers, so config.json is parsed by transformers'
`Qwen3Config`, as the reference parses it: a field the file omits takes Qwen3's default
(`save_pretrained` omits fields equal to it). On top of that the DFlash fields:

    block_size, mask_token_id, target_layer_ids,      dflash_config[name], else the top-level
    input_embedding_scale, output_multiplier,         field, else the default (block_size 16,
    final_logit_softcapping                           scales 1.0, softcap off)
    target_layer_ids, neither given                   build_target_layer_ids(num_target_layers,
                                                      num draft layers)
    layer_types, sliding_window, is_causal            top level only (Qwen3Config's rules)

A layer is causal iff it is sliding, unless a top-level `is_causal` sets every layer. Every
problem is a ValueError naming the file and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURE = "DFlashDraftModel"
_SUPPORTED_ROPE = ("default", "linear", "llama3")  # swaserve.models.blocks.rope_inv_freq
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")  # swaserve.models.blocks.ACTIVATIONS


@dataclass(frozen=True)
class DFlashConfig:
    block_size: int  # tokens per drafter forward: [last committed, mask x (block_size - 1)]
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target layer i's output (HF hidden_states[i + 1])
    num_layers: int  # draft decoder layers
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_act: str
    attention_bias: bool
    rms_norm_eps: float
    vocab_size: int
    rope_parameters: tuple[tuple[str, Any], ...]  # sorted items; dict(...) for rope_inv_freq
    layer_windows: tuple[int | None, ...]  # per layer: None (full) or the sliding window
    layer_causal: tuple[bool, ...]  # per layer: causal inside the block
    input_embedding_scale: float = 1.0  # block embeddings = raw target embedding * this
    output_multiplier: float = 1.0  # draft logits = target head(hidden) * this ...
    final_logit_softcapping: float | None = None  # ... then cap * tanh(logits / cap)

    @property
    def default_num_draft_tokens(self) -> int:
        return self.block_size - 1


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's default: the middle layer for one draft layer, else `num_draft_layers`
    ids spread evenly (rounded half to even, as Python rounds) over [1, num_target_layers - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [
        round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    ]


def load_dflash_config(folder: str | Path, target_config: Any) -> DFlashConfig:
    """Read `folder/config.json` and check it against the target's HF config."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"DFlash drafter folder {folder} does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"DFlash drafter folder {folder} has no config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return dflash_config_from_dict(raw, target_config, source=str(path))


def dflash_config_from_dict(
    raw: dict[str, Any], target_config: Any, source: str = "config.json"
) -> DFlashConfig:
    """The checks of `load_dflash_config` on an already parsed config.json."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{source}: {field} {why}")

    _check_architecture(raw, bad)
    qwen = _qwen3_config(raw, bad)
    dflash = raw.get("dflash_config") or {}
    if not isinstance(dflash, dict):
        raise bad("dflash_config", f"must be an object, got {dflash!r}")

    def value(name: str, default: Any = None) -> Any:
        return dflash.get(name, raw.get(name, default))

    target = getattr(target_config, "text_config", None) or target_config
    n_target = int(target.num_hidden_layers)
    layer_ids = _target_layer_ids(value("target_layer_ids"), raw, qwen, n_target, bad)
    block_size = value("block_size", 16)
    if not isinstance(block_size, int) or block_size < 2:
        raise bad("block_size", f"must be an integer >= 2 (one draft at least), got {block_size}")
    mask = value("mask_token_id")
    if not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise bad(
            "mask_token_id",
            f"{mask!r} is not a token id of the target (vocab_size {target.vocab_size})",
        )
    if qwen.hidden_size != target.hidden_size:
        raise bad(
            "hidden_size",
            f"{qwen.hidden_size} does not fit the target's hidden_size "
            f"{target.hidden_size} (the drafter reads its embeddings and hidden states)",
        )
    if qwen.vocab_size != target.vocab_size:
        raise bad(
            "vocab_size",
            f"{qwen.vocab_size} != the target's vocab_size "
            f"{target.vocab_size} (the drafter uses the target's head)",
        )
    softcap = value("final_logit_softcapping")
    return DFlashConfig(
        block_size=block_size,
        mask_token_id=mask,
        target_layer_ids=tuple(layer_ids),
        num_layers=qwen.num_hidden_layers,
        hidden_size=qwen.hidden_size,
        intermediate_size=qwen.intermediate_size,
        num_heads=qwen.num_attention_heads,
        num_kv_heads=qwen.num_key_value_heads,
        head_dim=qwen.head_dim or qwen.hidden_size // qwen.num_attention_heads,
        hidden_act=qwen.hidden_act,
        attention_bias=bool(qwen.attention_bias),
        rms_norm_eps=float(qwen.rms_norm_eps),
        vocab_size=qwen.vocab_size,
        rope_parameters=tuple(sorted(qwen.rope_parameters.items())),
        layer_windows=_layer_windows(qwen, bad),
        layer_causal=_layer_causal(raw, qwen),
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        output_multiplier=float(value("output_multiplier", 1.0)),
        # The reference caps only with a positive value.
        final_logit_softcapping=float(softcap) if softcap and float(softcap) > 0 else None,
    )


def check_num_draft_tokens(k: int | None, cfg: DFlashConfig) -> int:
    """`--speculative-num-draft-tokens` for this drafter: None gives block_size - 1; a value
    outside 1..block_size - 1 is a ValueError."""
    if k is None:
        return cfg.default_num_draft_tokens
    if not 1 <= k <= cfg.block_size - 1:
        raise ValueError(
            f"invalid --speculative-num-draft-tokens {k} (speculative_num_draft_tokens): "
            f"the DFlash drafter drafts 1..{cfg.block_size - 1} tokens "
            f"(block_size {cfg.block_size} - 1)"
        )
    return k


def _check_architecture(raw: dict[str, Any], bad) -> None:
    archs = raw.get("architectures") or []
    if "DFlash2DraftModel" in archs:
        raise bad("architectures", "DFlash2DraftModel: DFlash2 checkpoints are not supported")
    if archs != [ARCHITECTURE]:
        raise bad(
            "architectures", f"{archs!r} is not a DFlash drafter (expected [{ARCHITECTURE!r}])"
        )


def _qwen3_config(raw: dict[str, Any], bad) -> Any:
    from transformers import Qwen3Config

    try:
        qwen = Qwen3Config.from_dict(raw)
    except Exception as e:  # huggingface_hub's strict-dataclass errors are no ValueError
        raise bad("(Qwen3 fields)", f"are not a valid Qwen3 config: {e}") from e
    if min(qwen.num_attention_heads, qwen.num_key_value_heads, qwen.num_hidden_layers) < 1:
        raise bad("num_attention_heads", "num_key_value_heads and num_hidden_layers must be >= 1")
    if qwen.num_attention_heads % qwen.num_key_value_heads:
        raise bad(
            "num_key_value_heads",
            f"{qwen.num_key_value_heads} does not divide "
            f"num_attention_heads {qwen.num_attention_heads}",
        )
    rope_type = qwen.rope_parameters.get("rope_type", "default")
    if rope_type not in _SUPPORTED_ROPE:
        raise bad("rope_type", f"{rope_type!r} is not supported (supported: {_SUPPORTED_ROPE})")
    if qwen.hidden_act not in _ACTIVATIONS:
        raise bad("hidden_act", f"{qwen.hidden_act!r} is not supported ({_ACTIVATIONS})")
    return qwen


def _target_layer_ids(ids: Any, raw: dict[str, Any], qwen: Any, n_target: int, bad) -> list[int]:
    given = raw.get("num_target_layers")
    if given is not None and given != n_target:
        raise bad(
            "num_target_layers",
            f"{given} does not match the target's num_hidden_layers "
            f"{n_target} (a drafter trained for another target)",
        )
    if ids is None:
        if given is None:
            raise bad("target_layer_ids", "missing, and no num_target_layers to derive them")
        ids = build_target_layer_ids(given, qwen.num_hidden_layers)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise bad("target_layer_ids", f"must be a non-empty list of layer ids, got {ids!r}")
    out = [i for i in ids if not 0 <= i < n_target]
    if out:
        raise bad(
            "target_layer_ids", f"{ids} has ids {out} outside the target's layers 0..{n_target - 1}"
        )
    return ids


def _layer_windows(qwen: Any, bad) -> tuple[int | None, ...]:
    types = list(qwen.layer_types)
    if len(types) != qwen.num_hidden_layers:
        raise bad("layer_types", f"has {len(types)} entries for {qwen.num_hidden_layers} layers")
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise bad("layer_types", f"has unknown types {sorted(unknown)}")
    # Qwen3Config drops sliding_window unless use_sliding_window: a "sliding" layer is then
    # causal with no window, as in the reference.
    window = qwen.sliding_window
    if window is not None and window < 1:
        raise bad("sliding_window", f"must be >= 1, got {window}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _layer_causal(raw: dict[str, Any], qwen: Any) -> tuple[bool, ...]:
    forced = raw.get("is_causal")
    if forced is not None:
        return (bool(forced),) * qwen.num_hidden_layers
    return tuple(t == "sliding_attention" for t in qwen.layer_types)
