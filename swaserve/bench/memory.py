"""Memory benchmark: how many requests of a given context fit in a KV budget, window-aware
layout vs every layer full (docs/architecture.md §3). No forward pass: requests are driven
through the real MemoryManager exactly as the scheduler would (allocate a chunk, advance, retire).

    chunk loop per request:  can_admit -> allocate -> num_computed_tokens += chunk -> retire
    a request that reaches `context` is held (as if decoding); the first request whose chunk
    does not fit ends the run, and the held count is `max_concurrent`.

`kv_cache_gb` is in GiB (2**30 bytes); the NULL page is part of the budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from swaserve.memory.groups import GroupLayout, build_layout
from swaserve.memory.manager import MemoryManager, num_pages_for_bytes, page_bytes
from swaserve.memory.pool import NULL_PAGE

GIB = 1 << 30


@dataclass
class _BenchRequest:
    request_id: str
    num_computed_tokens: int = 0


def _prefill(mgr: MemoryManager, req: _BenchRequest, context: int, chunk: int) -> bool:
    """Advance `req` to `context` computed tokens in chunks; False if a chunk does not fit."""
    while req.num_computed_tokens < context:
        n = min(chunk, context - req.num_computed_tokens)
        if not mgr.can_admit(req, n) or not mgr.allocate(req, n):
            return False
        req.num_computed_tokens += n
        mgr.retire_out_of_window([req])
    return True


def _held_pages(mgr: MemoryManager, request_id: str) -> int:
    return sum(p != NULL_PAGE for t in mgr.page_table(request_id) for p in t)


def _run_layout(
    layout: GroupLayout,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    context: int,
    budget_bytes: int,
    chunk: int,
) -> dict[str, Any]:
    pbytes = page_bytes(layout, page_size, kv_heads, head_dim, dtype_bytes)

    # Footprint of one request at full context, on a pool large enough for its peak.
    solo = MemoryManager(layout, page_size, _ceil_div(context, page_size) * layout.num_groups + 1)
    req = _BenchRequest("solo")
    assert _prefill(solo, req, context, chunk)
    pages_per_request = _held_pages(solo, "solo")

    num_pages = num_pages_for_bytes(
        layout, page_size, kv_heads, head_dim, dtype_bytes, budget_bytes
    )
    mgr = MemoryManager(layout, page_size, max(num_pages, 1))
    held = 0
    while True:
        req = _BenchRequest(f"r{held}")
        if not _prefill(mgr, req, context, chunk):
            mgr.free(req)
            break
        held += 1
    mgr.check_integrity()
    return {
        "slots_per_page": layout.slots_per_page,
        "num_groups": layout.num_groups,
        "page_bytes": pbytes,
        "num_pages": num_pages,
        "pages_per_request": pages_per_request,
        "bytes_per_request": pages_per_request * pbytes,
        "max_concurrent": held,
    }


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run_memory_bench(
    layer_windows: Sequence[int | None],
    page_size: int,
    kv_heads: int,
    head_dim: int,
    context: int,
    kv_cache_gb: float,
    chunk: int = 2048,
    dtype_bytes: int = 2,
    kv_shapes: Sequence[tuple[int, int]] | None = None,
    kv_sources: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Concurrent requests of `context` tokens in `kv_cache_gb` GiB: window-aware vs all-full
    (both with the layers' own K/V shapes and sharing where given: `build_layout`).

    `ratio` = max_concurrent / max_concurrent_all_full (None when the baseline fits none:
    the result is strict JSON);
    `ideal_ratio` = bytes_per_request_all_full / bytes_per_request."""
    if context < 1 or chunk < 1:
        raise ValueError("context and chunk must be >= 1")
    budget = int(kv_cache_gb * GIB)
    args = (page_size, kv_heads, head_dim, dtype_bytes, context, budget, chunk)
    swa = _run_layout(build_layout(layer_windows, False, kv_shapes, kv_sources), *args)
    full = _run_layout(build_layout(layer_windows, True, kv_shapes, kv_sources), *args)
    base = full["max_concurrent"]
    return {
        "bytes_per_request": swa["bytes_per_request"],
        "bytes_per_request_all_full": full["bytes_per_request"],
        "max_concurrent": swa["max_concurrent"],
        "max_concurrent_all_full": base,
        "ratio": swa["max_concurrent"] / base if base else None,
        "ideal_ratio": full["bytes_per_request"] / swa["bytes_per_request"],
        "context": context,
        "page_size": page_size,
        "chunk": chunk,
        "kv_cache_gb": kv_cache_gb,
        "layout": {
            k: v for k, v in swa.items() if k not in ("bytes_per_request", "max_concurrent")
        },
        "layout_all_full": {
            k: v for k, v in full.items() if k not in ("bytes_per_request", "max_concurrent")
        },
    }


def layer_windows_from_config(cfg: Mapping[str, Any]) -> list[int | None]:
    """Per-layer windows (None = full) from a Hugging Face config dict.

    `layer_types` ("sliding_attention" / "full_attention") wins; else Gemma's older
    `sliding_window_pattern` (every pattern-th layer full); else a `sliding_window` applies to
    every layer (Mistral) unless `use_sliding_window` is false (Qwen2); else all full."""
    cfg = {**cfg, **cfg.get("text_config", {})}
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        out: list[int | None] = []
        for t in types:
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention":
                if not window:
                    raise ValueError("sliding_attention layers but no sliding_window")
                out.append(int(window))
            else:
                raise ValueError(f"unknown layer type {t!r}")
        return out
    if not window or cfg.get("use_sliding_window") is False:
        return [None] * n
    pattern = cfg.get("sliding_window_pattern")
    if pattern:
        return [None if (i + 1) % pattern == 0 else int(window) for i in range(n)]
    return [int(window)] * n


def main_from_config(
    hf_config_dict: Mapping[str, Any], context: int, kv_cache_gb: float, page_size: int
) -> dict[str, Any]:
    """The `swaserve bench memory` numbers for a Hugging Face config dict."""
    cfg = {**hf_config_dict, **hf_config_dict.get("text_config", {})}
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    windows = layer_windows_from_config(cfg)
    shapes = sources = None
    if cfg.get("model_type") == "gemma4_text":  # per-kind K/V shapes, KV-shared layers
        from types import SimpleNamespace

        from swaserve.models.gemma4 import kv_sources, layer_attention_shape

        ns = SimpleNamespace(**cfg)
        shapes = [layer_attention_shape(ns, i) for i in range(len(windows))]
        sources = kv_sources(ns)
    result = run_memory_bench(windows, page_size, kv_heads, head_dim, context, kv_cache_gb,
                              kv_shapes=shapes, kv_sources=sources)  # fmt: skip
    result["num_swa_layers"] = sum(w is not None for w in windows)
    result["num_full_layers"] = sum(w is None for w in windows)
    return result
