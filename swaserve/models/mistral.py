"""Mistral-style: the Llama layer with `sliding_window` on every layer (when set).

The window itself is read by `blocks.layer_windows`, so this class only names the architecture.
"""

from __future__ import annotations

from swaserve.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
