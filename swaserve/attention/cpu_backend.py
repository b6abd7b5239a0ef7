"""The CPU's attention: the torch backend's semantics, read from the pool in place.

Every query row goes to the native kernel (`swaserve/ops/native/paged_attention.c`), which walks
its visible keys straight from the pages, a few rows of a chunk at a time: the torch backend
copies every key and value a step reads into fresh tensors before SDPA reads them again. Same
semantics as `TorchBackend`: windows per layer, soft-capping, sinks, a float32, bfloat16 or FP8
pool. With an FP8 pool only decodes go native: a longer chunk reads its own keys at full
precision (the torch backend's rule), which the kernel does not; those stay with torch's SDPA
(`attend_each`).

Measured on the 2-core development CPU (RESULTS.md, stop 40's session, CPU), one layer, against
`TorchBackend`: 16 decodes over ~180 keys (Gemma 3 270M's heads) 474 -> 106 us; 16 prompts of
100 tokens 7.6-12.4 -> 3.3-5.1 ms; one of 1,500 tokens 61 -> 20 ms (sliding) and 62 -> 33 ms
(full); a chunk of 256 over 1,300 cached keys is on par (10.3 against 10.7 ms; SmolLM2's
heads 7.2 against 8.8).

The default on a CPU unless `--disable-fused-ops` (the eager reference keeps `TorchBackend`);
without a C compiler (`cpu_native.library()` is None) it is `TorchBackend` whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from swaserve.attention.torch_backend import TorchBackend, TorchGroupMetadata, TorchMetadata
from swaserve.engine.forward_batch import ForwardBatch
from swaserve.memory.groups import GroupLayout
from swaserve.models.blocks import AttentionSpec
from swaserve.ops import cpu_native

if TYPE_CHECKING:
    from swaserve.attention.kernels.rope_store import QKPrologue

_MAX_GROUP = 16  # query heads a KV head serves, at most (the kernel's ROWS_MAX); more: torch
_POOL_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
_FP8_LUT = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


class CpuBackend(TorchBackend):
    def __init__(self, layout: GroupLayout, page_size: int, device: torch.device) -> None:
        super().__init__(layout, page_size, device)
        self.lib = cpu_native.library() if torch.device(device).type == "cpu" else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        spec: AttentionSpec,
        sinks: torch.Tensor | None,
        fb: ForwardBatch,
        out: torch.Tensor | None = None,
        prologue: QKPrologue | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        kv = fb.kv
        if (self.lib is None or prologue is not None or kv.dtype not in _POOL_CODES
                or spec.num_heads // spec.num_kv_heads > _MAX_GROUP):
            return super().forward(q, k, v, spec, sinks, fb, out, prologue, kv_stored)
        meta: TorchMetadata = fb.metadata
        gm = meta.groups[self.layout.layer_to_group[spec.layer_id]]
        rows, first, page_rows = kv.row_addressing(spec.layer_id)
        if kv_stored:  # a layer reading another's K/V (KV sharing): nothing to store
            pass
        elif kv.dtype == torch.float32 and k.dtype == torch.float32:
            kc, vc = k.contiguous(), v.contiguous()
            self.lib.swa_store_f32(
                rows.data_ptr(), kc.data_ptr(), vc.data_ptr(), gm.slot_mapping.data_ptr(),
                kc.shape[0], rows[0].numel(), self.page_size, page_rows, first,
            )  # fmt: skip
        else:
            kv.store(spec.layer_id, k, v, gm.slot_mapping)
        if out is None:
            out = torch.empty_like(q)
        a = _step_arrays(gm, meta, kv.is_fp8)
        native, rest = a["native"], a["rest"]
        if native.numel():
            qf = q.float().contiguous()
            of = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(qf)
            sk = None if sinks is None else sinks.float().contiguous()
            ks, vs = kv.layer_scales(spec.layer_id)
            rc = self.lib.swa_paged_attention(
                of.data_ptr(), qf.data_ptr(), rows.data_ptr(), _POOL_CODES[kv.dtype],
                _FP8_LUT.data_ptr(), ks, vs, a["slots"].data_ptr(), a["slots"].shape[1],
                a["key_pos0"].data_ptr(), a["ctx"].data_ptr(), a["qsl"].data_ptr(),
                native.data_ptr(), native.numel(), spec.num_heads, spec.num_kv_heads,
                spec.head_dim, spec.window or 0, spec.scale, spec.softcap or 0.0,
                cpu_native.ptr(sk), self.page_size, page_rows, first,
            )  # fmt: skip
            if rc == -1:
                raise ValueError(
                    f"layer {spec.layer_id} (window {spec.window}) reads keys below those its "
                    "attention group keeps: its group's window is narrower"
                )
            if rc:
                raise MemoryError(f"the native attention kernel failed (code {rc})")
            if of is not out:  # rows of the other requests are written below
                sel = _native_tokens(a)
                out[sel] = of[sel].to(out.dtype)
        if rest:
            self.attend_each(q, k, v, spec, sinks, fb, out, rest)
        return out


def _step_arrays(gm: TorchGroupMetadata, meta: TorchMetadata, fp8: bool) -> dict:
    """The step's arrays for the kernel, cached on the group's metadata (built by its first
    layer): the requests whose rows attend natively ("native", int64) and the rest ("rest", a
    list), the slots, key starts, contexts and query starts (each a few us: ~0.4 ms a group and
    step went to listing the native rows' tokens, now `_native_tokens`, when asked)."""
    a = gm._views.get("native")
    if a is None:
        qsl = meta.query_start_loc
        lens = [qsl[r + 1] - qsl[r] for r in range(len(qsl) - 1)]
        limit = 1 if fp8 else max(lens, default=0)
        native = [r for r, n in enumerate(lens) if 0 < n <= limit]
        a = {
            "native": torch.tensor(native, dtype=torch.int64),
            "rest": [r for r, n in enumerate(lens) if n > limit],
            "slots": gm.padded.contiguous(),
            "key_pos0": torch.tensor(gm.key_start, dtype=torch.int64),
            "ctx": torch.tensor(gm.context_lens, dtype=torch.int64),
            "qsl": torch.tensor(qsl, dtype=torch.int64),
        }
        gm._views["native"] = a
    return a


def _native_tokens(a: dict) -> torch.Tensor:
    """The step's token rows of the requests that attend natively (cached in `a`)."""
    if "native_tokens" not in a:
        qsl, native = a["qsl"].numpy(), a["native"].numpy()
        a["native_tokens"] = torch.from_numpy(
            np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in native] or [np.zeros(0, int)])
        ).to(torch.int64)
    return a["native_tokens"]
