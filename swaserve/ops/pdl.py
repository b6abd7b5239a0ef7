"""Programmatic dependent launch (PDL, sm_90+) between the Triton kernels of a step.

On a stream a kernel normally starts only once the one before it has finished and its writes
are flushed; the launch of the next grid then starts from nothing. A kernel launched with
`launch_pdl=True` may be launched while the kernel before it is still finishing (here: when its
programs exit, the implicit trigger), and `griddepcontrol.wait` (`pdl_wait`) blocks it until
that kernel has completed and its memory is visible. At batch 1 a decoder layer is ~7 launches
of a few microseconds each, so the overlapped launch shows.

The contract every kernel here keeps (a `USE_PDL` constexpr, the launch keyword of
`pdl_launch`): `pdl_wait(USE_PDL)` comes before the first read of anything an earlier kernel
wrote and before the first write (the step's buffers are reused memory an earlier kernel may
still read); the kernels here wait first thing. Ordering stays transitive: a kernel completes
only after its own wait returned, that is after its predecessor completed. A kernel without
PDL after one of these waits for it as usual; one of these after a kernel without PDL has its
wait return at once. CUDA graphs keep the programmatic edges captured from the stream.

Measured on the H200 (benchmarks/RESULTS.md, 2026-12-03 stop 22; Llama-3.1-8B shape, batch-1
decode graph): 4.30 ms/token without PDL, 4.257 with it. Two variants were slower and are not
kept: every program triggering its dependents at its start (`griddepcontrol.launch_dependents`,
4.68: the next kernel's programs sat resident and waiting beside the running ones), GEMV
programs asking L2 for their weight slice before the wait (4.56), and GEMV programs loading
their first weight tile into registers before the wait (4.345 against 4.251, 2026-12-05).

SWASERVE_PDL=0 turns it off (A/B runs); the Triton interpreter and GPUs before sm_90 never use
it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=8)
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (sm_90+, not interpreting, SWASERVE_PDL not
    0). Read once per device and process: every launch asks, and an eager step has hundreds."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("SWASERVE_PDL") == "0":
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_launch(enabled: bool) -> dict:
    """The launch keyword of a PDL launch (none otherwise: the interpreter takes no such
    option)."""
    return {"launch_pdl": True} if enabled else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Block until the kernel before has completed and its writes are visible (no-op without
    PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
