"""Qwen2 / Qwen2.5: the Llama layer with biased q/k/v projections (o has none). A config with
`use_sliding_window` slides on the layers from `max_window_layers` on (its `layer_types`, read
by `blocks.layer_windows`)."""

from __future__ import annotations

from swaserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    biased_qkv = True
