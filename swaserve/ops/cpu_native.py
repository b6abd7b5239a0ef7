"""The CPU's native kernels (`swaserve/ops/native/*.c`, one library), built at first use (issue
14, item 4).

Plain C99 with OpenMP, compiled by the system's C compiler (`$CC`, else `cc`) into
`$SWASERVE_CACHE/native` (~/.cache/swaserve/native) and loaded through ctypes: no torch headers,
so a build takes ~1 s, not the minute of a torch extension. The file name carries a hash of the
source, the compiler's version, the flags and this CPU's feature flags (`-march=native`: a
cache shared with another CPU builds its own). It is written under a temporary name and
renamed, so processes that build at once each load a whole file.

The library links `libgomp.so.1`, the soname torch's own OpenMP runtime has; torch is imported
first, so the loader resolves it to that runtime: one thread pool, and `torch.set_num_threads`
applies to these kernels too.

No compiler, a failed build or `SWASERVE_NATIVE=0`: `library()` is None (a warning says why)
and the callers keep their torch code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from swaserve.weights.gguf import cache_root

log = logging.getLogger(__name__)

_NATIVE = Path(__file__).with_name("native")
_SOURCES = sorted(_NATIVE.glob("*.c"))
_HASHED = sorted(_NATIVE.glob("*.[ch]"))  # the headers too: a change to one rebuilds
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu99")
_I64, _F32, _PTR, _INT = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int

# result and argument types of the exported functions, by file
_SIGNATURES = {
    # native/paged_attention.c
    "swa_paged_attention": (
        _INT,
        [_PTR, _PTR, _PTR, _INT, _PTR, _F32, _F32, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64,
         _I64, _I64, _I64, _I64, _F32, _F32, _PTR, _I64, _I64, _I64],
    ),
    "swa_store_f32": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64]),
    # native/bf16_screen.c
    "swa_bf16_screen_available": (_INT, []),
    "swa_bf16_screen": (_INT, [_PTR, _PTR, _PTR, _I64, _I64, _I64]),
    "swa_screen_candidates": (_I64, [_PTR, _I64, _I64, _PTR, ctypes.c_double, _PTR, _I64]),
    # native/act_mul.c
    "swa_act_mul": (_INT, [_PTR, _PTR, _I64, _I64, _I64, _INT]),
    # native/norms.c
    "swa_rmsnorm": (None, [_PTR, _PTR, _I64, _PTR, _F32, _I64, _I64]),
    "swa_add_rmsnorm": (
        None, [_PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _F32, _PTR, _F32, _I64, _I64]
    ),
    "swa_qk_prologue": (
        None, [_PTR, _PTR, _I64, _PTR, _F32, _PTR, _PTR, _I64, _I64, _I64]
    ),
}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str) -> Path:
    source = b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in _HASHED)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join([source, version.encode(), " ".join(_FLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    out_dir = cache_root() / "native"
    path = out_dir / f"swaserve-cpu-{key}.so"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run(
            [cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed on {_SOURCES[0].parent}:\n{res.stderr[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, a failed build, `SWASERVE_NATIVE=0`)."""
    if os.environ.get("SWASERVE_NATIVE") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): the CPU keeps torch's attention")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("the CPU's native kernels are not built (%s): torch's attention instead", e)
        return None
    for name, (res, args) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def available() -> bool:
    return library() is not None


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for ctypes (None for None)."""
    return None if t is None else t.data_ptr()
