"""Cheaper nested `@triton.jit` calls under TRITON_INTERPRET=1, for the test suite.

Triton's interpreter (3.6) re-patches `triton.language` on every call of a jit helper from a
kernel (`InterpretedFunction.__call__` -> `_patch_lang`: `inspect.getmembers` over the language
modules, ~1.5 ms a call here), although the kernel's launch (`GridExecutor.__call__`) has
patched the same modules for the whole grid and restores them once at its end. Helpers run per
program, so a kernel of a few hundred programs calling a handful of helpers (`pdl_wait`,
`round_to`, `rounded`, the rope-store epilogue) spent a third of an engine test in that patching
(tests/kernels/test_triton_ops.py::test_triton_fused_ops_model: 30 s of 84 under cProfile).

`install()` makes a helper call skip the re-patch when a launch is running whose patches cover
the helper's language modules; anything else takes Triton's own path. A launch also patches
`triton.language.core` once up front (as a call of `tl.cdiv` would), so that the standard
library's helpers (`tl.cdiv`, `tl.sum`, `tl.flip`, ...), which see `core`, are covered too.
Semantics are unchanged: a helper runs its rewritten body on the same patched modules as before.
If Triton's internals differ from what this expects, nothing is installed."""

from __future__ import annotations

import functools
import os

_running: list[frozenset[int]] = []  # per launch in progress: ids of the modules it patched


@functools.cache  # asked on every helper call: a module's globals are walked once per function
def _langs(fn: object) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in getattr(fn, "__globals__", {}).values()
                     if v is tl or v is tl.core)  # fmt: skip


def install() -> bool:
    """Install under TRITON_INTERPRET=1; returns whether it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    grid_cls, fn_cls = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or getattr(fn_cls, "_swaserve_fast", False):
        return False
    if not all(hasattr(x, a) for x, a in ((fn_cls, "rewrite"), (ti, "InterpreterError"))):
        return False
    import triton.language as tl

    std = getattr(tl.cdiv, "fn", None)  # a standard-library helper: its globals hold `core`
    if std is None or not hasattr(ti, "_patch_lang"):
        return False
    std_langs = _langs(std)
    launch, device_call = grid_cls.__call__, fn_cls.__call__

    def launch_tracked(self, *args, **kwargs):
        core_patch = ti._patch_lang(std)  # restored after the launch's own (LIFO)
        _running.append(_langs(self.fn) | std_langs)
        try:
            return launch(self, *args, **kwargs)
        finally:
            _running.pop()
            core_patch.restore()

    def device_call_fast(self, *args, **kwargs):
        if not _running or not _langs(self.fn) <= _running[-1]:
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()  # what Triton's own call does after its re-patch
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    grid_cls.__call__ = launch_tracked
    fn_cls.__call__ = device_call_fast
    fn_cls._swaserve_fast = True
    return True
