"""KV pool sizing on CUDA from a profiling pass (`--gpu-memory-utilization`), as vLLM does.

With the weights loaded and no KV pool yet, one forward of the largest step the scheduler can
build (`max_num_batched_tokens` prompt tokens, over a scratch pool just big enough) plus the
logits and sampling temporaries of `max_num_seqs` rows gives the activation peak. Then

    kv_bytes = total * utilization - weights - activation peak - memory outside torch - reserve

where "outside torch" is what the device uses beyond PyTorch's allocator (CUDA context,
cuBLAS workspaces, other processes) and `reserve` covers the decode CUDA graphs' private
pool and split-KV scratch, which are allocated after the pool, plus, with piecewise graphs,
their private pool: the activations of the largest step once more (the graphs keep their own
copy of that memory; eager work beside them still uses the allocator's). The numbers are
logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swaserve.attention.base import AttentionBackend, AttentionInputs
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import GroupLayout
from swaserve.memory.kv_pool import KVPool

log = logging.getLogger(__name__)
# decode graphs' pool and split-KV partials, beyond logits; the mixed graphs' pool too (their
# logits are [<= 65, vocab], their partials at most MAX_SPLIT_BYTES, activations of <= 256 rows)
GRAPH_RESERVE_BYTES = 512 * 2**20


@dataclass
class MemoryProfile:
    total: int
    weights: int
    activation_peak: int
    outside_torch: int
    reserve: int
    kv_bytes: int

    def describe(self) -> str:
        gb = 2**30
        return (
            f"total {self.total / gb:.1f} GiB: weights {self.weights / gb:.2f}, activation peak "
            f"{self.activation_peak / gb:.2f}, outside torch {self.outside_torch / gb:.2f}, "
            f"reserve {self.reserve / gb:.2f} -> KV {self.kv_bytes / gb:.2f} GiB"
        )


@torch.inference_mode()
def profile_kv_bytes(
    model: nn.Module,
    backend: AttentionBackend,
    layout: GroupLayout,
    page_size: int,
    kv_shape: tuple[int, int],  # (num_kv_heads, head_dim)
    kv_dtype: torch.dtype,
    num_tokens: int,
    num_seqs: int,
    vocab_size: int,
    utilization: float,
    device: torch.device,
    piecewise: bool = False,
) -> MemoryProfile:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)

    pages_per_group = math.ceil(num_tokens / page_size)
    scratch = KVPool(
        layout, 1 + pages_per_group * layout.num_groups, page_size, *kv_shape, kv_dtype, device
    )
    table = [
        list(range(1 + g * pages_per_group, 1 + (g + 1) * pages_per_group))
        for g in range(layout.num_groups)
    ]
    inputs = AttentionInputs(query_lens=[num_tokens], context_lens=[0], page_tables=[table])
    fb = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.arange(num_tokens, dtype=torch.int64, device=device),
        backend=backend,
        metadata=backend.prepare(inputs),
        kv=scratch,
    )
    hidden = model(fb)
    rows = min(num_seqs, num_tokens)
    logits = model.compute_logits(hidden[-rows:]).float()
    # Sampling temporaries: softmax, a sorted copy and its indices for top-p, per row.
    probs = torch.softmax(logits, dim=-1)
    _sorted = torch.sort(probs, dim=-1)
    torch.cuda.synchronize(device)
    scratch_bytes = scratch.kv.numel() * kv_dtype.itemsize
    peak = torch.cuda.max_memory_allocated(device) - weights - scratch_bytes
    del fb, hidden, logits, probs, _sorted, scratch
    torch.cuda.empty_cache()

    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, (total - free) - torch.cuda.memory_reserved(device))
    reserve = GRAPH_RESERVE_BYTES + 2 * num_seqs * vocab_size * 4 + (peak if piecewise else 0)
    kv = int(total * utilization - weights - peak - outside - reserve)
    profile = MemoryProfile(total, weights, peak, outside, reserve, max(0, kv))
    log.info("memory profile: %s", profile.describe())
    if kv <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache ({profile.describe()}); raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, or "
            "give --kv-cache-gb"
        )
    return profile


def graph_memory_error(
    weights: int, kv_bytes: int, total: int, config: Any, mixed_tokens: int, piecewise_tokens: int
) -> torch.OutOfMemoryError:
    """What to raise when CUDA graph capture runs out of memory at start: the weights and the
    pool take most of the device (`total` bytes) and the graphs' buffers (the largest decode
    batch's logits, the piecewise graphs' activations) do not fit beside them. An explicit
    --kv-cache-gb skips the profile that leaves room for them; the message names the numbers
    and the flags."""
    gb = 2**30
    pool = (f"--kv-cache-gb {config.kv_cache_gb:g}" if config.kv_cache_gb is not None
            else f"--gpu-memory-utilization {config.gpu_memory_utilization:g}")  # fmt: skip
    return torch.OutOfMemoryError(
        f"out of GPU memory capturing CUDA graphs: the weights ({weights / gb:.1f} GiB) and the "
        f"KV pool ({kv_bytes / gb:.1f} GiB, {pool}) leave {(total - weights - kv_bytes) / gb:.1f}"
        f" of {total / gb:.1f} GiB for activations and the graphs (decode batches up to "
        f"{config.cuda_graph_max_bs}, mixed steps up to {mixed_tokens} tokens, piecewise steps "
        f"up to {piecewise_tokens}). Give the pool less (--kv-cache-gb, "
        f"--gpu-memory-utilization), capture fewer graphs (--cuda-graph-max-bs, "
        f"--max-num-seqs), or run without them (--enforce-eager)"
    )
