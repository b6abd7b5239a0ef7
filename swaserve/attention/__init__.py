"""Attention backends, behind a lazy registry so optional kernels cost nothing at import."""

from __future__ import annotations

import importlib

_BACKENDS = {
    "cpu": ("swaserve.attention.cpu_backend", "CpuBackend"),
    "torch": ("swaserve.attention.torch_backend", "TorchBackend"),
    "triton": ("swaserve.attention.triton_backend", "TritonBackend"),
}


def backend_class(name: str) -> type:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)
