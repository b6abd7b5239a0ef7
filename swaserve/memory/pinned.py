"""Host memory page-locked at its exact size, for the prefix cache's host tier (host_cache.py).

torch's pinned allocator (`torch.empty(..., pin_memory=True)`) rounds every block up to the next
power of two and keeps freed blocks in its cache for reuse: a 40 GiB host tier pinned 64 GiB of
a 128 GiB machine, and kept them pinned after its engine was dropped. SGLang and vLLM met the
same (their host KV pools and CPU offload) and pin with cudaHostRegister instead; so does this:

    bytes      a private anonymous mmap of exactly the size asked: page-aligned, its pages
               untouched (no RAM) until registered
    pinned     cudaHostRegister (portable: every CUDA context sees it as pinned, so copies to
               and from it are asynchronous DMA like those of torch's pinned tensors)
    released   `release()` (the tier's close, after the page mover drained its copies), or when
               the buffer is garbage-collected: the device is synchronised (no copy may still
               read or write the range), then cudaHostUnregister. At interpreter exit nothing is
               done: the process's memory goes with it.

A tensor viewing the buffer keeps the mapping alive (torch.frombuffer holds the mmap's buffer
export), so a view that outlives `release()` reads valid, merely pageable, memory.
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref

import torch

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable
_kept: list[torch.Tensor] = []  # buffers left pinned (`_unregister`)


class PinnedHostBuffer:
    """`nbytes` of page-locked host memory as a flat uint8 tensor (`tensor`)."""

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"a pinned host buffer needs a positive size, not {nbytes}")
        # private: plain process memory (a shared anonymous map would count as shmem)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        ptr = self.tensor.data_ptr()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
        if err != 0:
            raise RuntimeError(
                f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory for the host "
                f"tier (cudaHostRegister: cudaError {err}); give --host-cache-gb less"
            )
        self._finalizer = weakref.finalize(self, _unregister, ptr, self.tensor)
        self._finalizer.atexit = False

    def release(self) -> None:
        """Unregister now (idempotent). `tensor` stays readable, no longer pinned."""
        self._finalizer()


def _unregister(ptr: int, tensor: torch.Tensor) -> None:
    # `tensor` rides along so that the mapping outlives the registration
    try:
        if torch.cuda.is_current_stream_capturing():
            # Dropped by reference counting inside a graph capture (the captures hold the
            # collector off: engine/cuda_graph.py), where a sync would break the capture:
            # the range stays pinned, and mapped, until the process ends.
            log.warning("a pinned host buffer dropped during a CUDA graph capture stays pinned")
            _kept.append(tensor)
            return
        torch.cuda.synchronize()
        err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    except Exception as e:  # a CUDA context already torn down: nothing left to unpin
        log.debug("cudaHostUnregister skipped: %s", e)
        return
    if err != 0:
        log.warning("cudaHostUnregister of %.1f GiB failed (cudaError %d)",
                    tensor.numel() / 2**30, err)  # fmt: skip


def pinned_empty(shape: tuple[int, ...]) -> tuple[torch.Tensor, PinnedHostBuffer]:
    """A uint8 host tensor of `shape`, page-locked at its exact size, and the buffer that owns
    the pinning (keep it; `release()` it when done). Raises a RuntimeError naming the size when
    the host cannot lock that much (no fallback to torch's allocator, which would lock more)."""
    buf = PinnedHostBuffer(math.prod(shape))
    return buf.tensor.view(shape), buf
