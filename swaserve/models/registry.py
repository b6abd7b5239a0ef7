"""Lazy registry: Hugging Face `architectures` name -> model class (imported on first use)."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("swaserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("swaserve.models.mistral", "MistralForCausalLM"),
    # Ministral: Mistral with per-layer `layer_types` (read by blocks.layer_windows)
    "MinistralForCausalLM": ("swaserve.models.mistral", "MistralForCausalLM"),
    "Phi3ForCausalLM": ("swaserve.models.phi3", "Phi3ForCausalLM"),
    # SmolLM3: the Llama layer, every `no_rope_layers`-marked layer without rotary (llama.py)
    "SmolLM3ForCausalLM": ("swaserve.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("swaserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("swaserve.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("swaserve.models.gemma3", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("swaserve.models.gemma3", "Gemma3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("swaserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("swaserve.models.gpt_oss", "GptOssForCausalLM"),
    # Cohere2 (Command R7B, Command A): parallel attention + MLP, sliding layers rotated
    "Cohere2ForCausalLM": ("swaserve.models.cohere2", "Cohere2ForCausalLM"),
    # post-norm layers (norm after attention and after the MLP): OLMo 2/3, EXAONE 4
    "Olmo2ForCausalLM": ("swaserve.models.olmo", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("swaserve.models.olmo", "Olmo3ForCausalLM"),
    "Exaone4ForCausalLM": ("swaserve.models.olmo", "Exaone4ForCausalLM"),
    # CWM (Meta's Code World Model): the Llama layer without biases, sliding and full
    # `layer_types`, llama3 rope; nothing of its own to map
    "CwmForCausalLM": ("swaserve.models.llama", "LlamaForCausalLM"),
    # Granite 3.x: Llama with muP multipliers; GraniteSWA adds sliding layers and sinks
    "GraniteForCausalLM": ("swaserve.models.granite", "GraniteForCausalLM"),
    "GraniteSWAForCausalLM": ("swaserve.models.granite", "GraniteSWAForCausalLM"),
    # Gemma 4 (dense): per-kind head sizes, KV sharing, per-layer embeddings; the multimodal
    # checkpoint serves its text model
    "Gemma4ForCausalLM": ("swaserve.models.gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("swaserve.models.gemma4", "Gemma4ForCausalLM"),
    # VaultGemma: Gemma 2 without post-norms
    "VaultGemmaForCausalLM": ("swaserve.models.gemma3", "VaultGemmaForCausalLM"),
}
# Text-only configs saved without `architectures` still name their model_type.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "cwm": "CwmForCausalLM",
    "granite": "GraniteForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "vaultgemma": "VaultGemmaForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(config: object) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    mt = _MODEL_TYPES.get(getattr(config, "model_type", ""))
    for name in archs + ([mt] if mt else []):
        if name in _MODELS:
            module, cls = _MODELS[name]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"unsupported architecture {archs or getattr(config, 'model_type', None)}; "
        f"supported: {', '.join(supported_architectures())}"
    )
