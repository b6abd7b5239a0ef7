"""EngineConfig: one dataclass for every knob, from CLI flags or `Engine(**kwargs)` (DESIGN §11)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    load_format: str = "auto"  # auto | dummy
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float = 0.85
    kv_cache_dtype: str = "auto"  # auto | fp8_e4m3
    kv_cache_scale: float | None = None  # fp8: one given scale for every layer; None: calibrate
    attention_backend: str | None = None  # torch | triton; None: triton on CUDA, torch else
    disable_prefix_cache: bool = False
    host_cache_gb: float = 0.0
    host_cache_policy: str = "write_back"
    disk_cache_dir: str | None = None
    disk_cache_gb: float | None = None  # default: min(16 GiB, half the directory's free space)
    # Every layer keeps a full-length KV (the baseline the window-aware pool is measured
    # against); attention still uses each layer's window, so outputs do not change.
    disable_hybrid_kv_cache: bool = False
    # Schedule and launch step N+1 before reading step N's sampled tokens back (see core.py).
    disable_overlap_schedule: bool = False
    # Triton RMSNorm / rotary / activation kernels on CUDA (eager torch elsewhere).
    disable_fused_ops: bool = False
    cuda_graph_max_bs: int = 128  # CUDA only; 0 disables
    chat_template: str | None = None
    seed: int = 0
    max_queue: int = 1024
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            flag = "--" + name.replace("_", "-")
            return ValueError(f"invalid {flag} {getattr(self, name)!r} ({name}): {why}")

        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be >= 1")
        if self.page_size < 1:
            raise bad("page_size", "must be >= 1")
        if self.load_format not in ("auto", "dummy"):
            raise bad("load_format", "must be auto or dummy")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise bad("kv_cache_dtype", "must be auto or fp8_e4m3")
        if self.attention_backend not in (None, "torch", "triton"):
            raise bad("attention_backend", "must be torch or triton")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise bad("dtype", "must be auto, float32, bfloat16 or float16")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise bad("kv_cache_gb", "must be > 0")
        if self.disk_cache_gb is not None and self.disk_cache_gb <= 0:
            raise bad("disk_cache_gb", "must be > 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad("max_model_len", "must be >= 1")
        self._check_device()

    def _check_device(self) -> None:
        """--device names a device this torch can use: a ValueError now, not a traceback
        after the weights load."""
        if self.device == "auto":
            return
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"invalid --device {self.device!r}: must be auto, cpu, cuda or cuda:N"
            ) from None
        if dev.type != "cuda":
            return
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {self.device}: no CUDA device is available to this torch "
                f"({torch.__version__}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"--device {self.device}: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def backend_name(self) -> str:
        if self.attention_backend:
            return self.attention_backend
        return "triton" if self.torch_device().type == "cuda" else "torch"
