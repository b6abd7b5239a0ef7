"""GPU only: the KV pool is sized by the profiling pass (`gpu_memory_utilization`)."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers

from swaserve import Engine, SamplingParams
from swaserve.engine.memory_profile import profile_kv_bytes
from tests.helpers import save_random_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_pool_follows_utilization(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=4096,
    )
    save_random_hf_model(cfg, tmp_path)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    used_before = total - free  # this process and any other on the device
    eng = Engine(model=str(tmp_path), gpu_memory_utilization=0.5, cuda_graph_max_bs=8)
    kv_bytes = eng.core.kv.kv.numel() * eng.core.kv.kv.element_size()
    # The pool takes the share left after what was in use, the tiny weights, activations and
    # the reserve (well under 3 GiB here).
    assert 0.5 * total - used_before - 3 * 2**30 < kv_bytes < 0.5 * total - used_before
    out = eng.generate(prompt_token_ids=[[5] * 50], sampling_params=SamplingParams(
        max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4
    del eng
    gc.collect()
    torch.cuda.empty_cache()


def test_profile_counts_the_activation_peak():
    from swaserve.attention.triton_backend import TritonBackend
    from swaserve.memory.groups import build_layout
    from swaserve.weights.loader import build_model

    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=2048, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_hidden_layers=2, max_position_embeddings=8192,
    )
    dev = torch.device("cuda")
    model = build_model(cfg, None, torch.bfloat16, dev, True, 0)
    layout = build_layout([None, None])
    backend = TritonBackend(layout, 16, dev)
    small, big = (
        profile_kv_bytes(model, backend, layout, 16, (2, 64), torch.bfloat16, n, 8, 1024, 0.5,
                         dev)
        for n in (256, 8192)
    )
    assert big.activation_peak > small.activation_peak > 0
    assert big.kv_bytes < small.kv_bytes
