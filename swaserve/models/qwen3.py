"""Qwen3 (dense): the Llama layer plus per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

from swaserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
